"""The /ws protocol: message types in and out, and the validation that turns bad input into precise codes.

Every frame is one JSON object with a `type`. `parse_client_message` checks a raw frame (binary, size,
JSON, type, fields and their types) and returns a typed message or raises `ProtocolError` with a stable
`code`, a human `message` and the request `id` when the frame carried a usable one. JSON is read by
`loads` (I-JSON and a nesting limit), which the HTTP API shares. Builders for the
server's events (`ready`, `token`, `done`, `result`, `error`, `pong`) live here too, so the wire format
is defined in one place (the agent console's /ws/console events are in console.py). The full
description is docs/protocol.md (PROTOCOL_VERSION below).
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from ..engine.backend import SequenceResult, Usage
from ..tasks import TaskOutput

PROTOCOL_VERSION = "1.1"

# Stable error codes (docs/protocol.md lists them with their meaning).
ERROR_CODES = (
    "bad_json",
    "binary_frame",
    "frame_too_large",
    "unknown_type",
    "missing_field",
    "invalid_field",
    "duplicate_id",
    "unknown_request",
    "too_many_requests",
    "chat_busy",
    "already_started",
    "unknown_task",
    "invalid_input",
    "empty_text",
    "input_too_long",
    "bad_decoding",
    "session_expired",
    "session_taken_over",
    "unauthorized",
    "forbidden_origin",
    "not_ready",
    "overloaded",
    "request_too_large",
    "cancelled",
    "internal",
    "slow_client",
    "rate_limited",
    "too_many_sessions",
    "shutting_down",
    # /ws/console (console.py)
    "console_disabled",
    "unknown_session",
    "already_taken",
    "not_taken_over",
)

MAX_ID_CHARS = 64
MAX_JSON_DEPTH = 100  # arrays/objects nested in a frame or HTTP body, the outermost one included


def transport_max_bytes(max_frame_bytes: int) -> int:
    """The hard per-frame limit to give uvicorn (`ws_max_size`): frames between `max_frame_bytes` and
    this get a `frame_too_large` error and the connection stays; bigger ones close it with 1009. HTTP
    bodies are refused above it too."""
    return max(1 << 20, 4 * max_frame_bytes)


class ProtocolError(Exception):
    """A client frame or request the server refuses; the connection stays open."""

    def __init__(self, code: str, message: str, request_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


# -- client → server ------------------------------------------------------------------------------


@dataclass
class Hello:
    session_id: str | None = None
    resume_token: str | None = None
    auth_token: str | None = None
    client: str | None = None


@dataclass
class Chat:
    id: str
    text: str
    options: dict = field(default_factory=dict)


@dataclass
class TaskCall:
    id: str
    task: str
    input: Any
    options: dict = field(default_factory=dict)


@dataclass
class Cancel:
    id: str


@dataclass
class Reset:
    pass


@dataclass
class Ping:
    data: Any = None


ClientMessage = Hello | Chat | TaskCall | Cancel | Reset | Ping
MESSAGE_TYPES = ("hello", "chat", "task", "cancel", "reset", "ping")


def _get(
    obj: dict,
    key: str,
    kinds: type | tuple,
    what: str,
    rid: str | None,
    *,
    required: bool = True,
    nullable: bool = False,
) -> Any:
    if key not in obj or (obj[key] is None and not required):
        if required:
            raise ProtocolError("missing_field", f"'{key}' is required ({what})", rid)
        return None
    value = obj[key]
    if value is None and nullable:
        return None
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ProtocolError("invalid_field", f"'{key}' must be {what}", rid)
    if not isinstance(value, kinds):
        raise ProtocolError("invalid_field", f"'{key}' must be {what}", rid)
    return value


def _request_id(obj: dict) -> str:
    rid = obj.get("id")
    if "id" not in obj:
        raise ProtocolError("missing_field", "'id' is required (a string of 1..64 characters)")
    if not isinstance(rid, str) or not 1 <= len(rid) <= MAX_ID_CHARS:
        raise ProtocolError("invalid_field", "'id' must be a string of 1..64 characters")
    return rid


def _options(obj: dict, rid: str) -> dict:
    options = obj.get("options")
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ProtocolError("invalid_field", "'options' must be an object of decoding settings", rid)
    return options


def parse_client_message(raw: str | bytes, max_frame_bytes: int) -> ClientMessage:
    """A validated client message from one WebSocket frame; raises ProtocolError."""
    obj = load_object(raw, max_frame_bytes)
    rid = obj.get("id") if isinstance(obj.get("id"), str) and len(obj.get("id")) <= MAX_ID_CHARS else None
    return _parse_object(obj, rid)


def load_object(raw: str | bytes, max_frame_bytes: int) -> dict:
    """The JSON object of one text frame (binary, size and JSON checked); raises ProtocolError."""
    if isinstance(raw, (bytes, bytearray)):
        raise ProtocolError("binary_frame", "binary frames are not accepted; send JSON text frames")
    if len(raw) > max_frame_bytes or len(raw.encode("utf-8", "surrogatepass")) > max_frame_bytes:
        raise ProtocolError("frame_too_large", f"frame is larger than {max_frame_bytes} bytes")
    try:
        obj = loads(raw)
    except ValueError as exc:
        raise ProtocolError("bad_json", f"frame is not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ProtocolError("bad_json", "frame must be a JSON object with a 'type'")
    return obj


def loads(text: str) -> Any:
    """JSON text as I-JSON (RFC 7493) and within MAX_JSON_DEPTH; raises ValueError saying what is wrong.

    Beyond `json.loads`: NaN/Infinity, numbers out of a double's range, strings with an unpaired UTF-16
    surrogate (a lone `\\udXXX` escape) and nesting deeper than MAX_JSON_DEPTH are refused. Such values
    could not be echoed back (UTF-8 has no lone surrogates, strict JSON no NaN), overflow float
    conversions, or exhaust the recursion limit of whatever serializes them later.
    """
    try:
        value = json.loads(
            text, parse_constant=_no_constant, parse_float=_finite_float, parse_int=_bounded_int
        )
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH or _MAYBE_SURROGATE.search(text):
        _check_tree(value)
    return value


_FLOAT_MAX = sys.float_info.max
_MAYBE_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]|[\ud800-\udfff]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:24]} is out of range (at most {_FLOAT_MAX:g} in magnitude)")
    return value


def _bounded_int(text: str) -> int:
    value = None if len(text) > 320 else int(text)  # a double has at most 309 integer digits
    if value is None or abs(value) > _FLOAT_MAX:
        raise ValueError(f"number {text[:24]}... is out of range (at most {_FLOAT_MAX:g} in magnitude)")
    return value


def _check_tree(value: Any) -> None:
    """Nesting depth and unpaired surrogates, without recursion (the value may be nested ~1000 deep)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                raise ValueError(
                    "a string holds an unpaired UTF-16 surrogate (a lone \\ud800-\\udfff escape); "
                    "JSON text must be valid Unicode"
                )
        elif isinstance(v, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(v, dict):
                stack.extend((k, depth) for k in v)
                stack.extend((x, depth + 1) for x in v.values())
            else:
                stack.extend((x, depth + 1) for x in v)


def _parse_object(obj: dict, rid: str | None) -> ClientMessage:
    kind = obj.get("type")
    if kind is None:
        raise ProtocolError("missing_field", "'type' is required", rid)
    if not isinstance(kind, str) or kind not in MESSAGE_TYPES:
        raise ProtocolError(
            "unknown_type", f"unknown message type {kind!r} (known: {', '.join(MESSAGE_TYPES)})", rid
        )
    if kind == "hello":
        return Hello(
            session_id=_get(obj, "session_id", str, "a string", rid, required=False),
            resume_token=_get(obj, "resume_token", str, "a string", rid, required=False),
            auth_token=_get(obj, "auth_token", str, "a string", rid, required=False),
            client=(_get(obj, "client", str, "a string", rid, required=False) or "")[:100] or None,
        )
    if kind == "ping":
        return Ping(obj.get("data"))
    if kind == "reset":
        return Reset()
    rid = _request_id(obj)
    if kind == "chat":
        return Chat(rid, _get(obj, "text", str, "a string", rid), _options(obj, rid))
    if kind == "task":
        name = _get(obj, "task", str, "a task name string", rid)
        if "input" not in obj:
            raise ProtocolError(
                "missing_field", "'input' is required (the task's input, e.g. {\"text\": ...})", rid
            )
        return TaskCall(rid, name, obj["input"], _options(obj, rid))
    return Cancel(rid)


# -- server → client ------------------------------------------------------------------------------


def dumps(event: dict) -> str:
    return json.dumps(event, ensure_ascii=False, separators=(",", ":"))


def ready_event(
    session_id: str,
    resume_token: str,
    resumed: bool,
    history_turns: int,
    limits: dict,
    tasks: list[dict],
    auto_tasks: list[str],
    history: list[dict] | None = None,
    agent: str | None = None,
) -> dict:
    """`history` (1.1): the session's messages, for a client to show what it resumed; `agent` (1.1): the
    name of the human agent answering instead of the bot, or None."""
    return {
        "type": "ready",
        "protocol": PROTOCOL_VERSION,
        "session_id": session_id,
        "resume_token": resume_token,
        "resumed": resumed,
        "history_turns": history_turns,
        "limits": limits,
        "tasks": tasks,
        "auto_tasks": auto_tasks,
        "history": [history_message(m) for m in history or ()],
        "agent": agent,
    }


def history_message(m: dict) -> dict:
    """A history entry as clients see it: {role, content} plus `agent` for a human agent's reply."""
    out = {"role": m["role"], "content": m["content"]}
    if m.get("agent"):
        out["agent"] = m["agent"]
    return out


def token_event(request_id: str, text: str) -> dict:
    return {"type": "token", "id": request_id, "text": text}


def usage_json(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.cached_tokens,
        "generated_tokens": usage.generated_tokens,
        "prefilled_tokens": usage.prefilled_tokens,
    }


def timing_json(result: SequenceResult) -> dict:
    return {
        "queued_ms": round(result.queued_ms, 2),
        "ttft_ms": None if result.ttft_ms is None else round(result.ttft_ms, 2),
        "total_ms": round(result.total_ms, 2),
    }


def done_event(request_id: str, result: SequenceResult, output: dict) -> dict:
    return {
        "type": "done",
        "id": request_id,
        "text": result.text,
        "output": output,
        "finish_reason": result.finish_reason.value,
        "usage": usage_json(result.usage),
        "timing": timing_json(result),
    }


def result_event(request_id: str, out: TaskOutput, auto: bool = False) -> dict:
    event: dict[str, Any] = {
        "type": "result",
        "id": request_id,
        "task": out.task,
        "output": out.output,
        "text": out.text,
        "usage": out.usage,
        "timing": out.timing,
        "cached": out.cached,
    }
    if auto:
        event["auto"] = True
    return event


def error_event(code: str, message: str, request_id: str | None = None, **extra: Any) -> dict:
    event: dict[str, Any] = {"type": "error", "code": code, "message": message}
    if request_id is not None:
        event["id"] = request_id
    event.update(extra)
    return event


def pong_event(data: Any = None) -> dict:
    event: dict = {"type": "pong"}
    if data is not None:
        event["data"] = data
    return event
