"""Every bad-input case over a real WebSocket against a real uvicorn server: a clear error code, and the
connection and the server stay healthy (a ping still gets its pong)."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets

from ..serverutil import (
    ScriptedEngine,
    hello,
    is_end,
    make_settings,
    recv_json,
    recv_until,
    scripted_app,
    serve,
)

pytestmark = pytest.mark.asyncio

BAD = [
    # (name, frame, expected code, expected id)
    ("malformed json", "{oops", "bad_json", None),
    ("not an object", "[1,2,3]", "bad_json", None),
    ("binary frame", b"\x00\xff\x10", "binary_frame", None),
    ("unknown type", {"type": "dance", "id": "r"}, "unknown_type", "r"),
    ("missing type", {"id": "r"}, "missing_field", "r"),
    ("missing id", {"type": "chat", "text": "hi"}, "missing_field", None),
    ("missing text", {"type": "chat", "id": "r"}, "missing_field", "r"),
    ("mistyped text", {"type": "chat", "id": "r", "text": ["hi"]}, "invalid_field", "r"),
    ("mistyped options", {"type": "chat", "id": "r", "text": "hi", "options": 3}, "invalid_field", "r"),
    ("missing input", {"type": "task", "id": "r", "task": "sentiment"}, "missing_field", "r"),
    (
        "unknown task",
        {"type": "task", "id": "r", "task": "nope", "input": {"text": "x"}},
        "unknown_task",
        "r",
    ),
    (
        "stateful task call",
        {"type": "task", "id": "r", "task": "chat", "input": {"text": "x"}},
        "invalid_input",
        "r",
    ),
    (
        "mistyped task input",
        {"type": "task", "id": "r", "task": "sentiment", "input": {"text": 5}},
        "invalid_input",
        "r",
    ),
    ("empty chat text", {"type": "chat", "id": "r", "text": "  \x00\x01 "}, "empty_text", "r"),
    (
        "empty task text",
        {"type": "task", "id": "r", "task": "sentiment", "input": {"text": ""}},
        "empty_text",
        "r",
    ),
    (
        "task text over limit",
        {"type": "task", "id": "r", "task": "sentiment", "input": {"text": "a" * 101}},
        "input_too_long",
        "r",
    ),
    (
        "temperature out of range",
        {"type": "chat", "id": "r", "text": "hi", "options": {"temperature": 9}},
        "bad_decoding",
        "r",
    ),
    (
        "max_new_tokens out of range",
        {"type": "chat", "id": "r", "text": "hi", "options": {"max_new_tokens": 100000}},
        "bad_decoding",
        "r",
    ),
    (
        "temperature a float32 cannot divide by",
        {"type": "chat", "id": "r", "text": "hi", "options": {"temperature": 1e-300}},
        "bad_decoding",
        "r",
    ),
    (
        "seed over 64 bits",
        {"type": "chat", "id": "r", "text": "hi", "options": {"seed": 2**64}},
        "bad_decoding",
        "r",
    ),
    (
        "stop string too long",
        {"type": "chat", "id": "r", "text": "hi", "options": {"stop": ["x" * 257]}},
        "bad_decoding",
        "r",
    ),
    (
        "not overridable",
        {"type": "chat", "id": "r", "text": "hi", "options": {"ignore_eos": True}},
        "bad_decoding",
        "r",
    ),
    (
        "mistyped decoding",
        {"type": "chat", "id": "r", "text": "hi", "options": {"top_p": "high"}},
        "bad_decoding",
        "r",
    ),
    ("oversized frame", {"type": "chat", "id": "r", "text": "x" * 5000}, "frame_too_large", None),
    ("cancel unknown id", {"type": "cancel", "id": "zz"}, "unknown_request", "zz"),
    ("second hello", {"type": "hello"}, "already_started", None),
]


def settings():
    s = make_settings(tasks={"auto_tasks": []}, server={"max_frame_bytes": 4096, "max_in_flight": 3})
    s.task = {"sentiment": {"truncate": "reject", "max_input_chars": 100}}
    return s


async def test_every_bad_input_gets_its_code_and_the_connection_survives(smol):
    s = settings()
    async with serve(scripted_app(smol, s, ScriptedEngine(smol)), s) as (base, url):
        async with websockets.connect(url) as ws:
            assert (await hello(ws))["type"] == "ready"
            for name, frame, code, rid in BAD:
                await ws.send(frame if isinstance(frame, (str, bytes)) else json.dumps(frame))
                ev = await recv_json(ws)
                assert ev["type"] == "error" and ev["code"] == code, (name, ev)
                assert ev.get("id") == rid, (name, ev)
                assert ev["message"], name
                await ws.send(json.dumps({"type": "ping", "data": name}))
                assert await recv_json(ws) == {"type": "pong", "data": name}, name
            # and a normal request still works on the same connection
            await ws.send(
                json.dumps({"type": "task", "id": "ok", "task": "sentiment", "input": {"text": "good"}})
            )
            assert (await recv_json(ws))["type"] == "result"


async def test_too_many_in_flight_and_duplicate_ids(smol):
    s = settings()
    engine = ScriptedEngine(smol)
    engine.gate = asyncio.Event()  # hold every generation until released
    async with serve(scripted_app(smol, s, engine), s) as (base, url):
        async with websockets.connect(url) as ws:
            await hello(ws)
            await ws.send(json.dumps({"type": "chat", "id": "c", "text": "hi"}))
            await ws.send(json.dumps({"type": "chat", "id": "c", "text": "hi"}))
            assert (await recv_json(ws))["code"] == "duplicate_id"
            # generate-mode tasks would need the model; use more chat-free requests: tasks blocked on the gate
            engine_score = engine.score

            async def slow_score(*a, **k):
                await engine.gate.wait()
                return await engine_score(*a, **k)

            engine.score = slow_score
            await ws.send(
                json.dumps({"type": "task", "id": "t1", "task": "sentiment", "input": {"text": "a"}})
            )
            await ws.send(
                json.dumps({"type": "task", "id": "t2", "task": "sentiment", "input": {"text": "b"}})
            )
            await ws.send(
                json.dumps({"type": "task", "id": "t3", "task": "sentiment", "input": {"text": "c"}})
            )
            ev = await recv_json(ws)
            assert ev["code"] == "too_many_requests" and ev["id"] == "t3"
            engine.gate.set()
            assert (await recv_until(ws, is_end("t2")))[-1]["type"] == "result"


async def test_control_characters_stripped_and_long_chat_keeps_newest_part(smol):
    s = settings()
    engine = ScriptedEngine(smol)
    async with serve(scripted_app(smol, s, engine), s) as (base, url):
        async with websockets.connect(url) as ws:
            await hello(ws)
            await ws.send(json.dumps({"type": "chat", "id": "1", "text": "he\x00llo\x07 wor\x1bld"}))
            assert (await recv_until(ws, lambda e: e["type"] == "done"))[-1]["id"] == "1"
            prompt = smol.tokenizer.decode(engine.prompts[-1])
            assert "hello world" in prompt and "\x07" not in prompt
            # chat input over the chat task's limit is cut, keeping the newest part (frame limit raised)
        s2 = settings()
        s2.server.max_frame_bytes = 65536
    async with serve(scripted_app(smol, s2, engine), s2) as (base, url):
        async with websockets.connect(url) as ws:
            await hello(ws)
            text = "old " * 2000 + "NEWEST END"
            await ws.send(json.dumps({"type": "chat", "id": "2", "text": text}))
            assert (await recv_until(ws, is_end("2")))[-1]["type"] == "done"
            prompt = smol.tokenizer.decode(engine.prompts[-1])
            assert "NEWEST END" in prompt and prompt.count("old") < 2000


async def test_frame_over_the_transport_limit_closes_with_1009(smol):
    s = settings()
    async with serve(scripted_app(smol, s, ScriptedEngine(smol)), s) as (base, url):
        async with websockets.connect(url, max_size=None) as ws:
            await hello(ws)
            await ws.send("x" * (2 << 20))
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 60)
            assert info.value.rcvd.code == 1009
        async with websockets.connect(url) as ws:  # the server is fine
            await ws.send(json.dumps({"type": "ping"}))
            assert (await recv_json(ws))["type"] == "pong"
