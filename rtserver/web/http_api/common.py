"""What every HTTP door shares: JSON errors with stable codes, the endpoint wrapper (the shared
admission path of web/admission.py; the body declared as JSON, read and parsed), the door's way to the
turn service (`turns`, `api_client`), task calls held against the API budget, and the checks of
fields the doors have in common.

Every error is JSON `{"error": {"code", "message", "type", "param"}}` with a stable `code` (the same
codes as the WebSocket protocol) — the shape the `openai` client reads.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ...engine.backend import FinishReason, SamplingParams, SequenceResult
from ...tasks import Task, TaskError, TaskOutput
from ...tasks import bounds as B
from .. import protocol as P
from ..admission import Admission, Refused, Surface, bearer
from ..connection import client_ip
from ..errors import GenerationFailed, error_code
from ..ratelimit import retry_after_header
from ..state import AppState
from ..turns import ChatTurns, Client

log = logging.getLogger("rtserver.http")

JSONObject = dict[str, object]  # a request's JSON body (bodies.py makes it a model)
Handler = Callable[[Request, AppState, JSONObject], Awaitable[Response]]
MAX_SHOWN_CHARS = 60  # of a client's Content-Type in an error message

STATUS = {
    "unknown_task": 404,
    "input_too_long": 413,
    "request_too_large": 413,
    "body_too_large": 413,
    "unsupported_media_type": 415,
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


def api(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
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
            body = await _json_body(request, state) if request.method == "POST" else {}
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


async def _json_body(request: Request, state: AppState) -> JSONObject:
    _require_json(request)
    raw = await _read_body(request, P.http_max_bytes(state.settings))
    try:  # strict decoding: no surrogates smuggled in as UTF-8 bytes (json.loads lets them pass)
        body = P.loads(raw.decode(json.detect_encoding(raw)))
    except ValueError as exc:  # UnicodeDecodeError included
        raise HTTPError("bad_json", f"body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise HTTPError("bad_json", "body must be a JSON object")
    return body


def _require_json(request: Request) -> None:
    """A body declared as JSON, before it is read. A page may send a form or text/plain to any site
    without asking it first; only a JSON body needs the site's consent (a CORS preflight, which this
    server never grants), so no foreign page can post to the API from a browser here."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        shown = repr(media[:MAX_SHOWN_CHARS]) if media else "none"
        raise HTTPError(
            "unsupported_media_type",
            f"the body must be sent with Content-Type: application/json (this request's: {shown})",
            status=415,
        )


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


# -- generations ---------------------------------------------------------------------------------------
def turns(request: Request) -> ChatTurns:
    """The turn service every chat door calls (the hub's)."""
    hub_turns: ChatTurns = request.app.state.hub.turns
    return hub_turns


def api_client(request: Request) -> Client:
    """The caller as the turn service knows it: the API door, its address's budget."""
    return Client(Surface.API, client_ip(request))


async def run_held_task(
    request: Request, state: AppState, name: str, raw_input: object, options: dict[str, object] | None
) -> TaskOutput:
    """A stateless task call, its most tokens held against this client's API budget while it runs."""
    admission: Admission = request.app.state.admission
    held = await admission.reserve_queued(Surface.API, client_ip(request), state.tasks.cost(name, options))
    try:
        out = await state.tasks.run(state.backend_for(name), name, raw_input, options, scope="api")
        held.release(out.usage.get("prompt_tokens", 0) + out.usage.get("generated_tokens", 0))
        return out
    finally:
        held.release()  # a call that failed pays what it held


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """Server-sent events, unbuffered by proxies."""
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def finish_reason(reason: FinishReason) -> str:
    return "length" if reason is FinishReason.LENGTH else "stop"


def openai_usage(result: SequenceResult) -> dict[str, object]:
    u = result.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.generated_tokens,
        "total_tokens": u.prompt_tokens + u.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


# -- fields --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def fields() -> Iterator[None]:
    """A field refused by the bounds table (tasks/bounds.py) becomes an HTTP error naming it."""
    try:
        yield
    except B.BoundError as exc:
        raise HTTPError(exc.code, exc.message, exc.param) from None


def task_sampling(
    task: Task, options: dict[str, object] | None, names: dict[str, str] | None = None
) -> SamplingParams:
    """A task's decoding with a client's overrides; an error names the client's field (`names` maps
    the task's key to it)."""
    try:
        return task.sampling(options or None)
    except TaskError as exc:
        param = (names or {}).get(exc.param or "", exc.param)
        raise HTTPError(exc.code, exc.message, param) from None


def check_prompt(state: AppState, prompt_tokens: int, new_tokens: int, param: str) -> None:
    """The prompt and the tokens asked for fit one sequence (engine.max_sequence_tokens)."""
    limit = state.settings.engine.max_sequence_tokens
    if prompt_tokens + new_tokens > limit:
        raise HTTPError(
            "request_too_large",
            f"the prompt ({prompt_tokens} tokens) plus {new_tokens} new tokens exceeds the "
            f"{limit}-token limit: shorten '{param}' or ask for fewer tokens",
            param,
        )
