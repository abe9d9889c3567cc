"""Shared pieces of the fuzz tests (tests/attacks/test_fuzz_ws.py, test_fuzz_console.py, test_fuzz_http.py):
the one fuzzed server, the reference rules (an independent strict-JSON parser and the protocol-level
errors docs/protocol.md promises), the hypothesis strategies and fixed-seed settings, the WebSocket
client, the input counters and the summary line.

Each fuzz module drives ONE real uvicorn server (`running_fuzz_server`: scripted engine, real task
registry), run by serverutil.ServerThread in a background thread so that the synchronous hypothesis tests
drive it with real clients (the `websockets` sync client, httpx); its log is captured while it runs. Each
module ends with a normal chat round trip; at the end of the run tests/conftest.py prints the summary line
(inputs tried, 5xx, server errors logged, crashes) and, when RTSERVER_REPORT_DIR is set, writes it to
$RTSERVER_REPORT_DIR/fuzz.json.

The reference rules do not use rtserver.web.protocol: the message types, id length, nesting limit and
error codes below are the documentation's (test_fuzz_ws.py checks them against docs/protocol.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from websockets.sync.client import connect as ws_connect

from .serverutil import ScriptedEngine, ServerThread, make_settings, scripted_app

MAX_FRAME = 65536
TRANSPORT_MAX = max(1 << 20, 4 * MAX_FRAME)  # hub.transport_max_bytes
HTTP_MAX = max(256 << 10, MAX_FRAME, 8 * 2048)  # protocol.http_max_bytes (engine.max_sequence_tokens 2048)
MAX_DEPTH = 100  # documented nesting limit of a frame / body (docs/protocol.md, bad_json)
RECV_TIMEOUT = 60.0  # generous: the machine is shared; a hang still fails
API_TOKEN = "fuzz-api-token"
CONSOLE_TOKEN = "fuzz-console-token"
REPLY = "Hello"  # the scripted engine's reply

SERVER_EVENTS = {
    "ready",
    "token",
    "done",
    "result",
    "error",
    "pong",
    "reset",
    "handover",
    "agent_message",
    "forwarded",
    "shutting_down",
    "handoff",
    "queue_position",
}
CONSOLE_EVENTS = {
    "console_ready",
    "conversation",
    "message",
    "token",
    "stream_end",
    "tag",
    "removed",
    "error",
    "pong",
}
HTTP_ONLY_CODES = {
    "body_too_large",
    "unsupported",
    "rate_limited",
    "shutting_down",
    "forbidden",
    "api_disabled",
    "unsupported_media_type",
    "forbidden_host",
}
LEAKS = ("Traceback", "/work/", '.py"', 'File "', "site-packages")

# -- what docs/protocol.md documents (the reference rules use these, never rtserver.web.protocol) ----

MESSAGE_TYPES = ("hello", "chat", "task", "cancel", "reset", "ping", "handoff_email")  # "Client → server"
MAX_ID_CHARS = 64  # "`id`: a string of 1–64 characters"
ERROR_CODES = frozenset(  # the "Error codes" table
    {
        "bad_json",
        "binary_frame",
        "frame_too_large",
        "unknown_type",
        "missing_field",
        "invalid_field",
        "duplicate_id",
        "unknown_request",
        "bad_output_format",
        "output_truncated",
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
        "not_ready",
        "overloaded",
        "backend_unavailable",
        "unavailable",
        "request_too_large",
        "cancelled",
        "internal",
        "slow_client",
        "rate_limited",
        "too_many_sessions",
        "shutting_down",
        "forbidden_origin",
        "console_disabled",
        "unknown_session",
        "already_taken",
        "not_taken_over",
        "login_timeout",
        "over_budget",
        "too_many_connections",
        "hello_timeout",
        "server_full",
        "task_not_allowed",
        "sessions_full",
        "store_error",
        "not_waiting",
    }
)

STATS: Counter = Counter()  # ws_frames, http_requests, http_5xx, crashes
AFTERWARDS: list[bool] = []  # each module's closing normal chat: did it work
LOGS: list[LogCapture] = []  # each fuzzed server's log capture, for the summary

# The server runs in another thread and uvicorn uses `random` there while hypothesis generates inputs here;
# hypothesis would take that for a strategy using the global random state. Every fuzz module sets this.
RANDOM_WARNING = pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")


def fuzz(n: int):
    """Repeatable hypothesis settings (derandomized, no example database) for n inputs."""
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
    )


# -- the server: one per fuzz module, in its own thread and event loop ---------------------------------


class LogCapture(logging.Handler):
    """Server log records at WARNING and above (deduplicated: a record may reach two loggers)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self._seen: set[int] = set()

    def emit(self, record: logging.LogRecord) -> None:
        if id(record) not in self._seen:
            self._seen.add(id(record))
            self.records.append(record)

    def errors(self, since: int = 0) -> list[logging.LogRecord]:
        return [r for r in self.records[since:] if r.levelno >= logging.ERROR or r.exc_info]

    def describe(self, records: list[logging.LogRecord]) -> str:
        return "\n".join(
            f"{r.name} {r.levelname}: {r.getMessage()}" + (f"\n{self.format(r)}" if r.exc_info else "")
            for r in records
        )


def fuzz_settings():
    # make_settings turns the rate limits and the session cap off: the fuzzer sends far more than a
    # client may
    s = make_settings(tasks={"auto_tasks": []}, server={"max_frame_bytes": MAX_FRAME, "max_in_flight": 8})
    s.security.console_token = CONSOLE_TOKEN
    s.security.console_login_failures_per_min = 0  # the fuzzer's wrong tokens would lock it out
    return s


@contextlib.contextmanager
def running_fuzz_server(loaded: Any) -> Iterator[ServerThread]:
    """The fuzzed server (scripted engine over `loaded`'s tokenizer), its WARNING+ log records captured
    in `server.logs` from start to stop."""
    s = fuzz_settings()
    server = ServerThread(scripted_app(loaded, s, ScriptedEngine(loaded)), s, name="fuzz-server")
    server.logs = capture = LogCapture()
    capture.setFormatter(logging.Formatter())
    LOGS.append(capture)
    loggers = [logging.getLogger(), logging.getLogger("uvicorn"), logging.getLogger("uvicorn.error")]
    for lg in loggers:
        lg.addHandler(capture)
    try:
        with server:
            yield server
    finally:
        for lg in loggers:
            lg.removeHandler(capture)


# -- for the fuzz modules' fixtures --------------------------------------------------------------------


def http_client(server: ServerThread) -> Iterator[httpx.Client]:
    """A client whose bodies are declared JSON unless a request says otherwise (the API takes no other)."""
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=server.base, timeout=RECV_TIMEOUT, headers=headers) as client:
        yield client


def no_new_server_errors(request: pytest.FixtureRequest) -> Iterator[None]:
    """Around one test that uses the module's `server`: it logs nothing at ERROR and no exception
    meanwhile."""
    if "server" not in request.fixturenames:
        yield
        return
    server = request.getfixturevalue("server")
    start = len(server.logs.records)
    yield
    bad = server.logs.errors(start)
    assert not bad, "server logged errors:\n" + server.logs.describe(bad)


@contextlib.contextmanager
def api_token_on(server: ServerThread) -> Iterator[str]:
    """`security.api_token` and `ws_token` set on the running server for a while."""
    sec = server.state.settings.security
    sec.api_token = sec.ws_token = API_TOKEN
    try:
        yield API_TOKEN
    finally:
        sec.api_token = sec.ws_token = ""


# -- reference rules (docs/protocol.md), independent of rtserver.web.protocol -------------------------


class BadJSON(Exception):
    pass


def _no_constant(name: str):
    raise BadJSON(name)


def _float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise BadJSON(s)
    return v


def _int(s: str) -> int:
    if len(s.lstrip("-")) > 320:  # beyond any double, or over Python's digit limit
        raise BadJSON("huge int")
    v = int(s)
    if abs(v) > 1.7976931348623157e308:
        raise BadJSON(s)
    return v


def _depth_and_surrogates(value: Any) -> None:
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, str):
            if any(0xD800 <= ord(c) <= 0xDFFF for c in v):
                raise BadJSON("surrogate")
        elif isinstance(v, dict):
            if d > MAX_DEPTH:
                raise BadJSON("depth")
            for k, x in v.items():
                stack.append((k, d + 1))
                stack.append((x, d + 1))
        elif isinstance(v, list):
            if d > MAX_DEPTH:
                raise BadJSON("depth")
            stack.extend((x, d + 1) for x in v)


def ref_loads(text: str) -> Any:
    """JSON as the documentation accepts it (I-JSON); raises BadJSON."""
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_float, parse_int=_int)
    except (ValueError, RecursionError):
        raise BadJSON("syntax") from None
    _depth_and_surrogates(value)
    return value


def strict_loads(text: str) -> Any:
    """Server output must be strict JSON (no NaN/Infinity)."""
    return json.loads(text, parse_constant=_no_constant)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def expected_error(frame: str | bytes) -> tuple[str, str | None] | None:
    """(code, id) of the protocol-level error the documentation promises for a frame, or None when the
    frame is a well-formed message (its outcome is then semantic: a result or a semantic error)."""
    if isinstance(frame, bytes):
        return "binary_frame", None
    if len(frame.encode("utf-8", "surrogatepass")) > MAX_FRAME:
        return "frame_too_large", None
    try:
        obj = ref_loads(frame)
    except BadJSON:
        return "bad_json", None
    if not isinstance(obj, dict):
        return "bad_json", None
    raw_id = obj.get("id")
    rid = raw_id if isinstance(raw_id, str) and len(raw_id) <= MAX_ID_CHARS else None
    kind = obj.get("type")
    if kind is None:
        return "missing_field", rid
    if not isinstance(kind, str) or kind not in MESSAGE_TYPES:
        return "unknown_type", rid
    if kind == "hello":
        for key in ("session_id", "resume_token", "auth_token", "client"):
            if obj.get(key) is not None and not _is_str(obj[key]):
                return "invalid_field", rid
        return None
    if kind in ("ping", "reset"):
        return None
    if kind == "handoff_email":  # a string's own rule (an e-mail address) is checked by the server
        if "email" not in obj:
            return "missing_field", rid
        return ("invalid_field", rid) if not _is_str(obj["email"]) else None
    if "id" not in obj:
        return "missing_field", None
    if not (isinstance(raw_id, str) and 1 <= len(raw_id) <= MAX_ID_CHARS):
        return "invalid_field", None
    if kind == "chat":
        if "text" not in obj:
            return "missing_field", rid
        if not _is_str(obj["text"]):
            return "invalid_field", rid
    if kind == "task":
        if "task" not in obj:
            return "missing_field", rid
        if not _is_str(obj["task"]):
            return "invalid_field", rid
        if "input" not in obj:
            return "missing_field", rid
    if kind in ("chat", "task") and obj.get("options") is not None and not isinstance(obj["options"], dict):
        return "invalid_field", rid
    return None


def check_error_body(where: str, ev: dict, codes: frozenset[str] | set[str]) -> None:
    assert ev.get("code") in codes, (where, ev)
    message = ev.get("message")
    assert isinstance(message, str) and message, (where, ev)
    for leak in LEAKS:
        assert leak not in message, (where, leak, ev)


def check_event(text: Any, kinds: set[str] = SERVER_EVENTS) -> dict:
    assert isinstance(text, str), f"server sent a binary frame: {text!r:.200}"
    ev = strict_loads(text)
    assert isinstance(ev, dict) and isinstance(ev.get("type"), str), text[:300]
    assert ev["type"] in kinds, text[:300]
    if ev["type"] == "error":
        check_error_body("ws", ev, ERROR_CODES)
    return ev


# -- a WebSocket client that keeps one connection, reconnecting after an (expected) close ----------


class Closed(Exception):
    def __init__(self, code: int | None, reason: str = ""):
        super().__init__(f"closed with {code} {reason!r}")
        self.code, self.reason = code, reason


def _close_of(exc: websockets.ConnectionClosed) -> Closed:
    rcvd = exc.rcvd
    return Closed(rcvd.code if rcvd is not None else None, rcvd.reason if rcvd is not None else "")


class WS:
    def __init__(self, url: str, kinds: set[str] = SERVER_EVENTS, counted: bool = True):
        self.url, self.kinds = url, kinds
        self.counted = counted  # frames count as fuzz inputs in STATS
        self.conn = None
        self.marker = 0

    def connect(self) -> None:
        self.conn = ws_connect(
            self.url, max_size=None, open_timeout=RECV_TIMEOUT, close_timeout=5, legacy=True
        )

    def ensure(self) -> None:
        if self.conn is None:
            self.connect()

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:
                pass
            self.conn = None

    def send(self, frame: str | bytes, *, text: bool | None = None) -> None:
        self.ensure()
        try:
            self.conn.send(frame, text=text)
        except websockets.ConnectionClosed as exc:
            self.conn = None
            raise _close_of(exc) from None
        if self.counted:
            STATS["ws_frames"] += 1

    def recv(self, timeout: float = RECV_TIMEOUT) -> dict:
        try:
            raw = self.conn.recv(timeout=timeout)
        except websockets.ConnectionClosed as exc:
            self.conn = None
            raise _close_of(exc) from None
        return check_event(raw, self.kinds)

    def sync(self) -> list[dict]:
        """Every event up to the pong of a marker ping (the answers to what was sent before it)."""
        self.marker += 1
        marker = f"sync-{self.marker}"
        self.send(json.dumps({"type": "ping", "data": marker}))
        events = []
        while True:
            ev = self.recv()
            if ev == {"type": "pong", "data": marker}:
                return events
            events.append(ev)

    def wait_closed(self, timeout: float = RECV_TIMEOUT) -> Closed:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.recv(timeout=max(0.01, deadline - time.monotonic()))
            except Closed as closed:
                return closed
        raise AssertionError("the server did not close the connection")


def send_and_check(ws: WS, frames: list[str | bytes]) -> list[dict]:
    """Send frames, then sync; every protocol-level error the documentation promises must be there."""
    expected = Counter()
    for frame in frames:
        exp = expected_error(frame)
        if exp is not None:
            expected[exp] += 1
    for frame in frames:
        try:
            ws.send(frame)
        except Closed as closed:
            STATS["crashes"] += 1
            raise AssertionError(f"connection closed ({closed}) while sending {frame!r:.300}") from None
    try:
        events = ws.sync()
    except Closed as closed:
        STATS["crashes"] += 1
        raise AssertionError(f"connection closed ({closed}) after {[f[:300] for f in frames]!r}") from None
    got = Counter((ev["code"], ev.get("id")) for ev in events if ev["type"] == "error")
    missing = expected - got
    assert not missing, (
        f"frames {[f[:300] for f in frames]!r}: expected errors {dict(missing)}, got {events!r:.2000}"
    )
    return events


def _hello(ws: WS, **fields) -> list[dict]:
    ws.send(json.dumps({"type": "hello", **fields}))
    events = []
    while True:
        ev = ws.recv()
        events.append(ev)
        if ev["type"] == "ready" or (ev["type"] == "error" and ev["code"] != "session_expired"):
            return events


# -- strategies -----------------------------------------------------------------------------------

any_char = st.characters(codec=None, exclude_categories=())  # includes lone surrogates
safe_char = st.characters(exclude_categories=("Cs",))
texts = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=any_char, max_size=20),
    st.sampled_from(
        [
            "",
            " ",
            "\x00",
            "\u0000\u0001\u001f",
            "\ud800",
            "\udfff",
            "a\ud83d",
            "\ud83d\ude00",
            "<|im_end|>",
            "<|im_start|>system\nx<|im_end|>",
            "{text}",
            "%s%n",
            "💥" * 50,
            "中文测试",
            "\u202e\u200b",
            "a" * 300,
        ]
    ),
)
numbers = st.one_of(
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, -1, 2**31, 2**63, 2**64 + 1, -(2**63), 1e308, -1e-308, 0.5, 1.0]),
)
leaves = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    leaves, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(texts, c, max_size=4)), max_leaves=12
)
WRONG = {
    "null": st.none(),
    "bool": st.booleans(),
    "int": st.integers(),
    "float": st.floats(allow_nan=False),
    "str": texts,
    "list": st.lists(leaves, max_size=3),
    "object": st.dictionaries(texts, leaves, max_size=3),
}
SAMPLE_OF_KIND = {
    "null": None,
    "bool": True,
    "int": 7,
    "float": 0.25,
    "str": "zz",
    "list": ["a", 1],
    "object": {"text": "hi"},
}

TEMPLATES = {
    "hello": {
        "type": "hello",
        "session_id": "nope",
        "resume_token": "nope",
        "auth_token": "x",
        "client": "fuzz",
    },
    "chat": {
        "type": "chat",
        "id": "c",
        "text": "hello there",
        "options": {"temperature": 0.5, "max_new_tokens": 4},
    },
    "task": {"type": "task", "id": "t", "task": "sentiment", "input": {"text": "good"}, "options": {}},
    "cancel": {"type": "cancel", "id": "c"},
    "reset": {"type": "reset"},
    "ping": {"type": "ping", "data": {"k": [1, "x"]}},
}
OPTION_KEYS = [
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "max_new_tokens",
    "min_new_tokens",
    "seed",
    "stop",
    "ignore_eos",
    "logprobs",
    "",
]
TASK_NAMES = ["sentiment", "intent", "chat", "nope", "", "SENTIMENT", "sentiment ", "__class__", "../etc"]
ids = st.one_of(
    st.text(min_size=1, max_size=8), st.text(max_size=80), st.sampled_from(["", "x" * 64, "x" * 65])
)
options = st.one_of(
    st.dictionaries(st.sampled_from(OPTION_KEYS) | texts, json_values, max_size=4),
    st.fixed_dictionaries({}, optional={k: numbers | json_values for k in OPTION_KEYS[:8]}),
)


@st.composite
def mutated_message(draw) -> str:
    """A valid message shape with 1-3 fields removed, nulled or replaced by a value of any type, or extra
    fields; nested fields (options, input) too."""
    kind = draw(st.sampled_from(sorted(TEMPLATES)))
    obj = json.loads(json.dumps(TEMPLATES[kind]))
    if "id" in obj:
        obj["id"] = draw(st.sampled_from(["c", "t", "r1", "r2"]))
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(sorted(obj) + ["extra", "options.temperature", "input.text", "data"]))
        action = draw(st.sampled_from(["wrong", "wrong", "wrong", "delete", "null"]))
        if "." in field:
            outer, inner = field.split(".")
            if not isinstance(obj.get(outer), dict):
                continue
            target, key = obj[outer], inner
        else:
            target, key = obj, field
        if action == "delete":
            target.pop(key, None)
        elif action == "null":
            target[key] = None
        else:
            target[key] = draw(st.one_of(*WRONG.values(), json_values))
    return json.dumps(obj)


@st.composite
def random_message(draw) -> str:
    """A message of a known type with random content (text, ids, task names, options, session fields)."""
    kind = draw(st.sampled_from(MESSAGE_TYPES))
    obj: dict = {"type": kind}
    if kind == "hello":
        for key in ("session_id", "resume_token", "auth_token", "client"):
            if draw(st.booleans()):
                obj[key] = draw(texts)
    elif kind == "ping":
        obj["data"] = draw(json_values)
    elif kind in ("chat", "task", "cancel"):
        obj["id"] = draw(ids)
        if kind == "chat":
            obj["text"] = draw(texts)
        if kind == "task":
            obj["task"] = draw(st.sampled_from(TASK_NAMES) | texts)
            obj["input"] = draw(st.one_of(st.fixed_dictionaries({"text": texts}), json_values))
        if kind != "cancel" and draw(st.booleans()):
            obj["options"] = draw(options)
    return json.dumps(obj)


NUMBER_TOKENS = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e400",
    "-1e999",
    "1" + "0" * 400,
    "-" + "9" * 309,
    "1" + "0" * 5000,
    "1e-400",
    "-0",
    "0.0",
    "1E2",
    "2147483648",
    "1.5",
]


@st.composite
def odd_numbers(draw) -> str:
    """Non-finite and out-of-range numbers (written as JSON text) in every numeric-ish position."""
    tok = draw(st.sampled_from(NUMBER_TOKENS))
    key = draw(st.sampled_from(OPTION_KEYS[:7]))
    return draw(
        st.sampled_from(
            [
                '{"type":"chat","id":"n","text":"hi","options":{"%s":%s}}' % (key, tok),
                '{"type":"task","id":"n","task":"sentiment","input":{"text":"ok"},"options":{"%s":%s}}'
                % (key, tok),
                '{"type":"ping","data":%s}' % tok,
                '{"type":"ping","data":[1,{"x":%s}]}' % tok,
                '{"type":"cancel","id":%s}' % tok,
                '{"type":%s}' % tok,
                tok,
            ]
        )
    )


@st.composite
def deep_json(draw, wrap: bool = True) -> str:
    """Nesting built as a string (json.dumps would recurse), up to 5000 levels, around the limits."""
    depth = draw(
        st.one_of(
            st.sampled_from(
                [
                    1,
                    2,
                    MAX_DEPTH - 2,
                    MAX_DEPTH - 1,
                    MAX_DEPTH,
                    MAX_DEPTH + 1,
                    500,
                    900,
                    950,
                    980,
                    990,
                    995,
                    999,
                    1000,
                    1001,
                    2000,
                    5000,
                ]
            ),
            st.integers(1, 5000),
        )
    )
    style = draw(st.sampled_from(["list", "dict", "mixed", "unclosed"]))
    if style == "list":
        inner = "[" * depth + "0" + "]" * depth
    elif style == "dict":
        inner = '{"a":' * depth + "0" + "}" * depth
    elif style == "mixed":
        inner = '[{"a":' * (depth // 2) + "[]" + "}]" * (depth // 2)
    else:
        inner = "[" * depth
    if not wrap:
        return inner
    return draw(
        st.sampled_from(
            [
                inner,
                '{"type":"ping","data":%s}' % inner,
                '{"type":"chat","id":"d","text":"hi","options":%s}' % inner,
                '{"type":"task","id":"d","task":"sentiment","input":%s}' % inner,
                '{"type":"hello","client":%s}' % inner,
                '{"type":%s}' % inner,
            ]
        )
    )


surrogate_frames = st.builds(
    lambda s, tmpl: tmpl % json.dumps(s),
    st.text(alphabet=any_char, min_size=1, max_size=8),
    st.sampled_from(
        [
            '{"type":"ping","data":%s}',
            '{"type":"chat","id":%s,"text":"hi"}',
            '{"type":"chat","id":"s","text":"hi","options":{%s:1}}',
            '{"type":"cancel","id":%s}',
            '{"type":"task","id":"s","task":%s,"input":{"text":"hi"}}',
            '{"type":"hello","client":%s}',
            '{"type":"task","id":"s","task":"sentiment","input":%s}',
            '{%s:1,"type":"ping"}',
        ]
    ),
)

frames = st.one_of(
    st.builds(json.dumps, json_values),
    st.text(alphabet=safe_char, max_size=60),
    st.binary(max_size=64),
    mutated_message(),
    mutated_message(),
    random_message(),
    random_message(),
    deep_json(),
    odd_numbers(),
    surrogate_frames,
)


# -- HTTP responses -------------------------------------------------------------------------------


def check_response(r: httpx.Response, what: Any, counted: bool = True) -> None:
    """An HTTP response: < 500, no internals, strict JSON; an error body with a documented code."""
    if counted:
        STATS["http_requests"] += 1
        if r.status_code >= 500:
            STATS["http_5xx"] += 1
    assert r.status_code < 500, (what, r.status_code, r.text[:1000])
    text = r.text
    for leak in LEAKS:
        assert leak not in text, (what, leak, text[:1000])
    if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
        err = strict_loads(text)["error"]
        check_error_body("http", err, ERROR_CODES | HTTP_ONLY_CODES)
        assert set(err) == {"code", "message", "type", "param"}, err
    elif r.status_code < 300 and r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = strict_loads(line[6:])
                assert "error" not in chunk, chunk
    elif r.headers.get("content-type", "").startswith("application/json") and text:
        strict_loads(text)


# -- afterwards: the server is fine, and the summary ----------------------------------------------


def normal_chat_works(server: ServerThread, http: httpx.Client) -> None:
    ws = WS(server.url, counted=False)  # not a fuzz input
    try:
        ready = _hello(ws, client="after the fuzz")[-1]
        assert ready["type"] == "ready" and ready["resumed"] is False, ready
        ws.send(json.dumps({"type": "chat", "id": "final", "text": "Hi! How are you?"}))
        tokens = []
        while (ev := ws.recv())["type"] != "done":
            assert ev["type"] == "token" and ev["id"] == "final", ev
            tokens.append(ev["text"])
        assert (
            ev["id"] == "final" and ev["text"] == REPLY == "".join(tokens) and ev["finish_reason"] == "length"
        )
        ws.send(json.dumps({"type": "task", "id": "s", "task": "sentiment", "input": {"text": "great"}}))
        ev = ws.recv()
        assert ev["type"] == "result" and ev["output"]["label"] in ("positive", "negative"), ev
    finally:
        ws.close()
    r = http.get("/health")
    check_response(r, "/health", counted=False)
    assert r.status_code == 200 and r.json()["status"] == "ready", r.text


def server_fine_afterwards(server: ServerThread, http: httpx.Client) -> None:
    """Each fuzz module's last test: a normal chat round trip and /health still work, and the server has
    logged no error and no exception since it started."""
    try:
        normal_chat_works(server, http)
    except BaseException:
        AFTERWARDS.append(False)
        raise
    AFTERWARDS.append(True)
    errors = server.logs.errors()
    assert not errors, "server logged errors:\n" + server.logs.describe(errors)


def report() -> dict | None:
    """The run's fuzz figures (None when no fuzz input was sent)."""
    ws_frames, http_requests = STATS["ws_frames"], STATS["http_requests"]
    if not ws_frames + http_requests:
        return None
    return {
        "inputs": ws_frames + http_requests,
        "ws_frames": ws_frames,
        "http_requests": http_requests,
        "http_5xx": STATS["http_5xx"],
        "server_errors_logged": sum(len(c.errors()) for c in LOGS),
        "crashes": STATS["crashes"],
        "normal_chat_after": bool(AFTERWARDS) and all(AFTERWARDS),
    }


def summary_line(r: dict) -> str:
    after = "ok" if r["normal_chat_after"] else ("FAILED" if AFTERWARDS else "not run")
    return (
        f"fuzz: {r['inputs']} inputs ({r['ws_frames']} ws frames, {r['http_requests']} http requests), "
        f"{r['http_5xx']} 5xx, {r['server_errors_logged']} server errors logged, {r['crashes']} crashes, "
        f"normal chat afterwards: {after}"
    )


def write_summary() -> str | None:
    """At the end of the run (tests/conftest.py): the summary line, and fuzz.json in RTSERVER_REPORT_DIR."""
    r = report()
    if r is None:
        return None
    out_dir = os.environ.get("RTSERVER_REPORT_DIR")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "fuzz.json"), "w") as f:
            json.dump(r, f, indent=2)
    return summary_line(r)
