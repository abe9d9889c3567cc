"""Property-based fuzzing (hypothesis) of the WebSocket protocol (/ws, /ws/console) and the HTTP API
against ONE real uvicorn server (scripted engine, real task registry), run in a background thread so
that the synchronous hypothesis tests drive it with real clients (the `websockets` sync client, httpx).

Inputs: arbitrary and malformed JSON, every field of every message type replaced by every JSON type,
deep nesting (built as strings, up to 5000 levels), NaN/Infinity and out-of-range numbers, lone
surrogates (as JSON escapes), binary frames, text frames of invalid UTF-8, frames just over
`server.max_frame_bytes` and over the transport limit, random ids / task names / options, replayed and
forged resume tokens; HTTP requests with random bodies, content types, methods and Authorization headers
to every route of `http_api.ROUTES`.

Checked: every frame gets well-formed server events (strict JSON objects with a known `type`; errors
with a documented `code`, a `message`, no traceback or file path) and the protocol-level error the
documentation promises, or a clean close with a documented close code; every HTTP response is < 500
without internals in its body; the server logs nothing at ERROR and no exception; afterwards a normal
chat round trip and /health work. The last test prints the number of inputs tried and, when
RTSERVER_REPORT_DIR is set, writes it to $RTSERVER_REPORT_DIR/fuzz.json.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import threading
import time
import urllib.parse
from collections import Counter
from typing import Any

import httpx
import pytest
import websockets
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from websockets.sync.client import connect as ws_connect

from rtserver.web import http_api
from rtserver.web import protocol as P

from .serverutil import ScriptedEngine, make_settings, scripted_app, serve

MAX_FRAME = 65536
TRANSPORT_MAX = max(1 << 20, 4 * MAX_FRAME)  # hub.transport_max_bytes
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
HTTP_ONLY_CODES = {"body_too_large", "unsupported", "rate_limited", "shutting_down"}
LEAKS = ("Traceback", "/work/", '.py"', 'File "', "site-packages")

STATS: Counter = Counter()  # ws_frames, http_requests, http_5xx, crashes

# The server runs in another thread and uvicorn uses `random` there while hypothesis generates inputs here;
# hypothesis would take that for a strategy using the global random state.
pytestmark = pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")


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


# -- the server: one per module, in its own thread and event loop ---------------------------------


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


class ServerThread:
    def __init__(self, app: Any, settings_: Any):
        self.app, self.settings = app, settings_
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.error: BaseException | None = None
        self.base = self.url = ""
        self.logs = LogCapture()  # attached to the loggers once the server runs
        self.thread = threading.Thread(target=self._run, name="fuzz-server", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as exc:  # reported by start()/stop()
            self.error = exc
            self.started.set()
        finally:
            self.loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with serve(self.app, self.settings) as (base, url):
            self.base, self.url = base, url
            self.started.set()
            await self._stop.wait()

    def start(self) -> None:
        self.thread.start()
        assert self.started.wait(300), "server did not start"
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(120)
        assert not self.thread.is_alive(), "server did not stop"
        if self.error is not None:
            raise self.error

    @property
    def state(self) -> Any:
        return self.app.state.rt


def fuzz_settings():
    s = make_settings(tasks={"auto_tasks": []}, server={"max_frame_bytes": MAX_FRAME, "max_in_flight": 8})
    s.security.console_token = CONSOLE_TOKEN
    for key, off in (("rate_limit_per_s", 0.0), ("ip_rate_limit_per_s", 0.0), ("max_sessions_per_ip", 0)):
        if hasattr(s.security, key):  # the fuzzer sends far more than a client may: limits off
            setattr(s.security, key, off)
    return s


@pytest.fixture(scope="module")
def server(smol):
    s = fuzz_settings()
    srv = ServerThread(scripted_app(smol, s, ScriptedEngine(smol)), s)
    srv.start()
    capture = srv.logs
    capture.setFormatter(logging.Formatter())
    loggers = [logging.getLogger(), logging.getLogger("uvicorn"), logging.getLogger("uvicorn.error")]
    for lg in loggers:
        lg.addHandler(capture)
    try:
        yield srv
    finally:
        for lg in loggers:
            lg.removeHandler(capture)
        srv.stop()


@pytest.fixture(autouse=True)
def no_server_errors(request):
    """Every test: the server logs nothing at ERROR and no exception while it runs."""
    if "server" not in request.fixturenames:
        yield
        return
    server = request.getfixturevalue("server")
    start = len(server.logs.records)
    yield
    bad = server.logs.errors(start)
    assert not bad, "server logged errors:\n" + server.logs.describe(bad)


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
    rid = raw_id if isinstance(raw_id, str) and len(raw_id) <= P.MAX_ID_CHARS else None
    kind = obj.get("type")
    if kind is None:
        return "missing_field", rid
    if not isinstance(kind, str) or kind not in P.MESSAGE_TYPES:
        return "unknown_type", rid
    if kind == "hello":
        for key in ("session_id", "resume_token", "auth_token", "client"):
            if obj.get(key) is not None and not _is_str(obj[key]):
                return "invalid_field", rid
        return None
    if kind in ("ping", "reset"):
        return None
    if "id" not in obj:
        return "missing_field", None
    if not (isinstance(raw_id, str) and 1 <= len(raw_id) <= P.MAX_ID_CHARS):
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


def check_error_body(where: str, ev: dict, codes: set[str]) -> None:
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
        check_error_body("ws", ev, set(P.ERROR_CODES))
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
    def __init__(self, url: str, kinds: set[str] = SERVER_EVENTS):
        self.url, self.kinds = url, kinds
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
    kind = draw(st.sampled_from(P.MESSAGE_TYPES))
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


def test_loads_refuses_what_could_not_be_echoed():
    """protocol.loads (frames and HTTP bodies): the rules the reference parser above checks."""
    for text, why in [
        ("NaN", "NaN"),
        ('{"a":-Infinity}', "Infinity"),
        ("1e400", "out of range"),
        ("-" + "9" * 309, "out of range"),
        ("1" + "0" * 5000, "out of range"),
        ('"\\ud800"', "surrogate"),
        ('{"\\udc00":1}', "surrogate"),
        ('["a\\ud83d"]', "surrogate"),
        ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "nested"),
        ("[" * 5000, "nested"),
        ('{"a":' * 995 + "0" + "}" * 995, "nested"),
    ]:
        with pytest.raises(ValueError, match=why):
            P.loads(text)
    assert P.loads("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    assert P.loads('["\\ud83d\\ude00", "\\\\ud800", 1e308, -0, 1e-400]') == ["😀", "\\ud800", 1e308, 0, 0.0]
    assert P.loads('"' + "[" * 500 + '"') == "[" * 500  # brackets in a string are not nesting


# -- WebSocket tests ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ws_client(server):
    client = WS(server.url)
    yield client
    client.close()


def test_every_field_of_every_message_with_every_type(server, ws_client):
    """Systematic: each field of each message type deleted, nulled and replaced by each JSON type."""
    for template in TEMPLATES.values():
        for field in sorted(template) + ["extra"]:
            variants = [None] + list(SAMPLE_OF_KIND.values())
            for value in variants + ["<delete>"]:
                obj = dict(template)
                if value == "<delete>":
                    obj.pop(field, None)
                else:
                    obj[field] = value
                send_and_check(ws_client, [json.dumps(obj)])


@fuzz(500)
@given(batch=st.lists(frames, min_size=1, max_size=3), fresh=st.integers(0, 19))
def test_random_frames(server, ws_client, batch, fresh):
    if fresh == 0:  # now and then a new connection (the first frame then starts the session)
        ws_client.close()
    send_and_check(ws_client, batch)


@fuzz(30)
@given(payload=st.binary(min_size=1, max_size=40).filter(lambda b: not _valid_utf8(b)), before=st.booleans())
def test_invalid_utf8_text_frames_close_with_1007(server, payload, before):
    """A text frame that is not UTF-8 is refused by the WebSocket layer (close 1007); the server stays."""
    ws = WS(server.url)
    try:
        if before:
            send_and_check(ws, ['{"type":"hello"}'])
        ws.send(payload, text=True)
        closed = ws.wait_closed()
        assert closed.code == 1007, closed
    finally:
        ws.close()


def _valid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_huge_frames(server):
    ws = WS(server.url)
    try:
        chat = '{"type":"chat","id":"big","text":"%s"}'
        pad = MAX_FRAME - len(chat % "")
        # at the limit: accepted (the chat text is then cut to the chat task's limits)
        events = send_and_check(ws, [chat % ("x" * pad)])
        assert not any(e.get("code") == "frame_too_large" for e in events), events
        # one byte over, in ASCII, and over in bytes but not in characters (2-byte UTF-8)
        send_and_check(ws, [chat % ("x" * (pad + 1))])
        send_and_check(ws, [chat % ("é" * (pad // 2 + 1))])
        send_and_check(ws, [b"\x00" * (MAX_FRAME + 1)])
        send_and_check(ws, ["[" * (MAX_FRAME + 1)])
        # a fragmented message is one frame for the protocol
        ws.send(iter(['{"type":"ping",', '"data":', '"frag"}']))
        STATS["ws_frames"] += 2  # three fragments sent, counted once by send()
        assert ws.recv() == {"type": "pong", "data": "frag"}
        # over the transport limit: closed with 1009, text and binary, whole or fragmented
        for frame in (
            "x" * (TRANSPORT_MAX + 1),
            b"\x01" * (TRANSPORT_MAX + 1),
            iter(["y" * (TRANSPORT_MAX // 2 + 1)] * 2),
        ):
            ws.close()
            send_and_check(ws, ['{"type":"hello"}'])
            try:
                ws.send(frame)
                closed = ws.wait_closed()
            except Closed as exc:  # closed while the fragments were still being sent
                closed = exc
            assert closed.code == 1009, closed
        send_and_check(ws, ['{"type":"ping","data":"still here"}'])
    finally:
        ws.close()


# -- sessions: replayed and forged resume tokens --------------------------------------------------


def _hello(ws: WS, **fields) -> list[dict]:
    ws.send(json.dumps({"type": "hello", **fields}))
    events = []
    while True:
        ev = ws.recv()
        events.append(ev)
        if ev["type"] == "ready" or (ev["type"] == "error" and ev["code"] != "session_expired"):
            return events


def test_replayed_resume_token(server):
    a, b, c = WS(server.url), WS(server.url), WS(server.url)
    try:
        ready = _hello(a)[-1]
        sid, token = ready["session_id"], ready["resume_token"]
        assert ready["resumed"] is False
        # resumed elsewhere: the old connection is told and closed with 4409
        got = _hello(b, session_id=sid, resume_token=token)[-1]
        assert got["type"] == "ready" and got["resumed"] is True and got["session_id"] == sid
        ev = a.recv()
        assert ev["type"] == "error" and ev["code"] == "session_taken_over", ev
        assert a.wait_closed().code == 4409
        # the same token replayed after the take-over: resumes again (tokens are not single-use), b is closed
        got = _hello(c, session_id=sid, resume_token=token)[-1]
        assert got["resumed"] is True and got["session_id"] == sid
        assert b.recv()["code"] == "session_taken_over" and b.wait_closed().code == 4409
        # and the session works: a chat round trip on it
        c.send(json.dumps({"type": "chat", "id": "after", "text": "hi"}))
        while (ev := c.recv())["type"] != "done":
            assert ev["type"] == "token", ev
        assert ev["text"] == REPLY
    finally:
        for ws in (a, b, c):
            ws.close()


@pytest.fixture(scope="module")
def victims(server):
    """Two live sessions: the fuzzed forgeries must never resume or disturb them."""
    conns = [WS(server.url), WS(server.url)]
    readies = [_hello(ws)[-1] for ws in conns]
    yield conns, readies
    for ws in conns:
        events = ws.sync()  # still attached, never taken over
        assert not any(e.get("code") == "session_taken_over" for e in events), events
        ws.close()


URLSAFE = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_"


@st.composite
def forged(draw, victim_sid: str, victim_token: str, other_sid: str, other_token: str) -> dict:
    sid = draw(
        st.one_of(
            st.just(victim_sid),
            st.just(other_sid),
            texts,
            st.text(URLSAFE, min_size=24, max_size=24),
            st.just(victim_sid[:-1]),
            st.just(victim_sid + "A"),
            st.just(victim_sid.upper()),
        )
    )
    token = draw(
        st.one_of(
            st.just(other_token),
            texts,
            st.text(URLSAFE, min_size=43, max_size=43),
            st.just(victim_token[:-1]),
            st.just(victim_token[:-1] + ("A" if victim_token[-1] != "A" else "B")),
            st.just(victim_token + "x"),
            st.just(""),
            st.just(victim_token.swapcase()),
        )
    )
    fields: dict = {}
    if draw(st.integers(0, 9)):
        fields["session_id"] = sid
    if draw(st.integers(0, 9)):
        fields["resume_token"] = token
    if not fields:
        fields["resume_token"] = token
    return fields


@fuzz(100)
@given(data=st.data())
def test_forged_resume_tokens(server, victims, data):
    conns, readies = victims
    (v, o) = readies
    fields = data.draw(forged(v["session_id"], v["resume_token"], o["session_id"], o["resume_token"]))
    if (fields.get("session_id"), fields.get("resume_token")) in {
        (v["session_id"], v["resume_token"]),
        (o["session_id"], o["resume_token"]),
    }:
        return  # a real pair (hypothesis cannot build one here, but be exact)
    ws = WS(server.url)
    try:
        events = _hello(ws, **fields)
        if any(not isinstance(x, str) for x in fields.values()) or any(
            _has_surrogate(x) for x in fields.values() if isinstance(x, str)
        ):
            assert events[-1]["type"] == "error", events
            return
        assert [e["type"] for e in events] == ["error", "ready"], events
        assert events[0]["code"] == "session_expired"
        ready = events[-1]
        assert ready["resumed"] is False and ready["session_id"] not in (v["session_id"], o["session_id"])
        assert ready["history"] == [] and ready["resume_token"] not in (v["resume_token"], o["resume_token"])
    finally:
        ws.close()


def _has_surrogate(s: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in s)


# -- authentication (api_token on) ----------------------------------------------------------------


@pytest.fixture
def api_token(server):
    sec = server.state.settings.security
    sec.api_token = API_TOKEN
    try:
        yield API_TOKEN
    finally:
        sec.api_token = ""


@fuzz(60)
@given(
    first=st.one_of(
        st.builds(lambda t: json.dumps({"type": "hello", "auth_token": t}), texts),
        st.builds(lambda v: json.dumps({"type": "hello", "auth_token": v}), json_values),
        st.just('{"type":"hello"}'),
        st.just('{"type":"chat","id":"x","text":"hi"}'),
        st.just('{"type":"hello","auth_token":"%s "}' % API_TOKEN),
        st.just('{"type":"hello","auth_token":"%s"}' % API_TOKEN.upper()),
    )
)
def test_ws_auth_required(server, api_token, first):
    ws = WS(server.url)
    try:
        ws.send(first)
        ev = ws.recv()
        assert ev["type"] == "error", ev
        if ev["code"] == "unauthorized":
            assert ws.wait_closed().code == 4401
        else:  # a mistyped field is refused before authentication; the connection stays
            assert ev["code"] in ("invalid_field", "bad_json"), ev
            ok = ws.sync()
            assert ok == [], ok
    finally:
        ws.close()


def test_ws_auth_right_token(server, api_token):
    ws = WS(server.url)
    try:
        assert _hello(ws, auth_token=api_token)[-1]["type"] == "ready"
    finally:
        ws.close()


# -- /ws/console ----------------------------------------------------------------------------------

console_frames = st.one_of(
    st.builds(json.dumps, json_values),
    st.binary(max_size=32),
    deep_json(),
    odd_numbers(),
    surrogate_frames,
    st.builds(
        lambda kind, sid, text: json.dumps({"type": kind, "session_id": sid, "text": text}),
        st.sampled_from(["take_over", "hand_back", "agent_message", "login", "ping", "nope"]),
        json_values,
        json_values,
    ),
)


@fuzz(100)
@given(
    login=st.fixed_dictionaries(
        {
            "type": st.just("login"),
            "token": st.one_of(st.just(CONSOLE_TOKEN), st.just(CONSOLE_TOKEN), json_values),
        },
        optional={"agent": json_values, "agent_id": json_values},
    ),
    batch=st.lists(console_frames, min_size=1, max_size=3),
)
def test_console_frames(server, login, batch):
    ws = WS(server.url + "/console", CONSOLE_EVENTS)
    try:
        frame = json.dumps(login)
        ws.send(frame)
        ev = ws.recv()
        if expected_error(frame) == ("bad_json", None):
            assert ev["type"] == "error" and ev["code"] == "bad_json", ev
            assert ws.sync() == []  # ping needs no login; the connection stays
            return
        if login["token"] != CONSOLE_TOKEN:
            assert ev["type"] == "error" and ev["code"] == "unauthorized", ev
            assert ws.wait_closed().code == 4401
            return
        assert ev["type"] == "console_ready", ev
        for frame in batch:
            ws.send(frame)
        try:
            ws.sync()
        except (Closed, TimeoutError) as exc:
            STATS["crashes"] += 1
            raise AssertionError(
                f"console: {exc!r} after {login!r:.300} {[f[:300] for f in batch]!r}"
            ) from None
    finally:
        ws.close()


@pytest.fixture(scope="module")
def taken_over(server):
    """A customer session taken over by a console agent: chats are forwarded, the agent replies."""
    agent, customer = WS(server.url + "/console", CONSOLE_EVENTS), WS(server.url)
    agent.send(
        json.dumps({"type": "login", "token": CONSOLE_TOKEN, "agent": "Fuzz", "agent_id": "fuzz-agent"})
    )
    assert agent.recv()["type"] == "console_ready"
    sid = _hello(customer, client="fuzzed customer")[-1]["session_id"]
    agent.send(json.dumps({"type": "take_over", "session_id": sid}))
    assert customer.recv() == {"type": "handover", "to": "agent", "agent": "Fuzz"}
    agent.sync()
    yield agent, customer, sid
    agent.send(json.dumps({"type": "hand_back", "session_id": sid}))
    events = customer.sync()
    assert {"type": "handover", "to": "bot", "agent": None} in events, events
    customer.send(json.dumps({"type": "chat", "id": "bot-again", "text": "still there?"}))
    while (ev := customer.recv())["type"] != "done":
        assert ev["type"] == "token", ev
    assert ev["text"] == REPLY
    agent.close()
    customer.close()


@fuzz(60)
@given(
    customer_frames=st.lists(st.one_of(mutated_message(), random_message(), surrogate_frames), max_size=2),
    agent_frames=st.lists(
        st.builds(
            lambda kind, sid, text: {"type": kind, "session_id": sid, "text": text},
            st.sampled_from(["agent_message", "agent_message", "take_over", "hand_back"]),
            st.one_of(st.just("<sid>"), json_values),
            json_values,
        ),
        max_size=2,
    ),
)
def test_take_over_fuzz(server, taken_over, customer_frames, agent_frames):
    agent, customer, sid = taken_over
    for frame in agent_frames:
        if frame["type"] == "hand_back" and frame["session_id"] == "<sid>":
            frame["type"] = "take_over"  # keep the conversation taken over for the next examples
        frame = json.dumps(frame).replace('"<sid>"', json.dumps(sid))
        agent.send(frame)
    try:
        agent.sync()
        send_and_check(customer, customer_frames)
    except (Closed, TimeoutError) as exc:
        STATS["crashes"] += 1
        raise AssertionError(
            f"{exc!r} after agent {agent_frames!r:.500} customer {customer_frames!r:.500}"
        ) from None


# -- HTTP -----------------------------------------------------------------------------------------

API_ROUTES = [(path, methods) for path, _, methods in http_api.ROUTES]
assert any(path == "/v1/chat/completions" for path, _ in API_ROUTES)
OPEN_ROUTES = [("/health", ["GET"]), ("/ready", ["GET"]), ("/metrics", ["GET"])]
BODIES = {
    "/v1/tasks/{name}": {"input": {"text": "good"}, "options": {}},
    "/sentiment": {"text": "good"},
    "/chat": {"history": [{"role": "user", "content": "hi"}], "options": {}},
    "/v1/chat/completions": {
        "model": "x",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0.5,
        "stream": False,
        "stream_options": {"include_usage": True},
        "stop": ["\n\n"],
        "seed": 1,
    },
}
CONTENT_TYPES = [
    None,
    "application/json",
    "application/json; charset=utf-16",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=zz",
    "application/xml",
    "*/*",
    "application/json; charset=latin-1",
]
header_text = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=40
).map(str.strip)


@st.composite
def mutated_body(draw, path: str) -> bytes:
    body = json.loads(json.dumps(BODIES.get(path, {"input": {"text": "x"}})))
    for _ in range(draw(st.integers(1, 3))):
        target = body
        if draw(st.booleans()):  # one level down
            nested = [k for k, v in body.items() if isinstance(v, (dict, list)) and v]
            if nested:
                target = body[draw(st.sampled_from(sorted(nested)))]
                if isinstance(target, list):
                    target = target[-1] if isinstance(target[-1], dict) else body
        keys = sorted(target) + [
            "extra",
            "n",
            "tools",
            "logprobs",
            "response_format",
            "min_tokens",
            "ignore_eos",
            "role",
            "content",
            "history",
            "input",
            "text",
            "options",
            "stream",
            "messages",
        ]
        key = draw(st.sampled_from(keys))
        if draw(st.integers(0, 4)) == 0:
            target.pop(key, None)
        else:
            target[key] = draw(st.one_of(*WRONG.values(), json_values))
    return json.dumps(body).encode()


def _body_strategy(path: str):
    return st.one_of(
        mutated_body(path),
        mutated_body(path),
        mutated_body(path),
        st.builds(lambda v: json.dumps(v).encode(), json_values),
        st.binary(max_size=80),
        st.text(alphabet=any_char, max_size=30).map(lambda s: s.encode("utf-8", "surrogatepass")),
        st.text(alphabet=any_char, max_size=10).map(
            lambda s: json.dumps({"text": s, "input": {"text": s}}).encode()
        ),
        deep_json(wrap=False).map(str.encode),
        deep_json(wrap=False).map(
            lambda d: ('{"input":%s,"text":%s,"history":%s,"messages":%s}' % (d, d, d, d)).encode()
        ),
        odd_numbers().map(lambda f: f.encode()),
        st.sampled_from(
            [
                b"",
                b"null",
                b"{}",
                b"[]",
                b'"x"',
                b"\xef\xbb\xbf{}",
                b"\xff\xfe{\x00}\x00",
                json.dumps({"text": "ok"}).encode("utf-16"),
                b'{"text": "\xed\xa0\x80"}',
                b'{"input": {"text": "\xed\xa0\x80"}}',
                b'{"history": "\xc0\xaf"}',
            ]
        ),
    )


def _fill(path: str, name: str) -> str:
    return path.replace("{name}", urllib.parse.quote(name.encode("utf-8", "surrogatepass"), safe=""))


@st.composite
def http_request(draw) -> tuple[str, str, bytes, dict]:
    path, methods = draw(st.sampled_from(API_ROUTES + OPEN_ROUTES))
    if "{name}" in path:
        path = _fill(path, draw(st.one_of(st.sampled_from(TASK_NAMES[:4]), texts.filter(bool))))
    method = draw(
        st.one_of(
            st.just(methods[0]),
            st.just(methods[0]),
            st.just(methods[0]),
            st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
        )
    )
    template = next(
        (p for p, _ in API_ROUTES if _fill(p, "") == path[: len(_fill(p, ""))] and "{name}" in p), path
    )
    body = (
        draw(_body_strategy(template))
        if method not in ("GET", "HEAD") or draw(st.integers(0, 9)) == 0
        else b""
    )
    headers = {}
    ctype = draw(st.one_of(st.sampled_from(CONTENT_TYPES), header_text))
    if ctype:
        headers["content-type"] = ctype.encode("latin-1")
    return method, path, body, headers


def request(client: httpx.Client, method: str, url: str, **kwargs: Any) -> httpx.Response:
    """Send; an input a conforming HTTP client refuses to put on the wire (h11: e.g. a header value with
    trailing whitespace) is not an input: hypothesis drops it."""
    try:
        return client.request(method, url, **kwargs)
    except httpx.LocalProtocolError:
        reject()


def check_response(r: httpx.Response, what: str) -> None:
    STATS["http_requests"] += 1
    if r.status_code >= 500:
        STATS["http_5xx"] += 1
    assert r.status_code < 500, (what, r.status_code, r.text[:1000])
    text = r.text
    for leak in LEAKS:
        assert leak not in text, (what, leak, text[:1000])
    if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
        err = strict_loads(text)["error"]
        check_error_body("http", err, set(P.ERROR_CODES) | HTTP_ONLY_CODES)
        assert set(err) == {"code", "message", "type", "param"}, err
    elif r.status_code < 300 and r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = strict_loads(line[6:])
                assert "error" not in chunk, chunk
    elif r.headers.get("content-type", "").startswith("application/json") and text:
        strict_loads(text)


def expected_http(method: str, path: str, body: bytes) -> int | None:
    """The status the documentation promises for a body that is not a JSON object on a POST route."""
    posts = {p for p, m in API_ROUTES if "POST" in m and "{name}" not in p}
    simple_task = re.fullmatch(r"/v1/tasks/[A-Za-z0-9_-]+", path)
    if method != "POST" or not (path in posts or simple_task):
        return None
    if len(body) > TRANSPORT_MAX:
        return 413
    try:
        obj = ref_loads(body.decode(json.detect_encoding(body)))
    except (BadJSON, UnicodeDecodeError):
        return 400
    return None if isinstance(obj, dict) else 400


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, timeout=RECV_TIMEOUT) as client:
        yield client


@fuzz(450)
@given(req=http_request())
def test_http_api_random_requests(server, http, req):
    method, path, body, headers = req
    r = request(http, method, path, content=body, headers=headers)
    check_response(r, (method, path, body[:300], headers))
    status = expected_http(method, path, body)
    if status is not None:
        assert r.status_code == status, (method, path, body[:300], r.status_code, r.text[:500])
        if status == 400:
            assert r.json()["error"]["code"] == "bad_json", r.text[:500]


def test_http_huge_bodies_and_wrong_methods(server, http):
    for path, methods in API_ROUTES:
        url = _fill(path, "sentiment")
        for method in ("GET", "POST", "PUT", "DELETE", "PATCH"):
            r = http.request(method, url, content=b"{}")
            check_response(r, (method, url))
            if method not in methods:  # 404 where the static files' mount at / answers the method
                assert r.status_code in (404, 405), (method, url, r.status_code)
        if "POST" in methods:  # over the limit, with a Content-Length and chunked (no length given)
            for body in (b'{"text":"' + b"x" * (TRANSPORT_MAX + 1) + b'"}', iter([b" " * 65536] * 17)):
                r = http.post(url, content=body)
                check_response(r, ("huge", url))
                assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text[:300]


@fuzz(80)
@given(
    route=st.sampled_from(API_ROUTES),
    auth=st.one_of(
        st.none(),
        header_text,
        st.builds(lambda t: "Bearer " + t, header_text),
        st.sampled_from(
            [
                "Bearer",
                "Bearer ",
                "bearer " + API_TOKEN,
                "Bearer  " + API_TOKEN,
                "Bearer " + API_TOKEN + " ",
                "Basic " + API_TOKEN,
                API_TOKEN,
                "Bearer " + API_TOKEN[:-1],
                "Bearer " + API_TOKEN + "x",
                "Bearer " + API_TOKEN.upper(),
                "Bearer " + API_TOKEN,
            ]
        ),
    ),
)
def test_http_auth(server, http, api_token, route, auth):
    path, methods = route
    url = _fill(path, "sentiment")
    headers = {"authorization": auth.encode("latin-1")} if auth is not None else {}
    r = request(http, methods[0], url, content=json.dumps(BODIES.get(path, {})).encode(), headers=headers)
    check_response(r, (url, auth))
    if auth == "Bearer " + API_TOKEN:
        assert r.status_code != 401, r.text[:300]
    else:
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", (auth, r.text[:300])
    for open_path, _ in OPEN_ROUTES:  # never behind the token
        check_response(r := http.get(open_path), open_path)
        assert r.status_code == 200


# -- afterwards: the server is fine ---------------------------------------------------------------


def normal_chat_works(server: ServerThread, http: httpx.Client) -> None:
    ws = WS(server.url)
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
    check_response(r, "/health")
    assert r.status_code == 200 and r.json()["status"] == "ready", r.text


def test_zz_normal_chat_afterwards_and_summary(server, http, capsys):
    """Runs last: the server still answers a normal chat; the count of inputs tried, and the verdict."""
    failure = None
    try:
        normal_chat_works(server, http)
    except (AssertionError, Closed, TimeoutError, OSError) as exc:
        failure = exc
    errors = server.logs.errors()
    ws_frames, http_requests = STATS["ws_frames"], STATS["http_requests"]
    report = {
        "inputs": ws_frames + http_requests,
        "ws_frames": ws_frames,
        "http_requests": http_requests,
        "http_5xx": STATS["http_5xx"],
        "server_errors_logged": len(errors),
        "crashes": STATS["crashes"],
        "normal_chat_after": failure is None,
    }
    line = (
        f"fuzz: {report['inputs']} inputs ({ws_frames} ws frames, {http_requests} http requests), "
        f"{report['http_5xx']} 5xx, {len(errors)} server errors logged, {report['crashes']} crashes, "
        f"normal chat afterwards: {'ok' if failure is None else 'FAILED'}"
    )
    with capsys.disabled():
        print("\n" + line)
    out_dir = os.environ.get("RTSERVER_REPORT_DIR")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "fuzz.json"), "w") as f:
            json.dump(report, f, indent=2)
    if failure is not None:
        raise failure
    assert not errors, "server logged errors:\n" + server.logs.describe(errors)
    assert report["http_5xx"] == 0 and report["crashes"] == 0, report
