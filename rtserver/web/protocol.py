"""The /ws protocol, client side: the messages a client may send, and the validation that turns bad
input into precise codes.

Every frame is one JSON object with a `type`. `parse_client_message` checks a raw frame (binary, size,
JSON, type, fields and their types) and returns a typed message or raises `ProtocolError` with a stable
`code`, a human `message` and the request `id` when the frame carried a usable one. JSON is read by
`loads` (I-JSON and a nesting limit), which the HTTP API shares; then pydantic checks the fields against
the client message models (strict: nothing is converted). What the server sends: events.py; the JSON
Schema of both: schema.py. The full description is docs/protocol.md (PROTOCOL_VERSION below).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import field
from typing import Annotated, Any, Literal, NoReturn, get_args

import numpy as np
from pydantic import AfterValidator, ConfigDict, Field, StrictStr, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from ..config import Settings
from .display import MAX_NAME_CHARS, clean_name
from .handoff import EMAIL_RULE, MAX_EMAIL_CHARS, check_email

PROTOCOL_VERSION = "1.1"

# Stable error codes (docs/protocol.md lists them with their meaning).
ErrorCode = Literal[
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
    "task_not_allowed",  # the task is not for this caller (Task.audience)
    "invalid_input",
    "empty_text",
    "input_too_long",
    "bad_decoding",
    "bad_output_format",
    "output_truncated",
    "session_expired",
    "session_taken_over",
    "unauthorized",
    "forbidden_origin",
    "not_ready",
    "overloaded",
    "backend_unavailable",
    "unavailable",  # clustered: Redis, the session store, cannot be reached (web/cluster/)
    "request_too_large",
    "cancelled",
    "internal",
    "slow_client",
    "rate_limited",
    "over_budget",
    "too_many_sessions",
    "sessions_full",
    "store_error",
    "server_full",
    "too_many_connections",
    "hello_timeout",
    "shutting_down",
    # /ws/console (console/)
    "console_disabled",
    "unknown_session",
    "already_taken",
    "not_taken_over",
    "login_timeout",
    # hand-off to people (handoff.py, console/queue.py)
    "not_waiting",
]
ERROR_CODES: tuple[str, ...] = get_args(ErrorCode)

MAX_ID_CHARS = 64
MAX_JSON_DEPTH = 100  # arrays/objects nested in a frame or HTTP body, the outermost one included


def transport_max_bytes(max_frame_bytes: int) -> int:
    """The hard per-frame limit to give uvicorn (`ws_max_size`): frames between `max_frame_bytes` and
    this get a `frame_too_large` error and the connection stays; bigger ones close it with 1009. HTTP
    bodies are refused above it too."""
    return max(1 << 20, 4 * max_frame_bytes)


HTTP_MIN_BODY_BYTES = 256 << 10


def http_max_bytes(settings: Settings) -> int:
    """The largest HTTP body: room for the largest request the bounds let through (a prompt of
    `engine.max_sequence_tokens` token ids, the most characters of messages) and no more, since a
    body is parsed on the event loop; at least `server.max_frame_bytes`."""
    return max(HTTP_MIN_BODY_BYTES, settings.server.max_frame_bytes, 8 * settings.engine.max_sequence_tokens)


class ProtocolError(Exception):
    """A client frame or request the server refuses; the connection stays open."""

    def __init__(self, code: str, message: str, request_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


# -- client → server ------------------------------------------------------------------------------
#
# One pydantic dataclass per message type. A field's `description` says what it must be: the JSON Schema
# shows it and a refused frame's message quotes it ("'id' must be a string of 1..64 characters"). Fields
# are strict (a string is a JSON string, never a number) and checked in order, so a bad `id` is the one
# reported first. Unknown fields are ignored. `type` comes last with a default so that the server can
# build a message itself (`Hello()`); the schema still requires it in a frame (`_frame_schema`).


def _frame_schema(schema: dict[str, Any]) -> None:
    """A message's JSON Schema: `type` listed first, and required."""
    kind = schema["properties"].pop("type")
    kind.pop("default", None)
    schema["properties"] = {"type": kind, **schema["properties"]}
    schema["required"] = ["type", *schema.get("required", [])]


_MESSAGE = ConfigDict(json_schema_extra=_frame_schema)

RequestId = Annotated[
    StrictStr,
    Field(min_length=1, max_length=MAX_ID_CHARS, description=f"a string of 1..{MAX_ID_CHARS} characters"),
]
Options = Annotated[
    dict[str, object] | None,
    AfterValidator(lambda options: options or {}),
    Field(description="an object of decoding settings"),
]
OptionalString = Annotated[StrictStr | None, Field(description="a string")]


@dataclass(config=_MESSAGE)
class Hello:
    """Start a session, or resume one with `session_id` and `resume_token` from its `ready`."""

    session_id: OptionalString = None
    resume_token: OptionalString = None
    auth_token: OptionalString = None
    client: Annotated[
        StrictStr | None,
        AfterValidator(clean_name),  # shown to agents: one line, no control or bidi characters
        Field(description=f"a string (the client's name, cut to {MAX_NAME_CHARS} characters)"),
    ] = None
    type: Literal["hello"] = "hello"


@dataclass(config=_MESSAGE)
class Chat:
    """One user turn of the session's conversation: the reply streams as `token`s, then `done`."""

    id: RequestId
    text: Annotated[StrictStr, Field(description="a string")]
    options: Options = field(default_factory=dict)
    type: Literal["chat"] = "chat"


@dataclass(config=_MESSAGE)
class TaskCall:
    """Run a stateless task (e.g. `sentiment`) on `input`; the answer is a `result`."""

    id: RequestId
    task: Annotated[StrictStr, Field(description="a task name string")]
    input: Annotated[object, Field(description='the task\'s input, e.g. {"text": ...}')]
    options: Options = field(default_factory=dict)
    type: Literal["task"] = "task"


@dataclass(config=_MESSAGE)
class Cancel:
    """Stop the request `id` in flight."""

    id: RequestId
    type: Literal["cancel"] = "cancel"


@dataclass(config=_MESSAGE)
class Reset:
    """Cancel the chat turn in progress and clear the session's history."""

    type: Literal["reset"] = "reset"


@dataclass(config=_MESSAGE)
class Ping:
    """Answered `pong` with the same `data`."""

    data: Annotated[object, Field(description="any JSON value")] = None
    type: Literal["ping"] = "ping"


@dataclass(config=_MESSAGE)
class HandoffEmail:
    """While waiting for a person (`handoff`), leave an e-mail for them to write back; answered `handoff`."""

    email: Annotated[
        StrictStr,
        Field(max_length=MAX_EMAIL_CHARS, description=EMAIL_RULE),
        AfterValidator(check_email),
    ]
    type: Literal["handoff_email"] = "handoff_email"


ClientMessage = Hello | Chat | TaskCall | Cancel | Reset | Ping | HandoffEmail
_MODELS: dict[str, Any] = {
    "hello": Hello,
    "chat": Chat,
    "task": TaskCall,
    "cancel": Cancel,
    "reset": Reset,
    "ping": Ping,
    "handoff_email": HandoffEmail,
}
MESSAGE_TYPES = tuple(_MODELS)
CLIENT_MESSAGE: TypeAdapter[ClientMessage] = TypeAdapter(
    Annotated[ClientMessage, Field(discriminator="type")]
)


def parse_client_message(raw: str | bytes, max_frame_bytes: int) -> ClientMessage:
    """A validated client message from one WebSocket frame; raises ProtocolError."""
    obj = load_object(raw, max_frame_bytes)
    raw_id = obj.get("id")
    rid = raw_id if isinstance(raw_id, str) and len(raw_id) <= MAX_ID_CHARS else None  # errors report it
    return _parse_object(obj, rid)


def load_object(raw: str | bytes, max_frame_bytes: int) -> dict[str, object]:
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


def loads(text: str) -> object:
    """JSON text as I-JSON (RFC 7493) and within MAX_JSON_DEPTH; raises ValueError saying what is wrong.

    Beyond `json.loads`: NaN/Infinity, numbers out of a double's range, strings with an unpaired UTF-16
    surrogate (a lone `\\udXXX` escape) and nesting deeper than MAX_JSON_DEPTH are refused. Such values
    could not be echoed back (UTF-8 has no lone surrogates, strict JSON no NaN), overflow float
    conversions, or exhaust the recursion limit of whatever serializes them later. The decoder's C
    fast paths do the parsing; each check runs over the text or the value at C speed, and only when
    the text may need it, so that a worst-case body (a MiB of tiny arrays or numbers) parses fast.
    """
    try:
        value = _DECODER.decode(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError:
        limit = sys.get_int_max_str_digits()  # an integer over Python's digit limit (0: none)
        if limit and re.search("[0-9]{%d}" % (limit + 1), text):
            raise ValueError(f"a number is out of range (at most {_FLOAT_MAX:g} in magnitude)") from None
        raise
    skeleton = _STRING.sub('""', text).encode("ascii") if '"' in text else text.encode("ascii")
    if skeleton.count(b"[") + skeleton.count(b"{") > MAX_JSON_DEPTH:  # outside strings JSON is ASCII
        _check_depth(skeleton)
    digits = skeleton.translate(_DIGITS)  # each digit a "0", anything else a space
    if b"0" * 309 in digits:
        _check_ints(skeleton)
    if not text.isascii() and _SURROGATE.search(text):  # only in a string, where it is never valid
        raise ValueError(_SURROGATE_MESSAGE)
    # a float that may be out of a double's range (1.8e308): an exponent of 100 or more, or so many
    # digits that an exponent under 100 takes it there
    big_float = _BIG_EXPONENT.search(skeleton) is not None or b"0" * 210 in digits
    if big_float or _SURROGATE_ESCAPE.search(text):
        # at C speed: an infinite float (1e400), a lone surrogate (which a text test could not tell
        # from an escaped backslash before "ud800")
        try:
            json.dumps(value, ensure_ascii=False, allow_nan=not big_float, check_circular=False).encode()
        except UnicodeEncodeError:
            raise ValueError(_SURROGATE_MESSAGE) from None
        except ValueError:
            raise ValueError(f"a number is out of range (at most {_FLOAT_MAX:g} in magnitude)") from None
    return value


_FLOAT_MAX = sys.float_info.max
_SURROGATE_MESSAGE = (
    "a string holds an unpaired UTF-16 surrogate (a lone \\ud800-\\udfff escape); "
    "JSON text must be valid Unicode"
)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string (the text is valid JSON)
_DIGITS = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))
_BIG_EXPONENT = re.compile(rb"[eE]\+?0*[1-9][0-9]{2}")
_LONG_INT = re.compile(rb"(?<![0-9.eE+-])-?[0-9]{309,}(?![0-9.eE])")


def _check_depth(skeleton: bytes) -> None:
    """Nesting depth of valid JSON text whose strings are emptied: the running count of brackets."""
    chars = np.frombuffer(skeleton, np.uint8)
    opens = (chars == ord("[")) | (chars == ord("{"))
    steps = opens.astype(np.int32) - ((chars == ord("]")) | (chars == ord("}")))
    if int(np.cumsum(steps).max(initial=0)) > MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")


def _check_ints(skeleton: bytes) -> None:
    """Integers beyond a double's range, read from the text whose strings are emptied."""
    for match in _LONG_INT.finditer(skeleton):
        if abs(int(match.group())) > _FLOAT_MAX:
            shown = match.group()[:24].decode()
            raise ValueError(f"number {shown}... is out of range (at most {_FLOAT_MAX:g} in magnitude)")


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


# one decoder for every call (`json.loads` with a hook would build a new one each time); numbers take
# the C parser's fast paths, which a parse_int or parse_float hook would turn off
_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def _parse_object(obj: dict[str, object], rid: str | None) -> ClientMessage:
    kind = obj.get("type")
    if kind is None:
        raise ProtocolError("missing_field", "'type' is required", rid)
    if not isinstance(kind, str) or kind not in MESSAGE_TYPES:
        raise ProtocolError(
            "unknown_type", f"unknown message type {kind!r} (known: {', '.join(MESSAGE_TYPES)})", rid
        )
    try:
        return CLIENT_MESSAGE.validate_python(obj)
    except ValidationError as exc:
        error = exc.errors(include_url=False, include_context=False, include_input=False)[0]
        name = str(error["loc"][1])  # (type, field, ...)
        what = _MODELS[kind].__pydantic_fields__[name].description
        if name == "id":
            rid = None  # not a usable id
        if error["type"] == "missing":
            raise ProtocolError("missing_field", f"'{name}' is required ({what})", rid) from None
        raise ProtocolError("invalid_field", f"'{name}' must be {what}", rid) from None
