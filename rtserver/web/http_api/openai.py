"""The OpenAI-compatible door: `/v1/chat/completions` (plain and SSE streaming) and `/v1/models`.

With `tools`, the prompt and the call grammar come from tasks/tool_calls.py. A reply that is a call
comes back as `tool_calls` (finish_reason `tool_calls`); streamed, as deltas the `openai` client
joins by index.

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
    FinishReason,
    Generation,
    OutputFormat,
    OutputFormatError,
    SamplingError,
    SamplingParams,
    StructuredOutput,
)
from ...tasks.chat import ChatPrompt
from ...tasks.tool_calls import (
    MAX_PARALLEL_CALLS,
    CallPiece,
    CallReader,
    CallSyntax,
    ChatMessage,
    encode_tool_chat,
    parse_tool_calls,
    tool_call_format,
)
from ..errors import GenerationFailed
from ..state import AppState
from .bodies import parse
from .common import (
    HTTPError,
    JSONObject,
    api_client,
    check_prompt,
    event_stream,
    fields,
    finish_reason,
    openai_usage,
    task_sampling,
    turns,
)
from .openai_body import ChatCompletion


def _ranges(state: AppState) -> dict[str, tuple[float | None, float | None]]:
    """What a client may set of the chat task's decoding: its ranges, the tokens within the API cap."""
    task, cap = state.tasks.chat.task, state.settings.security.api_max_tokens
    ranges: dict[str, tuple[float | None, float | None]] = {}
    for key in ("temperature", "top_p", "top_k", "repetition_penalty", "seed", "max_new_tokens"):
        lo, hi = task.overridable.get(key, (None, None))
        if key == "max_new_tokens":
            hi = cap if hi is None else min(hi, cap)
        ranges[key] = (lo, hi)
    return ranges


def _openai_params(state: AppState, body: ChatCompletion) -> SamplingParams:
    """The chat task's decoding with the request's settings; an error names the request's field."""
    names = {"max_new_tokens": "max_completion_tokens" if body.max_completion_tokens else "max_tokens"}
    params = task_sampling(state.tasks.chat.task, body.overrides(), names)
    params.max_new_tokens = min(params.max_new_tokens, state.settings.security.api_max_tokens)
    if body.min_tokens is not None:
        params.min_new_tokens = body.min_tokens
    if body.ignore_eos is not None:
        params.ignore_eos = body.ignore_eos
    try:
        params.validate()
    except SamplingError as exc:
        raise HTTPError("bad_decoding", str(exc)) from None
    params.output = body.response_format
    return params


def _openai_prompt(state: AppState, messages: list[ChatMessage]) -> ChatPrompt:
    """The messages' prompt: client system messages kept (the trusted API)."""
    # without a system message of its own, the chat task's system prompt goes first
    plain = [{"role": m.role, "content": m.content} for m in messages]
    return state.tasks.chat.encode(plain, system=not any(m.role == "system" for m in messages))


def _tool_prompt(state: AppState, body: ChatCompletion) -> tuple[ChatPrompt, CallSyntax]:
    """The prompt with the functions offered (none under `tool_choice` none), calls and results."""
    chat = state.tasks.chat
    system = "" if any(m.role == "system" for m in body.messages) else chat.task.system_prompt or ""
    with fields():
        return encode_tool_chat(chat.tokenizer, body.messages, body.tools if body.calls else [], system)


async def _prepared(state: AppState, fmt: OutputFormat, param: str) -> None:
    """The format compiled for the chat backend before anything is queued (off the event loop)."""
    if fmt.free:
        return
    backend = state.backend
    if not isinstance(backend, StructuredOutput):
        raise HTTPError(
            "unsupported",
            f"'{param}' needs the local engine: this server's model runs on remote servers",
            param,
        )
    try:
        await backend.prepare_output(fmt)
    except OutputFormatError as exc:
        raise HTTPError("bad_output_format", f"{param}: {exc}", param) from None


class _Calls:
    """How a reply's calls are read: the request's functions and the syntax the prompt asked for."""

    def __init__(self, body: ChatCompletion, syntax: CallSyntax):
        self.tools, self.syntax = body.tools, syntax

    def message(self, text: str) -> tuple[JSONObject, str | None]:
        """(the reply's message, "tool_calls" or None) of a whole reply."""
        calls = parse_tool_calls(text, self.tools, self.syntax)
        if not calls:
            return {"role": "assistant", "content": text}, None
        return {"role": "assistant", "content": None, "tool_calls": [c.spec() for c in calls]}, "tool_calls"


def _call_delta(piece: CallPiece) -> JSONObject:
    """A streamed call piece as OpenAI's delta: the first names the call, the rest add arguments."""
    if piece.name:
        fn: JSONObject = {"name": piece.name, "arguments": piece.arguments}
        return {"index": piece.index, "id": piece.id, "type": "function", "function": fn}
    return {"index": piece.index, "function": {"arguments": piece.arguments}}


class _Chunks:
    """The `chat.completion.chunk` events of one streamed reply; with `include_usage` every chunk has
    a `usage` (null but in the last one), as OpenAI's have."""

    def __init__(self, cid: str, created: int, model: str, include_usage: bool):
        self.cid, self.created, self.model = cid, created, model
        self.include_usage = include_usage

    def __call__(
        self, delta: JSONObject, finish: str | None = None, usage: object = None, choices: bool = True
    ) -> str:
        data: JSONObject = {
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


async def chat_completions(request: Request, state: AppState, raw: JSONObject) -> Response:
    chat = state.tasks.chat
    most = min(chat.task.max_new_tokens, state.settings.security.api_max_tokens)
    body = parse(ChatCompletion, raw, ranges=_ranges(state), max_tokens=most)
    params = _openai_params(state, body)  # the cheap checks first: no template rendered for a bad one
    calls: _Calls | None = None
    if body.tool_chat:
        prompt, syntax = _tool_prompt(state, body)
        if body.calls:
            if not params.output.free:
                raise HTTPError(
                    "unsupported", "'response_format' cannot be used with 'tools'", "response_format"
                )
            most = MAX_PARALLEL_CALLS if body.parallel_tool_calls else 1
            params.output = tool_call_format(body.tools, body.tool_choice, syntax, most)
            calls = _Calls(body, syntax)
    else:
        prompt = _openai_prompt(state, body.messages)
    check_prompt(state, len(prompt.ids), params.max_new_tokens, "messages")
    await _prepared(state, params.output, "tools" if calls else "response_format")
    chunks = _Chunks(
        "chatcmpl-" + secrets.token_hex(12), int(time.time()), state.model_id, body.include_usage
    )
    if not body.stream:
        return await _answer(request, state, prompt, params, chunks, calls)
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
    return event_stream(_stream(state, gen, str(first), chunks, calls))


async def _answer(
    request: Request,
    state: AppState,
    prompt: ChatPrompt,
    params: SamplingParams,
    chunks: _Chunks,
    calls: _Calls | None,
) -> Response:
    """A reply in one JSON `chat.completion`."""
    result = await turns(request).complete(
        api_client(request), prompt.ids, prompt.public_tokens, params, "openai"
    )
    message: JSONObject = {"role": "assistant", "content": result.text}
    called = None
    if calls is not None:
        message, called = calls.message(result.text)
    return JSONResponse(
        {
            "id": chunks.cid,
            "object": "chat.completion",
            "created": chunks.created,
            "model": chunks.model,
            "choices": [
                {
                    "index": 0,
                    "finish_reason": called or finish_reason(result.finish_reason),
                    "message": message,
                    "logprobs": None,
                }
            ],
            "usage": openai_usage(result),
        }
    )


def _deltas(chunk: _Chunks, reader: CallReader | None, text: str, end: bool = False) -> str:
    """The chunks of a piece of reply text: content, or call pieces where the reply is a call."""
    if reader is None:
        return chunk({"content": text}) if text else ""
    shown, pieces = reader.end() if end else reader.feed(text)
    out = chunk({"content": shown}) if shown else ""
    if pieces:
        out += chunk({"tool_calls": [_call_delta(p) for p in pieces]})
    return out


async def _stream(
    state: AppState, gen: Generation, first: str, chunk: _Chunks, calls: _Calls | None
) -> AsyncIterator[str]:
    """The reply's chunks from its first text on, an error event when it failed."""
    finished = False
    reader = CallReader(calls.syntax) if calls else None
    try:
        yield chunk({"role": "assistant", "content": ""}) + _deltas(chunk, reader, first)
        async for ev in gen:
            if ev.text:
                out = _deltas(chunk, reader, ev.text)
                if out:
                    yield out
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
        rest = _deltas(chunk, reader, "", end=True)
        called = reader is not None and reader.index >= 0
        yield rest + chunk({}, "tool_calls" if called else finish_reason(result.finish_reason))
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


async def list_models(request: Request, state: AppState, body: JSONObject) -> Response:
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
