"""The console's frame models (web/console/frames.py) and event builders (web/console/events.py) and
their JSON Schema (GET /v1/console.schema.json)."""

from __future__ import annotations

import json

import jsonschema

from rtserver.web.console import events as ce
from rtserver.web.console.frames import AGENT_FRAME, AGENT_MESSAGE_TYPES, AssistCall, Login
from rtserver.web.schema import console_schema


def test_frames_keep_what_the_agent_sent_for_the_console_to_check():
    login = AGENT_FRAME.validate_python({"type": "login", "token": 5, "extra": 1})
    assert isinstance(login, Login) and login.token == 5 and login.agent is None
    call = AGENT_FRAME.validate_python({"type": "assist", "id": "a", "stream": None, "session_id": [1]})
    assert isinstance(call, AssistCall) and call.stream is None and call.session_id == [1]
    assert AssistCall().stream is False


def test_the_console_schema_validates_frames_and_the_built_events():
    schema = json.loads(json.dumps(console_schema()))
    jsonschema.Draft202012Validator.check_schema(schema)
    frames = jsonschema.Draft202012Validator(schema)
    for kind in AGENT_MESSAGE_TYPES:
        assert frames.is_valid({"type": kind}), kind
    assert not frames.is_valid({"type": "bogus"})
    events = jsonschema.Draft202012Validator({"$defs": schema["$defs"], "$ref": "#/$defs/ConsoleServerEvent"})
    mood = {"label": "neutral"}
    built = [
        ce.console_ready("a1", "Ann", None, 5, []),
        ce.conversation({"session_id": "s"}),
        ce.message("s", {"seq": 1, "role": "user", "text": "hi"}, mood, 1.5),
        ce.removed("s"),
        ce.token("s", "r", "t"),
        ce.stream_end("s", "r", "stop", dropped=3),
        ce.tag("s", 1, "r", "sentiment", "negative", mood),
        ce.messages("s", [], False, None, 0),
        ce.assist("r", "s", "draft", {"reply": "x"}, "x", {"total_ms": 1.0}),
        ce.assist_delta("r", "s", "draft", 0, "x"),
    ]
    for event in built:
        assert events.is_valid(json.loads(json.dumps(event))), event
    assert ce.stream_end("s", "r", "stop") == {
        "type": "stream_end",
        "session_id": "s",
        "id": "r",
        "finish_reason": "stop",
    }
