"""The HTTP doors' body models (web/http_api/bodies.py): the first refused field as our error, and
their JSON Schema (GET /v1/http.schema.json) agreeing with what they accept."""

from __future__ import annotations

import json

import jsonschema
import pytest

from rtserver.web.http_api import BODIES, ROUTES
from rtserver.web.http_api import bodies as b
from rtserver.web.http_api.common import HTTPError
from rtserver.web.http_api.node_body import Completion, Tokenize
from rtserver.web.http_api.openai_body import ChatCompletion
from rtserver.web.schema import http_schema


def refused(model: type[b.Door], body: dict[str, object], **context: object) -> HTTPError:
    with pytest.raises(HTTPError) as caught:
        b.parse(model, body, **context)
    return caught.value


def test_the_first_refused_field_is_reported_with_its_code_and_param():
    err = refused(ChatCompletion, {"messages": [], "n": 2, "temperature": "hot"})
    assert (err.code, err.param, err.status) == ("unsupported", "n", 400)
    assert err.message == "'n' is not supported: only n = 1 (one choice per request)"
    err = refused(ChatCompletion, {"messages": [{"role": "user", "content": "hi"}], "temperature": 3})
    assert (err.code, err.param) == ("bad_decoding", "temperature")
    err = refused(ChatCompletion, {"messages": [{"role": "user", "content": "x"}] * 257})
    assert (err.code, err.param, err.status) == ("request_too_large", "messages", 413)


def test_unknown_fields_are_refused_only_where_a_door_lists_its_fields():
    err = refused(Completion, {"prompt": [1], "best_of": 2})
    assert (err.code, err.param) == ("unsupported", "best_of")
    assert err.message == "'best_of' is not supported by /v1/completions here"
    assert b.parse(Tokenize, {"content": "hi", "extra": 1}).content == "hi"


def test_missing_fields_name_themselves_and_null_is_absent():
    err = refused(b.TaskCall, {})
    assert (err.code, err.param) == ("missing_field", "input")
    assert err.message == '\'input\' is required, e.g. {"input": {"text": "..."}}'
    assert b.parse(b.TaskCall, {"input": None}).options is None
    err = refused(Tokenize, {})
    assert (err.code, err.message) == ("invalid_field", "'content' must be a string")
    err = refused(b.ChatHistory, {})
    assert (err.code, err.message) == ("missing_field", "'history' is required")
    err = refused(b.ChatHistory, {"history": None})
    assert (err.code, err.param) == ("invalid_input", "history")


def test_ranges_come_from_the_context():
    ranges = {"max_new_tokens": (1, 96)}
    err = refused(ChatCompletion, {"messages": [], "max_tokens": 97}, ranges=ranges, max_tokens=64)
    assert err.message == "'max_tokens' = 97 is out of range (allowed 1..96)"
    err = refused(ChatCompletion, {"messages": [], "min_tokens": 65}, ranges=ranges, max_tokens=64)
    assert err.message == "'min_tokens' = 65 is out of range (allowed 0..64)"
    body = b.parse(Completion, {"prompt": [1]}, max_tokens=8)
    assert (body.max_tokens, body.temperature, body.stop) == (8, 1.0, [])


def test_the_http_schema_has_every_post_door_and_accepts_what_the_models_accept():
    schema = json.loads(json.dumps(http_schema()))
    posts = {path for path, _, methods in ROUTES if "POST" in methods}
    assert set(schema["doors"]) == posts
    jsonschema.Draft202012Validator.check_schema(schema)
    samples = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "stream": True},
        "/v1/completions": {"prompt": [1, 2], "max_tokens": 4, "stream_options": {"include_usage": True}},
        "/tokenize": {"content": "hi"},
        "/v1/sessions/drop": {"rtserver_sessions": ["a"]},
        "/v1/tasks/{name}": {"input": {"text": "hi"}},
        "/sentiment": {"text": "hi"},
        "/chat": {"history": [{"role": "user", "content": "hi"}]},
    }
    for path, body in samples.items():
        b.parse(BODIES[path], body, max_tokens=16)
        validator = jsonschema.Draft202012Validator({**schema, **schema["doors"][path]})
        assert validator.is_valid(body), path
