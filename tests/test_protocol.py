"""protocol.parse_client_message: every bad frame maps to a precise code (pure, no server)."""

from __future__ import annotations

import json

import pytest

from rtserver.web import protocol as P

LIMIT = 4096


def code_of(raw) -> tuple[str, str | None]:
    with pytest.raises(P.ProtocolError) as info:
        P.parse_client_message(raw, LIMIT)
    assert info.value.code in P.ERROR_CODES
    return info.value.code, info.value.request_id


@pytest.mark.parametrize(
    "raw, code",
    [
        (b"\x00\x01", "binary_frame"),
        ("{not json", "bad_json"),
        ("[1, 2]", "bad_json"),
        ('"hello"', "bad_json"),
        ("{}", "missing_field"),
        ('{"type": 5}', "unknown_type"),
        ('{"type": "dance"}', "unknown_type"),
        ('{"type": "chat", "text": "hi"}', "missing_field"),
        ('{"type": "chat", "id": 7, "text": "hi"}', "invalid_field"),
        ('{"type": "chat", "id": "", "text": "hi"}', "invalid_field"),
        ('{"type": "chat", "id": "' + "x" * 65 + '", "text": "hi"}', "invalid_field"),
        ('{"type": "chat", "id": "a"}', "missing_field"),
        ('{"type": "chat", "id": "a", "text": 3}', "invalid_field"),
        ('{"type": "chat", "id": "a", "text": "hi", "options": [1]}', "invalid_field"),
        ('{"type": "task", "id": "a", "input": {}}', "missing_field"),
        ('{"type": "task", "id": "a", "task": "sentiment"}', "missing_field"),
        ('{"type": "task", "id": "a", "task": 1, "input": "x"}', "invalid_field"),
        ('{"type": "cancel"}', "missing_field"),
        ('{"type": "hello", "session_id": 12}', "invalid_field"),
        ("x" * (LIMIT + 1), "frame_too_large"),
        ('{"type": "chat", "id": "a", "text": "' + "é" * (LIMIT // 2) + '"}', "frame_too_large"),
    ],
)
def test_bad_frames(raw, code):
    assert code_of(raw)[0] == code


def test_error_carries_request_id_when_usable():
    assert code_of('{"type": "chat", "id": "r1", "text": 5}') == ("invalid_field", "r1")
    assert code_of('{"type": "nope", "id": "r2"}') == ("unknown_type", "r2")


def test_good_messages():
    m = P.parse_client_message(
        json.dumps({"type": "chat", "id": "1", "text": "hi", "options": {"temperature": 0}}), LIMIT
    )
    assert m == P.Chat("1", "hi", {"temperature": 0})
    m = P.parse_client_message(
        '{"type": "task", "id": "2", "task": "sentiment", "input": {"text": "x"}}', LIMIT
    )
    assert m == P.TaskCall("2", "sentiment", {"text": "x"}, {})
    assert P.parse_client_message('{"type": "hello"}', LIMIT) == P.Hello()
    assert P.parse_client_message(
        '{"type": "hello", "session_id": "s", "resume_token": "t", "client": "c"}', LIMIT
    ) == P.Hello("s", "t", None, "c")
    assert P.parse_client_message('{"type": "cancel", "id": "2"}', LIMIT) == P.Cancel("2")
    assert P.parse_client_message('{"type": "reset"}', LIMIT) == P.Reset()
    assert P.parse_client_message('{"type": "ping", "data": 5}', LIMIT) == P.Ping(5)


def test_server_events_are_compact_utf8_json():
    text = P.dumps(P.token_event("1", "你好🎉"))
    assert "你好🎉" in text and json.loads(text) == {"type": "token", "id": "1", "text": "你好🎉"}
    assert P.error_event("bad_json", "m") == {"type": "error", "code": "bad_json", "message": "m"}
