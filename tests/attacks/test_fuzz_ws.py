"""Property-based fuzzing (hypothesis) of /ws, the customers' WebSocket, on one real server
(tests/fuzzutil.py): arbitrary and malformed JSON, every field of every message type replaced by every
JSON type, deep nesting (built as strings, up to 5000 levels), NaN/Infinity and out-of-range numbers, lone
surrogates (as JSON escapes), binary frames, text frames of invalid UTF-8, frames just over
`server.max_frame_bytes` and over the transport limit, random ids / task names / options, replayed and
forged resume tokens, hello with wrong auth tokens.

Checked: every frame gets well-formed server events (strict JSON objects with a known `type`; errors
with a documented `code`, a `message`, no traceback or file path) and the protocol-level error the
documentation promises, or a clean close with a documented close code; the server logs nothing at ERROR
and no exception; afterwards a normal chat round trip and /health work.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rtserver.web import protocol as P

from .. import fuzzutil
from ..fuzzutil import (
    API_TOKEN,
    MAX_DEPTH,
    MAX_FRAME,
    REPLY,
    SAMPLE_OF_KIND,
    STATS,
    TEMPLATES,
    TRANSPORT_MAX,
    WS,
    Closed,
    _hello,
    frames,
    fuzz,
    json_values,
    send_and_check,
    texts,
)

pytestmark = fuzzutil.RANDOM_WARNING


@pytest.fixture(scope="module")
def server(smol):
    with fuzzutil.running_fuzz_server(smol) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    yield from fuzzutil.http_client(server)


@pytest.fixture(autouse=True)
def no_server_errors(request):
    """Every test: the server logs nothing at ERROR and no exception while it runs."""
    yield from fuzzutil.no_new_server_errors(request)


@pytest.fixture
def api_token(server):
    with fuzzutil.api_token_on(server) as token:
        yield token


PROTOCOL_DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def _doc_section(title: str) -> str:
    text = PROTOCOL_DOC.read_text(encoding="utf-8")
    start = text.index("\n## " + title)
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_reference_rules_use_what_the_documentation_says():
    """The oracle (tests/fuzzutil.py) is independent of the code under test: it imports nothing of
    rtserver.web, and its constants are docs/protocol.md's."""
    tree = ast.parse(Path(fuzzutil.__file__).read_text(encoding="utf-8"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    assert not [m for m in imported if m and m.startswith("rtserver.web")], imported
    client = _doc_section("Client → server")
    documented_types = re.findall(r"^\| `(\w+)` \|", client, re.M)
    assert tuple(documented_types) == fuzzutil.MESSAGE_TYPES
    assert f"a string of 1–{fuzzutil.MAX_ID_CHARS} characters" in client
    errors = _doc_section("Error codes")
    documented_codes = set()
    for row in re.findall(r"^\| (`\w+`(?: / `\w+`)*) \|", errors, re.M):
        documented_codes |= set(re.findall(r"`(\w+)`", row))
    assert documented_codes == fuzzutil.ERROR_CODES
    assert f"at most {MAX_DEPTH} levels of nesting" in errors


def test_loads_refuses_what_could_not_be_echoed():
    """protocol.loads (frames and HTTP bodies): the rules the reference parser (fuzzutil.ref_loads) checks."""
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


# (value, always refused): out of every range a client may set, or not a number at all
OPTION_EXTREMES = [
    (2**64, True),
    (-(2**70), True),
    (10**300, True),
    (1e308, True),
    (-1e308, True),
    ("7", True),
    (True, True),
    ({"x": 1}, True),
    (-1, False),
    (0, False),
    (0.0, False),
    (-0.0, False),
    (1.5, False),
    (2**63, False),
    (1e-300, False),
    (False, False),
    ([1], False),
]


def test_option_extremes(server, ws_client):
    """/ws `options` of a chat and of a task at 2**64, 1e308, huge negatives, floats where integers go,
    strings, booleans...: the request ends, with a `bad_decoding` error naming the option or normally;
    a value out of every range is always refused; the connection stays."""
    frames = {
        "chat": {"type": "chat", "id": "x", "text": "hi"},
        "task": {"type": "task", "id": "x", "task": "sentiment", "input": {"text": "good"}},
    }
    n = 0
    for kind, frame in frames.items():
        for key in fuzzutil.OPTION_KEYS[:8]:
            for value, bad in OPTION_EXTREMES:
                n += 1
                rid = f"x{n}"
                ws_client.send(json.dumps({**frame, "id": rid, "options": {key: value}}))
                while True:
                    ev = ws_client.recv()
                    if (
                        ev.get("id") == rid
                        and ev["type"] in ("done", "result", "error")
                        and not ev.get("auto")
                    ):
                        break
                what = (kind, key, value, ev)
                if bad or ev["type"] == "error":
                    assert ev["type"] == "error" and ev["code"] == "bad_decoding", what
                    assert f"'{key}'" in ev["message"], what


@fuzz(650)
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
        # every resume rotates the token: the replayed old one gets a new session (b keeps its own),
        # the new one resumes, and b is closed
        fresh = got["resume_token"]
        assert fresh != token
        replay = WS(server.url)
        try:
            refused = _hello(replay, session_id=sid, resume_token=token)
            assert refused[0]["code"] == "session_expired" and refused[-1]["session_id"] != sid, refused
        finally:
            replay.close()
        got = _hello(c, session_id=sid, resume_token=fresh)[-1]
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


# -- afterwards: the server is fine ---------------------------------------------------------------


def test_zz_normal_chat_afterwards(server, http):
    """Runs last in this module: a normal chat works, and the server logged no error since it started."""
    fuzzutil.server_fine_afterwards(server, http)
