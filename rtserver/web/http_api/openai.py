"""The OpenAI-compatible door: `/v1/chat/completions` (plain and SSE streaming) and `/v1/models`.

A stream's response starts with its first token: until then nothing is written to the client, so in
a burst every request's generation reaches its backend before any response takes its socket writes.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...engine.backend import (
    TEXT,
    FinishReason,
    Generation,
    OutputFormat,
    OutputFormatError,
    SamplingError,
    SamplingParams,
    StructuredOutput,
)
from ...tasks import bounds as B
from ...tasks.chat import ChatPrompt
from ..errors import GenerationFailed
from ..state import AppState
from .common import (
    Body,
    HTTPError,
    api_client,
    check_prompt,
    event_stream,
    fields,
    finish_reason,
    openai_usage,
    optional,
    stream_usage,
    task_sampling,
    turns,
)

ACCEPTED = {
    "model",
    "messages",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "seed",
    "stop",
    "user",
    "n",
    "store",
    "metadata",
    "service_tier",
    "parallel_tool_calls",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "response_format",
    "tool_choice",
    "tools",
    "functions",
    "function_call",
    "top_logprobs",
    "logit_bias",
}


def _refuse_unsupported(body: Body) -> None:
    def no(param: str, why: str) -> None:
        raise HTTPError("unsupported", f"'{param}' is not supported: {why}", param)

    unknown = sorted(set(body) - ACCEPTED)
    if unknown:
        no(
            unknown[0],
            "unknown field for this server (supported: "
            + ", ".join(
                sorted(ACCEPTED - {"tools", "functions", "function_call", "top_logprobs", "logit_bias"})
            )
            + ")",
        )
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        no("n", "only n = 1 (one choice per request)")
    if body.get("tools") or body.get("functions") or body.get("function_call"):
        no("tools" if body.get("tools") else "functions", "tool and function calling are not available")
    if body.get("tool_choice") not in (None, "none"):
        no("tool_choice", "tool calling is not available")
    with fields():
        if body.get("logprobs") is not None and B.flag("logprobs", body["logprobs"]):
            no("logprobs", "log-probabilities are not returned")
        if body.get("top_logprobs") is not None:
            if B.number("top_logprobs", body["top_logprobs"], B.DECODING["top_logprobs"]):
                no("top_logprobs", "log-probabilities are not returned")
        for key in ("presence_penalty", "frequency_penalty"):
            if body.get(key) is not None and B.number(key, body[key], B.DECODING[key]) != 0:
                no(key, "use repetition_penalty instead")
        for key in ("stream", "store", "parallel_tool_calls"):
            if body.get(key) is not None:
                B.flag(key, body[key])
    if body.get("logit_bias"):
        no("logit_bias", "logit bias is not available")
    short = B.SIZES["short_chars"]
    for key in ("model", "user", "service_tier"):
        optional(body, key, str, "a string", short)
    optional(body, "metadata", dict, "an object")


def _messages_size(messages: Any) -> None:
    """At most SIZES["messages"] messages and SIZES["text_chars"] characters of text, checked before
    the chat template renders them."""
    if not isinstance(messages, list):
        return  # _openai_prompt says what it must be
    count, chars = B.SIZES["messages"], B.SIZES["text_chars"]
    if len(messages) > count:
        raise HTTPError(
            "request_too_large", f"'messages' has {len(messages)} messages, the limit is {count}", "messages"
        )
    total = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        parts = content if isinstance(content, list) else [content]
        if len(parts) > count:
            raise HTTPError("request_too_large", f"a message has more than {count} parts", "messages")
        for part in parts:
            text = part.get("text") if isinstance(part, dict) else part
            total += len(text) if isinstance(text, str) else 0
        if total > chars:
            raise HTTPError(
                "request_too_large", f"'messages' has more than {chars} characters of content", "messages"
            )


def _content(m: Body, i: int) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for p in c:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise HTTPError(
                    "unsupported", f"messages[{i}].content: only text parts are supported", "messages"
                )
            parts.append(p["text"])
        return "".join(parts)
    raise HTTPError(
        "invalid_field", f"messages[{i}].content must be a string or a list of text parts", "messages"
    )


def _openai_prompt(state: AppState, messages: Any) -> ChatPrompt:
    """The messages' prompt: client system messages kept (the trusted API), every content only text."""
    chat = state.tasks.chat
    if not isinstance(messages, list) or not messages:
        raise HTTPError("invalid_field", "'messages' must be a non-empty list", "messages")
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise HTTPError("invalid_field", f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise HTTPError(
                "unsupported",
                f"messages[{i}].role {role!r}: supported roles are system, developer, user, assistant",
                "messages",
            )
        out.append({"role": role, "content": _content(m, i)})
    # without a system message of its own, the chat task's system prompt goes first
    return chat.encode(out, system=not any(m["role"] == "system" for m in out))


def _openai_params(state: AppState, body: Body) -> SamplingParams:
    """The chat task's decoding with the request's fields, each checked against the bounds table and
    the task's own range, the error naming the request's field."""
    task = state.tasks.chat.task
    overrides: dict[str, Any] = {}
    names: dict[str, str] = {}
    cap = state.settings.security.api_max_tokens
    with fields():
        for src, dst in (
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("top_k", "top_k"),
            ("repetition_penalty", "repetition_penalty"),
            ("seed", "seed"),
            ("max_tokens", "max_new_tokens"),
            ("max_completion_tokens", "max_new_tokens"),
        ):
            if body.get(src) is None:
                continue
            lo, hi = task.overridable.get(dst, (None, None))
            if dst == "max_new_tokens":
                hi = cap if hi is None else min(hi, cap)
            overrides[dst], names[dst] = B.number(src, body[src], B.DECODING[dst], lo, hi), src
        if body.get("stop") is not None:
            overrides["stop"] = B.stop_list("stop", body["stop"], B.SIZES["stop"], one_string=True)
        params = task_sampling(task, overrides, names)
        params.max_new_tokens = min(params.max_new_tokens, cap)  # the task's default within the cap
        if body.get("min_tokens") is not None:
            params.min_new_tokens = int(
                B.number(
                    "min_tokens", body["min_tokens"], B.DECODING["min_new_tokens"], 0, params.max_new_tokens
                )
            )
        if body.get("ignore_eos") is not None:
            params.ignore_eos = B.flag("ignore_eos", body["ignore_eos"])
    try:
        params.validate()
    except SamplingError as exc:
        raise HTTPError("bad_decoding", str(exc)) from None
    return params


def _response_format(body: Body) -> OutputFormat:
    """`response_format` as an output format: text, any JSON object, or JSON under a schema."""
    fmt = body.get("response_format")
    if fmt is None:
        return TEXT
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return TEXT
    if kind == "json_object":
        return OutputFormat.json_object()
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise HTTPError(
                "invalid_field",
                "response_format.json_schema must be an object with a 'schema' object",
                "response_format",
            )
        out = OutputFormat.json_schema(json.dumps(schema, ensure_ascii=False))
        why = out.problem()
        if why is not None:
            raise HTTPError("bad_output_format", f"response_format: {why}", "response_format")
        return out
    raise HTTPError(
        "invalid_field",
        "response_format.type: allowed text, json_object, json_schema",
        "response_format",
    )


async def _prepared(state: AppState, fmt: OutputFormat) -> None:
    """The format compiled for the chat backend before anything is queued (off the event loop)."""
    if fmt.free:
        return
    backend = state.backend
    if not isinstance(backend, StructuredOutput):
        raise HTTPError(
            "unsupported",
            "'response_format' needs the local engine: this server's model runs on remote servers",
            "response_format",
        )
    try:
        await backend.prepare_output(fmt)
    except OutputFormatError as exc:
        raise HTTPError("bad_output_format", f"response_format: {exc}", "response_format") from None


class _Chunks:
    """The `chat.completion.chunk` events of one streamed reply; with `include_usage` every chunk has
    a `usage` (null but in the last one), as OpenAI's have."""

    def __init__(self, cid: str, created: int, model: str, include_usage: bool):
        self.cid, self.created, self.model = cid, created, model
        self.include_usage = include_usage

    def __call__(self, delta: Any, finish: str | None = None, usage: Any = None, choices: bool = True) -> str:
        data: Body = {
            "id": self.cid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
            if choices
            else [],
        }
        if self.include_usage:
            data["usage"] = usage
        return "data: " + json.dumps(data, ensure_ascii=False) + "\n\n"


async def chat_completions(request: Request, state: AppState, body: Body) -> Response:
    _refuse_unsupported(body)
    include_usage = stream_usage(body)
    params = _openai_params(state, body)  # the cheap checks first: no template rendered for a bad one
    params.output = _response_format(body)
    _messages_size(body.get("messages"))
    prompt = _openai_prompt(state, body.get("messages"))
    check_prompt(state, len(prompt.ids), params.max_new_tokens, "messages")
    await _prepared(state, params.output)
    chunks = _Chunks("chatcmpl-" + secrets.token_hex(12), int(time.time()), state.model_id, include_usage)
    if not body.get("stream"):
        return await _answer(request, state, prompt, params, chunks)
    # Overloaded etc. raise here, before the 200
    gen = await turns(request).start(
        api_client(request), prompt.ids, params, public_tokens=prompt.public_tokens
    )
    # The response starts with the first token: until then nothing is written to this client, so in a
    # burst every request's generation reaches its backend (a remote server: its upstream request is
    # written) before any response's headers and role chunk take their socket writes, and the role
    # chunk and the first token go out in one write.
    first = await _first_text(request, gen)
    if first is _GONE:
        return Response(status_code=499)  # the client left before the first token (nobody reads it)
    return event_stream(_stream(state, gen, str(first), chunks))


async def _answer(
    request: Request, state: AppState, prompt: ChatPrompt, params: SamplingParams, chunks: _Chunks
) -> Response:
    """A reply in one JSON `chat.completion`."""
    result = await turns(request).complete(
        api_client(request), prompt.ids, prompt.public_tokens, params, "openai"
    )
    return JSONResponse(
        {
            "id": chunks.cid,
            "object": "chat.completion",
            "created": chunks.created,
            "model": chunks.model,
            "choices": [
                {
                    "index": 0,
                    "finish_reason": finish_reason(result.finish_reason),
                    "message": {"role": "assistant", "content": result.text},
                    "logprobs": None,
                }
            ],
            "usage": openai_usage(result),
        }
    )


async def _stream(state: AppState, gen: Generation, first: str, chunk: _Chunks) -> AsyncIterator[str]:
    """The reply's chunks from its first text on, an error event when it failed."""
    finished = False
    try:
        head = chunk({"role": "assistant", "content": ""})
        yield head + chunk({"content": first}) if first else head
        async for ev in gen:
            if ev.text:
                yield chunk({"content": ev.text})
        result = await gen.result()
        finished = True
        if result.finish_reason is FinishReason.ERROR:
            failed = GenerationFailed(result)
            state.metrics.error(failed.code)
            error = {"code": failed.code, "type": "server_error", "message": failed.message}
            yield "data: " + json.dumps({"error": error}) + "\n\n"
            return
        state.metrics.observe_generation("openai", result)
        state.metrics.requests.labels("openai", "chat").inc()
        yield chunk({}, finish_reason(result.finish_reason))
        if chunk.include_usage:
            yield chunk({}, usage=openai_usage(result), choices=False)
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            gen.cancel()  # client went away mid-stream


_GONE = object()  # `_first_text`: the client disconnected first


async def _first_text(request: Request, gen: Generation) -> Any:
    """The text of the stream's first event that has some ("" when it ends without any), or _GONE
    (the generation cancelled) when the client disconnects before it."""

    async def first() -> str:
        async for ev in gen:
            if ev.text:
                return ev.text
        return ""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    text, gone = asyncio.ensure_future(first()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({text, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        gen.cancel()
        raise
    finally:
        for task in (text, gone):
            task.cancel()
    if not text.done() or text.cancelled():
        gen.cancel()
        return _GONE
    return text.result()


async def list_models(request: Request, state: AppState, body: Any) -> Response:
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": state.model_id,
                    "object": "model",
                    "created": int(state.started_wall),
                    "owned_by": "rtserver",
                }
            ],
        }
    )
