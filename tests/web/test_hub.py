"""/ws over a real uvicorn server on 127.0.0.1 (ephemeral port) with the `websockets` client."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket

import pytest
import websockets

from rtserver.engine.backend import FinishReason
from rtserver.engine.core import Engine
from rtserver.web.admission import Surface
from rtserver.web.app import create_app

from ..serverutil import (
    ScriptedEngine,
    hello,
    is_end,
    make_settings,
    metric,
    recv_json,
    recv_until,
    scripted_app,
    serve,
    wait_for,
)

pytestmark = pytest.mark.asyncio


# -- real model ----------------------------------------------------------------------------------


async def test_chat_streams_and_resume_keeps_history_and_kv(smol):
    settings = make_settings()
    async with serve(create_app(settings, lambda: smol), settings) as (base, url):
        async with websockets.connect(url) as ws:
            ready = await hello(ws, client="test")
            assert ready["type"] == "ready" and ready["protocol"] == "1.1" and not ready["resumed"]
            assert "sentiment" in [t["name"] for t in ready["tasks"]]
            assert ready["auto_tasks"] == ["sentiment"]
            await ws.send(
                json.dumps(
                    {
                        "type": "chat",
                        "id": "c1",
                        "text": "Hi! What is 2+2?",
                        "options": {"max_new_tokens": 6, "temperature": 0},
                    }
                )
            )
            events = await recv_until(ws, is_end("c1"))
            done = events[-1]
            assert done["type"] == "done", done
            deltas = [e["text"] for e in events if e["type"] == "token"]
            assert all(deltas) and "".join(deltas) == done["text"]
            assert done["output"] == {"reply": done["text"]}
            assert done["usage"]["generated_tokens"] <= 6 and done["usage"]["prompt_tokens"] > 10
            assert set(done["timing"]) == {"queued_ms", "ttft_ms", "total_ms"}
            # the auto task's result (sentiment of the user message) arrives for the same id
            auto = [e for e in events if e["type"] == "result"]
            if not auto:
                auto = await recv_until(ws, lambda e: e["type"] == "result")
            assert auto[-1]["id"] == "c1" and auto[-1]["auto"] and auto[-1]["task"] == "sentiment"
            first_prompt = done["usage"]["prompt_tokens"]
        # reconnect with the resume token: same session, history and cached KV
        async with websockets.connect(url) as ws:
            again = await hello(ws, session_id=ready["session_id"], resume_token=ready["resume_token"])
            assert (
                again["type"] == "ready" and again["resumed"] and again["session_id"] == ready["session_id"]
            )
            assert again["history_turns"] == 1
            await ws.send(
                json.dumps(
                    {
                        "type": "chat",
                        "id": "c2",
                        "text": "And 3+3?",
                        "options": {"max_new_tokens": 4, "temperature": 0},
                    }
                )
            )
            done2 = (await recv_until(ws, is_end("c2")))[-1]
            assert done2["type"] == "done"
            assert done2["usage"]["prompt_tokens"] > first_prompt  # history is in the prompt
            # KV reused across the reconnect: all of turn 1 as generated (its last token was never fed back)
            assert done2["usage"]["cached_tokens"] == first_prompt + done["usage"]["generated_tokens"] - 1


async def test_wrong_token_gets_session_expired_and_fresh_session(smol):
    settings = make_settings()
    async with serve(create_app(settings, lambda: smol), settings) as (base, url):
        async with websockets.connect(url) as ws:
            ready = await hello(ws)
        async with websockets.connect(url) as ws:
            err = await hello(ws, session_id=ready["session_id"], resume_token="x" * 43)
            assert err["type"] == "error" and err["code"] == "session_expired"
            fresh = await recv_json(ws)
            assert fresh["type"] == "ready" and not fresh["resumed"]
            assert fresh["session_id"] != ready["session_id"]


@pytest.mark.parametrize("how", ["close", "abort"])
async def test_disconnect_cancels_the_sequence_within_two_steps_and_expiry_frees_kv(smol, how):
    """A client that goes away mid-reply (a closing handshake, or the socket just dropped): the real engine
    finishes its sequence as CANCELLED, the scheduler running at most 2 more steps for it after the server
    saw the disconnect. Greedy with ignore_eos and max_new_tokens 512, so it cannot end early by itself.
    Then the detached session expires and its KV is freed."""
    settings = make_settings(sessions={"idle_timeout_s": 0.5}, tasks={"auto_tasks": []})
    engine = Engine(smol, settings.engine)
    sched = engine.scheduler
    streams: list = []
    generate = engine.generate

    def generate_to_the_end(prompt_ids, params, **kwargs):  # chat cannot set ignore_eos: set it here
        stream = generate(prompt_ids, dataclasses.replace(params, ignore_eos=True), **kwargs)
        streams.append(stream)
        return stream

    engine.generate = generate_to_the_end
    forwards: list[set[int]] = []  # the sequence ids in each model forward, in order
    sched.fault_hook = lambda items: forwards.append({it.seq.id for it in items})
    cancels: dict[int, tuple[int, int]] = {}  # seq id -> (forwards so far, tokens so far) at cancel
    cancel = sched.cancel

    def cancel_seen(seq):
        cancels.setdefault(seq.id, (len(forwards), len(seq.output_ids)))
        cancel(seq)

    sched.cancel = cancel_seen
    app = create_app(settings, lambda: smol, engine_factory=lambda loaded, s: engine)
    async with serve(app, settings) as (base, url):
        ws = await websockets.connect(url)
        await hello(ws)
        await ws.send(
            json.dumps(
                {
                    "type": "chat",
                    "id": "long",
                    "text": "Write a long story about a cat.",
                    "options": {"max_new_tokens": 512, "temperature": 0},
                }
            )
        )
        await recv_until(ws, lambda e: e["type"] == "token")
        (stream,) = streams
        seq = stream.seq
        assert seq.params.ignore_eos and seq.params.temperature == 0 and seq.params.max_new_tokens == 512
        assert not cancels and not seq.is_finished
        assert await metric(base, "rtserver_kv_used_bytes") > 0
        if how == "close":
            await ws.close()
        else:
            ws.transport.abort()
        result = await asyncio.wait_for(stream.result(), 60)
        assert result.finish_reason is FinishReason.CANCELLED and seq.finish_reason is FinishReason.CANCELLED
        assert seq.cancelled and seq.id in cancels, "the disconnect did not cancel the sequence"
        forwards_before, tokens_before = cancels[seq.id]
        steps_after = sum(seq.id in ids for ids in forwards[forwards_before:])
        assert steps_after <= 2, (steps_after, forwards_before, len(forwards))
        assert len(seq.output_ids) - tokens_before <= 2, (tokens_before, len(seq.output_ids))
        assert 1 <= len(seq.output_ids) < 512
        assert not sched.running and not sched.waiting
        # the idle session expires and frees its KV
        await wait_for(lambda: _zero(base, "rtserver_running_sequences"))
        await wait_for(lambda: _zero(base, "rtserver_sessions"))
        await wait_for(lambda: _zero(base, "rtserver_kv_cached_sessions"))

        async def only_prefix_cache_left():  # the shared prefix cache may keep blocks; nothing else
            return await metric(base, "rtserver_kv_used_bytes") == await metric(
                base, "rtserver_kv_prefix_cache_bytes"
            )

        await wait_for(only_prefix_cache_left)
        async with websockets.connect(url) as ws:  # the server is still fine
            await ws.send(json.dumps({"type": "ping"}))
            assert (await recv_json(ws))["type"] == "pong"


async def _zero(base, name):
    return await metric(base, name) == 0


# -- scripted engine: routing, order, cancel, UTF-8, slow clients ----------------------------------


async def test_split_characters_arrive_whole(smol):
    text = "你好，世界！🎉😀 café ≠ naïve 🇫🇷"
    ids = smol.tokenizer.encode(text, add_special_tokens=False)
    # the script really splits characters across tokens
    assert any("\ufffd" in smol.tokenizer.decode([t]) for t in ids)
    settings = make_settings(tasks={"auto_tasks": []})
    engine = ScriptedEngine(smol, script=ids)
    async with serve(scripted_app(smol, settings, engine), settings) as (base, url):
        async with websockets.connect(url) as ws:
            await hello(ws)
            await ws.send(
                json.dumps({"type": "chat", "id": "u", "text": "say it", "options": {"max_new_tokens": 200}})
            )
            events = await recv_until(ws, is_end("u"))
            deltas = [e["text"] for e in events if e["type"] == "token"]
            assert all(d and "\ufffd" not in d for d in deltas)
            assert "".join(deltas) == events[-1]["text"] == text


async def test_concurrent_requests_routed_by_id_and_chat_busy(smol):
    settings = make_settings(tasks={"auto_tasks": []})
    ids = smol.tokenizer.encode(" one two three four five six seven eight", add_special_tokens=False)
    engine = ScriptedEngine(smol, script=ids, delay=0.02)
    async with serve(scripted_app(smol, settings, engine), settings) as (base, url):
        async with websockets.connect(url) as ws:
            await hello(ws)
            await ws.send(json.dumps({"type": "chat", "id": "a", "text": "count"}))
            await ws.send(
                json.dumps({"type": "task", "id": "s", "task": "sentiment", "input": {"text": "I love it"}})
            )
            await ws.send(json.dumps({"type": "chat", "id": "b", "text": "again"}))
            events = []
            ends = set()
            while ends != {"a", "s", "b"}:
                ev = await recv_json(ws)
                events.append(ev)
                if ev["type"] in ("done", "result", "error"):
                    ends.add(ev["id"])
            by = {rid: [e for e in events if e.get("id") == rid] for rid in "asb"}
            assert by["b"] == [
                {
                    "type": "error",
                    "code": "chat_busy",
                    "id": "b",
                    "busy_id": "a",
                    "message": by["b"][0]["message"],
                }
            ]
            assert by["s"][-1]["type"] == "result" and by["s"][-1]["output"]["label"] in (
                "positive",
                "negative",
            )
            tokens = [e["text"] for e in by["a"] if e["type"] == "token"]
            assert by["a"][-1]["type"] == "done" and "".join(tokens) == by["a"][-1]["text"]
            assert by["a"][-1]["text"] == smol.tokenizer.decode(ids)
            # after the turn ends, the next chat is accepted
            await ws.send(json.dumps({"type": "chat", "id": "b", "text": "again"}))
            assert (await recv_until(ws, is_end("b")))[-1]["type"] == "done"


async def test_cancel_ends_chat_with_cancelled_done(smol):
    settings = make_settings(tasks={"auto_tasks": []})
    ids = smol.tokenizer.encode(" word" * 200, add_special_tokens=False)
    engine = ScriptedEngine(smol, script=ids, delay=0.01)
    async with serve(scripted_app(smol, settings, engine), settings) as (base, url):
        async with websockets.connect(url) as ws:
            await hello(ws)
            await ws.send(
                json.dumps({"type": "chat", "id": "x", "text": "go", "options": {"max_new_tokens": 300}})
            )
            await recv_until(ws, lambda e: e["type"] == "token")
            await ws.send(json.dumps({"type": "cancel", "id": "x"}))
            done = (await recv_until(ws, is_end("x")))[-1]
            assert done["type"] == "done" and done["finish_reason"] == "cancelled"
            assert done["usage"]["generated_tokens"] < 200
            await ws.send(json.dumps({"type": "cancel", "id": "x"}))
            err = await recv_json(ws)
            assert err["code"] == "unknown_request" and err["id"] == "x"


async def test_reset_clears_history_and_drops_kv(smol):
    settings = make_settings(tasks={"auto_tasks": []})
    engine = ScriptedEngine(smol)
    async with serve(scripted_app(smol, settings, engine), settings) as (base, url):
        async with websockets.connect(url) as ws:
            ready = await hello(ws)
            await ws.send(json.dumps({"type": "chat", "id": "1", "text": "hi"}))
            await recv_until(ws, is_end("1"))
            await ws.send(json.dumps({"type": "reset"}))
            assert (await recv_json(ws)) == {"type": "reset", "session_id": ready["session_id"]}
            assert ready["session_id"] in engine.dropped
        async with websockets.connect(url) as ws:
            again = await hello(ws, session_id=ready["session_id"], resume_token=ready["resume_token"])
            assert again["resumed"] and again["history_turns"] == 0


async def test_resume_takes_over_the_old_connection(smol):
    settings = make_settings(tasks={"auto_tasks": []})
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        async with websockets.connect(url) as old, websockets.connect(url) as new:
            ready = await hello(old)
            again = await hello(new, session_id=ready["session_id"], resume_token=ready["resume_token"])
            assert again["resumed"]
            err = await recv_json(old)
            assert err["code"] == "session_taken_over"
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(old.recv(), 30)
            assert info.value.rcvd.code == 4409


async def test_slow_client_is_closed_and_others_unaffected(smol):
    settings = make_settings(
        tasks={"auto_tasks": []}, server={"send_queue_size": 8, "slow_client_timeout_s": 0.5}
    )
    engine = ScriptedEngine(smol, chunks=["x" * 16384] * 4000)
    async with serve(scripted_app(smol, settings, engine), settings) as (base, url):
        # a small, fixed receive buffer (no autotuning) and a paused transport: a client that stops reading
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        sock.connect(("127.0.0.1", int(base.rsplit(":", 1)[1])))
        sock.setblocking(False)
        async with websockets.connect(url, sock=sock, max_queue=1, max_size=None, compression=None) as slow:
            await hello(slow)
            await slow.send(
                json.dumps({"type": "chat", "id": "flood", "text": "go", "options": {"max_new_tokens": 512}})
            )
            slow.transport.pause_reading()
            # do not read: the server must give up on this client, not buffer without bound
            await wait_for(lambda: _positive(base, "rtserver_slow_client_closes"))
            assert engine.cancelled, "the slow client's generation was not cancelled"
            slow.transport.resume_reading()  # what was buffered drains, then the connection is gone
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    await asyncio.wait_for(slow.recv(), 60)
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "ping", "data": 1}))
            assert await recv_json(ws) == {"type": "pong", "data": 1}


async def _positive(base, name):
    return await metric(base, name + "_total") > 0


async def test_ws_token_required_when_configured(smol):
    settings = make_settings(security={"ws_token": "s3cret"})
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "ping"}))
            assert (await recv_json(ws))["type"] == "pong"  # ping needs no session
            err = await hello(ws, auth_token="wrong")
            assert err["code"] == "unauthorized"
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 30)
            assert info.value.rcvd.code == 4401
        async with websockets.connect(url) as ws:
            assert (await hello(ws, auth_token="s3cret"))["type"] == "ready"


async def test_api_token_does_not_lock_the_widget_door(smol):
    """The inference API's token guards the HTTP API only: a widget's hello carries no token."""
    settings = make_settings(security={"api_token": "s3cret"})
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        async with websockets.connect(url) as ws:
            assert (await hello(ws))["type"] == "ready"


async def test_idle_socket_closed_at_the_hello_deadline(smol):
    settings = make_settings(server={"hello_timeout_s": 0.3})
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        async with websockets.connect(url) as ws:
            err = await recv_json(ws)
            assert err["type"] == "error" and err["code"] == "hello_timeout", err
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 5)
            assert info.value.rcvd.code == 4408
        async with websockets.connect(url) as ws:  # a client that says hello in time is served
            assert (await hello(ws))["type"] == "ready"
            await asyncio.sleep(0.5)
            await ws.send(json.dumps({"type": "ping"}))
            assert (await recv_json(ws))["type"] == "pong"


async def test_open_sockets_capped_per_client(smol):
    settings = make_settings(server={"max_connections_per_ip": 3})
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        kept = [await websockets.connect(url) for _ in range(3)]
        try:
            async with websockets.connect(url) as extra:
                err = await recv_json(extra)
                assert err["code"] == "too_many_connections", err
                with pytest.raises(websockets.ConnectionClosed) as info:
                    await asyncio.wait_for(extra.recv(), 5)
                assert info.value.rcvd.code == 4429
        finally:
            await kept.pop().close()
        await asyncio.sleep(0.1)
        async with websockets.connect(url) as ws:  # a closed socket frees its place
            assert (await hello(ws))["type"] == "ready"
        for ws in kept:
            await ws.close()


async def test_not_ready_while_loading(smol):
    gate = asyncio.Event()
    settings = make_settings()

    def slow_loader():
        import time

        while not gate.is_set():
            time.sleep(0.01)
        return smol

    app = scripted_app(smol, settings, ScriptedEngine(smol))
    app = create_app(settings, slow_loader, engine_factory=lambda loaded_, s: ScriptedEngine(smol))
    async with serve(app, settings, wait_ready=False) as (base, url):
        async with websockets.connect(url) as ws:
            err = await recv_json(ws)
            assert err["code"] == "not_ready"
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 30)
            assert info.value.rcvd.code == 1013
        gate.set()


# -- limits, origins, shutdown ---------------------------------------------------------------------


async def test_rate_limited_per_connection_with_retry_after_and_cancel_still_allowed(smol):
    settings = make_settings(security={"rate_limit_per_s": 1.0, "rate_limit_burst": 3})
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        async with websockets.connect(url) as ws:
            assert (await hello(ws))["type"] == "ready"  # 1 token
            for _ in range(2):
                await ws.send(json.dumps({"type": "ping"}))
                assert (await recv_json(ws))["type"] == "pong"
            await ws.send(json.dumps({"type": "chat", "id": "c1", "text": "hi"}))
            err = await recv_json(ws)
            assert err["code"] == "rate_limited" and err["id"] == "c1"
            assert 0 < err["retry_after_s"] <= 1.0 and "per connection" in err["message"]
            await ws.send(json.dumps({"type": "cancel", "id": "c1"}))
            assert (await recv_json(ws))["code"] == "unknown_request"  # cancel is never rate limited
            await asyncio.sleep(err["retry_after_s"])
            await ws.send(json.dumps({"type": "ping"}))
            assert (await recv_json(ws))["type"] == "pong"
        async with websockets.connect(url) as ws:  # a new connection has its own bucket
            assert (await hello(ws))["type"] == "ready"


async def test_rate_limited_per_ip_across_connections_and_http(smol):
    import httpx

    settings = make_settings(security={"ip_rate_limit_per_s": 0.5, "ip_rate_limit_burst": 3})
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        async with websockets.connect(url) as a, websockets.connect(url) as b:
            assert (await hello(a))["type"] == "ready"
            assert (await hello(b))["type"] == "ready"
            await a.send(json.dumps({"type": "ping"}))
            assert (await recv_json(a))["type"] == "pong"
            await b.send(json.dumps({"type": "ping"}))
            err = await recv_json(b)
            assert err["code"] == "rate_limited" and "per client address" in err["message"]
        async with httpx.AsyncClient() as client:
            r = await client.post(base + "/sentiment", json={"text": "great"})
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
            assert int(r.headers["retry-after"]) >= 1
            assert (await client.get(base + "/health")).status_code == 200  # health is never limited


async def test_sessions_per_ip_cap_closes_with_4429(smol):
    settings = make_settings(security={"max_sessions_per_ip": 2})
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        async with websockets.connect(url) as a, websockets.connect(url) as b, websockets.connect(url) as c:
            first = await hello(a)
            assert (await hello(b))["type"] == "ready"
            err = await hello(c)
            assert err["code"] == "too_many_sessions"
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(c.recv(), 30)
            assert info.value.rcvd.code == 4429
        # once a's connection is gone its session is detached: a new one may take its place, and a
        # resume of a's own session does not count as new
        async with websockets.connect(url) as d:
            ready = await hello(d, session_id=first["session_id"], resume_token=first["resume_token"])
            assert ready["type"] == "ready" and ready["resumed"]


async def test_foreign_origin_refused_with_1008(smol):
    settings = make_settings(security={"allowed_origins": ["https://shop.example"]})
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        async with websockets.connect(url, origin="https://evil.example") as ws:
            err = await recv_json(ws)
            assert err["code"] == "forbidden_origin" and "evil.example" in err["message"]
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 30)
            assert info.value.rcvd.code == 1008
        async with websockets.connect(url, origin="https://shop.example") as ws:
            assert (await hello(ws))["type"] == "ready"


async def test_drain_lets_short_replies_finish_and_ends_long_ones(smol):
    settings = make_settings(server={"shutdown_grace_s": 1.0})
    tok = smol.tokenizer.encode(" la", add_special_tokens=False)[0]
    engine = ScriptedEngine(smol, script=[tok] * 400, delay=0.01)  # ~4 s per reply
    app = scripted_app(smol, settings, engine)
    async with serve(app, settings) as (base, url):
        hub = app.state.hub
        async with websockets.connect(url) as ws, websockets.connect(url) as short:
            await hello(ws)
            await hello(short)
            await ws.send(
                json.dumps({"type": "chat", "id": "long", "text": "hi", "options": {"max_new_tokens": 400}})
            )
            await recv_until(ws, lambda e: e["type"] == "token")
            await short.send(
                json.dumps({"type": "chat", "id": "short", "text": "hi", "options": {"max_new_tokens": 20}})
            )
            await recv_until(short, lambda e: e["type"] == "token")
            drain = asyncio.create_task(hub.drain(1.0))
            events = await recv_until(short, is_end("short"))
            assert events[-1]["type"] == "done"  # finished within the grace period
            assert any(e["type"] == "shutting_down" for e in events)
            events = await recv_until(ws, lambda e: e["type"] == "shutting_down")
            assert events[-1]["deadline_s"] == 1.0
            await ws.send(
                json.dumps({"type": "task", "id": "late", "task": "sentiment", "input": {"text": "x"}})
            )
            events = await recv_until(ws, is_end("late"))
            assert events[-1]["type"] == "error" and events[-1]["code"] == "shutting_down"
            events = await recv_until(ws, is_end("long"))
            assert events[-1]["type"] == "error" and events[-1]["code"] == "shutting_down"
            with pytest.raises(websockets.ConnectionClosed) as info:
                while True:
                    await asyncio.wait_for(ws.recv(), 30)
            assert info.value.rcvd.code == 1001
            await drain
        assert not hub.connections


async def test_task_calls_hold_their_tokens_against_the_clients_budget(smol):
    """A task call reserves its most tokens (longest prompt + what it may generate) like a chat turn:
    one over the client's budget alone is request_too_large, and what a finished call held comes back."""
    settings = make_settings(tasks={"auto_tasks": []})
    app = create_app(settings, lambda: smol)
    async with serve(app, settings) as (_, url):
        cost = app.state.rt.tasks.cost("sentiment")
        public = app.state.admission.budgets[Surface.PUBLIC]
        public.per_client = cost - 1
        async with websockets.connect(url) as ws:
            await hello(ws)
            call = {"type": "task", "id": "s", "task": "sentiment", "input": {"text": "I love it"}}
            await ws.send(json.dumps(call))
            (err,) = await recv_until(ws, is_end("s"))
            assert err["type"] == "error" and err["code"] == "request_too_large", err
            assert f"needs {cost} tokens" in err["message"], err
            public.per_client = cost
            await ws.send(json.dumps({**call, "id": "t"}))
            (ok,) = await recv_until(ws, is_end("t"))
            assert ok["type"] == "result", ok
            assert public.held == 0, public.held
