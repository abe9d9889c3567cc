"""HTTP API: tasks (`/v1/tasks`), the write-ups' compatible `/sentiment` and `/chat`, and the
OpenAI-compatible `/v1/chat/completions` (plain and SSE streaming) and `/v1/models`.

Every error is JSON `{"error": {"code", "message", "type", "param"}}` with a stable `code` (the same
codes as the WebSocket protocol) — the shape the `openai` client reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine.backend import FinishReason, Generation, SamplingError, SamplingParams, SequenceResult
from ..tasks import Task, TaskError
from ..tasks import bounds as B
from ..tasks.chat import ChatPrompt, ChatTask
from . import events
from . import protocol as P
from .admission import Admission, Refused, Surface, bearer
from .connection import client_ip
from .errors import GenerationFailed, error_code
from .ratelimit import retry_after_header
from .state import AppState

log = logging.getLogger("rtserver.http")

STATUS = {
    "unknown_task": 404,
    "input_too_long": 413,
    "request_too_large": 413,
    "body_too_large": 413,
    "overloaded": 429,
    "rate_limited": 429,
    "not_ready": 503,
    "shutting_down": 503,
    "unauthorized": 401,
    "internal": 500,
    "backend_unavailable": 503,
    "unavailable": 503,
}


class HTTPError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None, status: int | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param
        self.status = status or STATUS.get(code, 400)


def error_response(
    state: AppState, code: str, message: str, param: str | None = None, status: int | None = None
) -> JSONResponse:
    state.metrics.error(code)
    status = status or STATUS.get(code, 400)
    kind = (
        "invalid_request_error"
        if status < 500 and status not in (401, 429)
        else "authentication_error"
        if status == 401
        else "rate_limit_error"
        if status == 429
        else "server_error"
    )
    return JSONResponse(
        {"error": {"code": code, "message": message, "type": kind, "param": param}}, status_code=status
    )


def refused_response(state: AppState, refused: Refused) -> JSONResponse:
    """An admission refusal as an HTTP error (with Retry-After when it says when to retry)."""
    response = error_response(state, refused.code, refused.message, status=refused.status)
    if refused.retry_after_s > 0:
        response.headers["Retry-After"] = retry_after_header(refused.retry_after_s)
    return response


def _api(handler):
    """Wraps an endpoint: auth, readiness, body parsing and error mapping."""

    async def endpoint(request: Request) -> Response:
        state: AppState = request.app.state.rt
        admission: Admission = request.app.state.admission
        ip = client_ip(request)
        try:
            admission.authorize(Surface.API, bearer(request.headers), ip)
            await admission.take_request(ip)
            admission.check_serving()
        except Refused as refused:
            return refused_response(state, refused)
        try:
            body = None
            if request.method == "POST":
                raw = await _read_body(request, P.http_max_bytes(state.settings))
                try:  # strict decoding: no surrogates smuggled in as UTF-8 bytes (json.loads lets them pass)
                    body = P.loads(raw.decode(json.detect_encoding(raw)))
                except ValueError as exc:  # UnicodeDecodeError included
                    raise HTTPError("bad_json", f"body is not valid JSON ({exc})") from None
                if not isinstance(body, dict):
                    raise HTTPError("bad_json", "body must be a JSON object")
            return await handler(request, state, body)
        except Refused as refused:
            return refused_response(state, refused)
        except HTTPError as exc:
            return error_response(state, exc.code, exc.message, exc.param, exc.status)
        except Exception as exc:
            code, message = error_code(exc)
            if isinstance(exc, GenerationFailed):  # the backend logged its cause
                log.warning("request failed: %s", message)
            elif code == "internal":
                log.exception("request failed")
            return error_response(state, code, message)

    return endpoint


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with body_too_large as soon as it is known to be over `limit` (from
    Content-Length, or while reading) instead of after buffering all of it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise HTTPError("body_too_large", f"request body is larger than {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPError("body_too_large", f"request body is larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _history(value: Any) -> list[dict]:
    """A validated user/assistant history ending with a user message, within the size bounds."""
    if not isinstance(value, list) or not value:
        raise HTTPError(
            "invalid_input", "'history' must be a non-empty list of {role, content} messages", "history"
        )
    count, chars = B.SIZES["history"], B.SIZES["text_chars"]
    if len(value) > count:
        raise HTTPError(
            "request_too_large", f"'history' has {len(value)} messages, the limit is {count}", "history"
        )
    out, total = [], 0
    for i, m in enumerate(value):
        if (
            not isinstance(m, dict)
            or m.get("role") not in ("user", "assistant")
            or not isinstance(m.get("content"), str)
        ):
            raise HTTPError(
                "invalid_input",
                f'history[{i}] must be {{"role": "user"|"assistant", "content": string}}',
                "history",
            )
        total += len(m["content"])
        if total > chars:  # checked before any message is tokenized
            raise HTTPError(
                "request_too_large", f"'history' has more than {chars} characters of content", "history"
            )
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] != "user":
        raise HTTPError("invalid_input", "the last history message must be the user's", "history")
    return out


def _start(
    request: Request,
    state: AppState,
    prompt: list[int],
    params: SamplingParams,
    session_key: str | None = None,
    public_tokens: int = 0,
) -> Generation:
    """A generation on the chat backend, its tokens held against this client's API budget until it ends."""
    admission: Admission = request.app.state.admission
    held = admission.reserve(Surface.API, client_ip(request), len(prompt) + params.max_new_tokens)
    try:
        stream = state.backend.generate(prompt, params, session_key=session_key, public_tokens=public_tokens)
    except BaseException:
        held.release(0)
        raise
    admission.release_when_done(held, stream, len(prompt))
    return stream


@contextlib.contextmanager
def _fields() -> Iterator[None]:
    """A field refused by the bounds table (tasks/bounds.py) becomes an HTTP error naming it."""
    try:
        yield
    except B.BoundError as exc:
        raise HTTPError(exc.code, exc.message, exc.param) from None


def _task_sampling(task: Task, options: Any, names: dict[str, str] | None = None) -> SamplingParams:
    """A task's decoding with a client's overrides; an error names the client's field (`names` maps
    the task's key to it)."""
    try:
        return task.sampling(options or None)
    except TaskError as exc:
        param = (names or {}).get(exc.param or "", exc.param)
        raise HTTPError(exc.code, exc.message, param) from None


def _task_text(task: Task, raw: Any, param: str) -> None:
    """A stateless task's input text checked (type, emptiness, size) before it runs, naming the field."""
    try:
        task.clean_text(raw.get("text") if isinstance(raw, dict) else raw)
    except TaskError as exc:
        raise HTTPError(exc.code, exc.message, param) from None


def _check_prompt(state: AppState, prompt_tokens: int, new_tokens: int, param: str) -> None:
    """The prompt and the tokens asked for fit one sequence (engine.max_sequence_tokens)."""
    limit = state.settings.engine.max_sequence_tokens
    if prompt_tokens + new_tokens > limit:
        raise HTTPError(
            "request_too_large",
            f"the prompt ({prompt_tokens} tokens) plus {new_tokens} new tokens exceeds the "
            f"{limit}-token limit: shorten '{param}' or ask for fewer tokens",
            param,
        )


def _optional(body: dict, key: str, kind: type | tuple[type, ...], what: str, chars: int = 0) -> None:
    """An accepted field that must be null or of `kind` (strings at most `chars` characters)."""
    value = body.get(key)
    if value is None:
        return
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise HTTPError("invalid_field", f"'{key}' must be {what}", key)
    if isinstance(value, str) and len(value) > chars:
        raise HTTPError("invalid_field", f"'{key}' must be {what} of at most {chars} characters", key)


async def _generate(
    request: Request,
    state: AppState,
    prompt: list[int],
    params: SamplingParams,
    endpoint: str,
    session_key: str | None = None,
    public_tokens: int = 0,
) -> SequenceResult:
    stream = _start(request, state, prompt, params, session_key, public_tokens)
    try:
        result = await stream.result()
    except asyncio.CancelledError:
        stream.cancel()
        raise
    if result.finish_reason is FinishReason.ERROR:
        raise GenerationFailed(result)
    state.metrics.observe_generation(endpoint, result)
    state.metrics.requests.labels(endpoint, "chat").inc()
    return result


async def _stateless_chat(
    request: Request, state: AppState, history_value: Any, options: Any, endpoint: str
) -> tuple[SequenceResult, dict]:
    chat = state.tasks.chat
    if options is not None and not isinstance(options, dict):
        raise HTTPError("invalid_field", "'options' must be an object of decoding settings", "options")
    params = _task_sampling(chat.task, options)  # before any tokenization
    history = _history(history_value)
    earlier = [
        m if m["role"] == "assistant" else {**m, "content": chat.clean_message(m["content"])}
        for m in history[:-1]
    ]
    turn = chat.prepare_turn(earlier, history[-1]["content"])
    result = await _generate(
        request, state, turn.prompt_ids, params, endpoint, public_tokens=turn.public_tokens
    )
    return result, chat.parse(result.text)


# -- tasks ---------------------------------------------------------------------------------------


async def list_tasks(request: Request, state: AppState, body: Any) -> Response:
    reg = state.tasks
    return JSONResponse({"tasks": reg.describe(), "auto_tasks": list(reg.auto_tasks)})


async def run_task(request: Request, state: AppState, body: dict) -> Response:
    name = request.path_params["name"]
    if "input" not in body:
        raise HTTPError("missing_field", '\'input\' is required, e.g. {"input": {"text": "..."}}', "input")
    options = body.get("options")
    if options is not None and not isinstance(options, dict):
        raise HTTPError("invalid_field", "'options' must be an object of decoding settings", "options")
    reg = state.tasks
    task = reg.get(name)
    if isinstance(task, ChatTask):
        inp = body["input"]
        if not isinstance(inp, dict) or "history" not in inp:
            raise HTTPError("invalid_input", f'{name} takes {{"history": [{{role, content}}, ...]}}', "input")
        result, output = await _stateless_chat(request, state, inp["history"], options, "http_task")
        timing = {"queued_ms": result.queued_ms, "ttft_ms": result.ttft_ms, "total_ms": result.total_ms}
        return JSONResponse(
            {
                "task": name,
                "output": output,
                "text": result.text,
                "usage": events.usage_json(result.usage),
                "timing": timing,
                "cached": False,
            }
        )
    _task_text(task.task, body["input"], "input")  # refused here with the field named, as below
    if options:
        _task_sampling(task.task, options)
    out = await reg.run(state.backend_for(name), name, body["input"], options, scope="api")
    state.metrics.requests.labels("http", "task").inc()
    return JSONResponse(out.to_json())


async def sentiment(request: Request, state: AppState, body: dict) -> Response:
    if "text" not in body:
        raise HTTPError("missing_field", "'text' is required", "text")
    _task_text(state.tasks.get("sentiment").task, body["text"], "text")
    out = await state.tasks.run(
        state.backend_for("sentiment"), "sentiment", {"text": body["text"]}, scope="api"
    )
    state.metrics.requests.labels("http", "task").inc()
    return JSONResponse(dict(out.output))


async def chat(request: Request, state: AppState, body: dict) -> Response:
    if "history" not in body:
        raise HTTPError("missing_field", "'history' is required", "history")
    result, output = await _stateless_chat(request, state, body["history"], body.get("options"), "http_chat")
    return JSONResponse({**output, "usage": events.usage_json(result.usage)})


# -- OpenAI-compatible ---------------------------------------------------------------------------

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


def _refuse_unsupported(body: dict) -> None:
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
    with _fields():
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
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        no("response_format", 'only {"type": "text"}')
    short = B.SIZES["short_chars"]
    for key in ("model", "user", "service_tier"):
        _optional(body, key, str, "a string", short)
    _optional(body, "metadata", dict, "an object")


def _stream_usage(body: dict) -> bool:
    """`stream_options.include_usage`, checked (an object holding a boolean)."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise HTTPError("invalid_field", "'stream_options' must be an object", "stream_options")
    usage = opts.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise HTTPError(
            "invalid_field", "'stream_options.include_usage' must be true or false", "stream_options"
        )
    return bool(usage)


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


def _content(m: dict, i: int) -> str:
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
    out: list[dict] = []
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


def _openai_params(state: AppState, body: dict) -> SamplingParams:
    """The chat task's decoding with the request's fields, each checked against the bounds table and
    the task's own range, the error naming the request's field."""
    task = state.tasks.chat.task
    overrides: dict = {}
    names: dict[str, str] = {}
    cap = state.settings.security.api_max_tokens
    with _fields():
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
        params = _task_sampling(task, overrides, names)
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


def _finish(reason: FinishReason) -> str:
    return "length" if reason is FinishReason.LENGTH else "stop"


def _openai_usage(result: SequenceResult) -> dict:
    u = result.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.generated_tokens,
        "total_tokens": u.prompt_tokens + u.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


async def chat_completions(request: Request, state: AppState, body: dict) -> Response:
    _refuse_unsupported(body)
    include_usage = _stream_usage(body)
    params = _openai_params(state, body)  # the cheap checks first: no template rendered for a bad one
    _messages_size(body.get("messages"))
    prompt = _openai_prompt(state, body.get("messages"))
    _check_prompt(state, len(prompt.ids), params.max_new_tokens, "messages")
    model = state.model_id
    cid = "chatcmpl-" + secrets.token_hex(12)
    created = int(time.time())
    if not body.get("stream"):
        result = await _generate(
            request, state, prompt.ids, params, "openai", public_tokens=prompt.public_tokens
        )
        return JSONResponse(
            {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": _finish(result.finish_reason),
                        "message": {"role": "assistant", "content": result.text},
                        "logprobs": None,
                    }
                ],
                "usage": _openai_usage(result),
            }
        )
    # Overloaded etc. raise here, before the 200
    gen = _start(request, state, prompt.ids, params, public_tokens=prompt.public_tokens)
    # The response starts with the first token: until then nothing is written to this client, so in a
    # burst every request's generation reaches its backend (a remote server: its upstream request is
    # written) before any response's headers and role chunk take their socket writes, and the role
    # chunk and the first token go out in one write (README, "Remote backends").
    first = await _first_text(request, gen)
    if first is _GONE:
        return Response(status_code=499)  # the client left before the first token (nobody reads it)

    def chunk(delta: dict, finish: str | None = None, usage: Any = None, choices: bool = True) -> str:
        data: dict = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
            if choices
            else [],
        }
        if include_usage:
            data["usage"] = usage
        return "data: " + json.dumps(data, ensure_ascii=False) + "\n\n"

    async def events():
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
            yield chunk({}, _finish(result.finish_reason))
            if include_usage:
                yield chunk({}, usage=_openai_usage(result), choices=False)
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                gen.cancel()  # client went away mid-stream

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


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


# -- rtserver as an inference server for other hubs (model.backend = "openai") ----------------------

COMPLETION_FIELDS = {
    "model",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "repeat_penalty",
    "min_tokens",
    "seed",
    "stop",
    "ignore_eos",
    "logprobs",
    "return_token_ids",
    "cache_prompt",
    "score_candidates",
    "rtserver_session",
    "rtserver_public_tokens",
    "n",
    "user",
}


def _number(body: dict, key: str, default: Any, field: str | None = None, hi: float | None = None) -> Any:
    """`body[key]` checked against the bounds table's `field` (the key itself by default), or `default`
    when absent or null."""
    value = body.get(key)
    return default if value is None else B.number(key, value, B.DECODING[field or key], None, hi)


def _token_ids(value: Any, what: str, vocab: int, most: int) -> list[int]:
    if not (isinstance(value, list) and 0 < len(value) <= most):
        raise HTTPError("invalid_field", f"'{what}' must be a list of 1..{most} token ids", what)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise HTTPError("invalid_field", f"'{what}' must be a list of token ids (integers)", what)
    if any(not 0 <= t < vocab for t in value):
        raise HTTPError("invalid_field", f"'{what}' holds a token id outside 0..{vocab - 1}", what)
    return value


def _completion_params(body: dict, max_tokens: int) -> SamplingParams:
    """Decoding from a /v1/completions body, every field checked against the bounds table."""
    with _fields():
        stop = body.get("stop")
        stop = [] if stop is None else B.stop_list("stop", stop, B.SIZES["node_stop"], one_string=True)
        top_k = body.get("top_k")
        if top_k == -1 and not isinstance(top_k, bool):
            top_k = 0  # vLLM's spelling of "off"
        _number(body, "min_p", 0.0)  # accepted for llama-server's and vLLM's clients, not applied
        penalty = _number(body, "repetition_penalty", None)
        new_tokens = _number(body, "max_tokens", min(16, max_tokens), "max_new_tokens", max_tokens)
        params = SamplingParams(
            temperature=_number(body, "temperature", 1.0),
            top_p=_number(body, "top_p", 1.0),
            top_k=0 if top_k is None else B.number("top_k", top_k, B.DECODING["top_k"]),
            max_new_tokens=new_tokens,
            min_new_tokens=_number(body, "min_tokens", 0, "min_new_tokens", new_tokens),
            repetition_penalty=penalty
            if penalty is not None
            else _number(body, "repeat_penalty", 1.0, "repetition_penalty"),
            seed=_number(body, "seed", None),
            stop=stop,
            ignore_eos=B.flag("ignore_eos", body.get("ignore_eos", False)),
        )
    try:
        params.validate()
    except SamplingError as exc:
        raise HTTPError("bad_decoding", str(exc)) from None
    return params


def _candidates(value: Any, vocab: int) -> list[list[int]]:
    """`score_candidates`: 1..32 token-id lists of 1..64 tokens, at most 1024 tokens in all."""
    count, each, total = (B.SIZES[k] for k in ("candidates", "candidate_tokens", "candidates_tokens"))
    if not (isinstance(value, list) and 0 < len(value) <= count):
        raise HTTPError(
            "invalid_field",
            f"'score_candidates' must be a list of 1..{count} token-id lists",
            "score_candidates",
        )
    out = [_token_ids(c, "score_candidates", vocab, each) for c in value]
    if sum(map(len, out)) > total:
        raise HTTPError(
            "request_too_large",
            f"'score_candidates' holds more than {total} tokens in all",
            "score_candidates",
        )
    return out


def _public_tokens(body: dict, prompt_tokens: int) -> int:
    """`rtserver_public_tokens`: how much of the prompt a hub shares across its sessions (default: all
    of it, this node API being a trusted hub's)."""
    value = body.get("rtserver_public_tokens")
    if value is None:
        return prompt_tokens
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= prompt_tokens:
        raise HTTPError(
            "invalid_field",
            f"'rtserver_public_tokens' must be an integer 0..{prompt_tokens} (the prompt's length)",
            "rtserver_public_tokens",
        )
    return value


async def completions(request: Request, state: AppState, body: dict) -> Response:
    """OpenAI-style /v1/completions over token ids, for hubs that use this node as their inference
    server: `prompt` is token ids (or text); `stream` with `stream_options.include_usage`;
    `return_token_ids` puts each chunk's token ids in `choices[0].token_ids` (as vLLM does);
    `rtserver_session` keeps the prompt's KV for that key's next turn; `rtserver_public_tokens` is how
    many leading prompt tokens this node's prefix cache may share (default: all); `score_candidates` (a
    list of token-id lists) answers `choices[0].candidate_logprobs`, the log-probability of each
    continuation."""
    unknown = sorted(set(body) - COMPLETION_FIELDS)
    if unknown:
        raise HTTPError("unsupported", f"'{unknown[0]}' is not supported by /v1/completions here", unknown[0])
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise HTTPError("unsupported", "'n' is not supported: only n = 1", "n")
    with _fields():
        for name in ("stream", "return_token_ids", "cache_prompt"):
            if body.get(name) is not None:
                B.flag(name, body[name])
        logprobs = body.get("logprobs")
        if logprobs is not None and logprobs is not False and _number(body, "logprobs", 0):
            raise HTTPError(
                "unsupported",
                "'logprobs' is not supported: log-probabilities are not returned "
                "(score_candidates gives those of given continuations)",
                "logprobs",
            )
    for name in ("model", "user"):
        _optional(body, name, str, "a string", B.SIZES["short_chars"])
    include_usage = _stream_usage(body)
    session = body.get("rtserver_session")
    chars = B.SIZES["session_chars"]
    if session is not None and not (isinstance(session, str) and 0 < len(session) <= chars):
        raise HTTPError(
            "invalid_field",
            f"'rtserver_session' must be a string of 1..{chars} characters",
            "rtserver_session",
        )
    backend = state.backend
    tokenizer = backend.tokenizer
    vocab = len(tokenizer)
    limit = state.settings.engine.max_sequence_tokens
    candidates = body.get("score_candidates")
    scoring = candidates is not None
    params = _completion_params(body, state.settings.security.api_max_tokens)  # checked when scoring too
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        with _fields():
            B.text("prompt", prompt, B.SIZES["text_chars"])
        prompt = tokenizer.encode(prompt, add_special_tokens=False)
        if len(prompt) > limit:
            _check_prompt(state, len(prompt), 0, "prompt")
    elif isinstance(prompt, list) and len(prompt) > limit:
        _check_prompt(state, len(prompt), 0, "prompt")  # refused before its ids are read
    prompt = _token_ids(prompt, "prompt", vocab, limit)
    public = _public_tokens(body, len(prompt))
    created, cid, model = int(time.time()), "cmpl-" + secrets.token_hex(12), state.model_id
    if scoring:
        lists = _candidates(candidates, vocab)
        _check_prompt(state, len(prompt), max(map(len, lists)), "prompt")
        scores = await backend.score(prompt, lists, public_tokens=public)
        return JSONResponse(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": "",
                        "finish_reason": "length",
                        "logprobs": None,
                        "candidate_logprobs": scores,
                    }
                ],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": 0, "total_tokens": len(prompt)},
            }
        )
    _check_prompt(state, len(prompt), params.max_new_tokens, "prompt")
    with_ids = body.get("return_token_ids") is True

    def choice(text: str, finish: str | None, ids: list[int] | None = None) -> dict:
        c: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        if with_ids and ids is not None:
            c["token_ids"] = ids
        return c

    key = f"remote:{session}" if session else None  # never collides with this node's own sessions
    if not body.get("stream"):
        result = await _generate(request, state, prompt, params, "completions", key, public)
        return JSONResponse(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [choice(result.text, _finish(result.finish_reason), result.token_ids)],
                "usage": _openai_usage(result),
            }
        )
    gen = _start(request, state, prompt, params, key, public)

    def sse(data: dict) -> str:
        return (
            "data: "
            + json.dumps(
                {"id": cid, "object": "text_completion", "created": created, "model": model, **data},
                ensure_ascii=False,
            )
            + "\n\n"
        )

    async def stream():
        finished = False
        try:
            async for ev in gen:
                if ev.text or with_ids:
                    yield sse({"choices": [choice(ev.text, None, [ev.token_id])]})
            result = await gen.result()
            finished = True
            if result.finish_reason is FinishReason.ERROR:
                failed = GenerationFailed(result)
                state.metrics.error(failed.code)
                yield (
                    "data: "
                    + json.dumps({"error": {"code": failed.code, "message": failed.message}})
                    + "\n\n"
                )
                return
            state.metrics.observe_generation("completions", result)
            yield sse({"choices": [choice("", _finish(result.finish_reason), [])]})
            if include_usage:
                yield sse({"choices": [], "usage": _openai_usage(result)})
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                gen.cancel()  # the hub went away mid-stream

    return StreamingResponse(
        stream(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def tokenize(request: Request, state: AppState, body: dict) -> Response:
    """llama-server's /tokenize: {"content", "add_special"} -> {"tokens"} (a hub checks that this node
    tokenizes as it does)."""
    with _fields():
        content = B.text("content", body.get("content"), B.SIZES["text_chars"])
        add_special = B.flag("add_special", body.get("add_special", False))
    return JSONResponse({"tokens": state.backend.tokenizer.encode(content, add_special_tokens=add_special)})


ROUTES = [
    ("/v1/tasks", list_tasks, ["GET"]),
    ("/v1/tasks/{name}", run_task, ["POST"]),
    ("/sentiment", sentiment, ["POST"]),
    ("/chat", chat, ["POST"]),
    ("/v1/chat/completions", chat_completions, ["POST"]),
    ("/v1/models", list_models, ["GET"]),
    ("/v1/completions", completions, ["POST"]),
    ("/tokenize", tokenize, ["POST"]),
]
