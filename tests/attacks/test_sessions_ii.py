"""Sessions are customers' data (issue 48, item 4 and 7b, and the open items on sessions and Redis).

A flood of new sessions must never erase a conversation a customer was told was stored: the table and
each address's share are bounded by refusing or shedding empty newcomers, never by dropping acknowledged
turns. Clustered, the same caps hold across nodes, an empty session writes nothing to Redis, a resume
rotates the token, and a command Redis refuses fails that operation without taking the node down.
Each test measures the harm (acknowledged turns lost, records written, nodes marked down), on the
scripted engine, so they run in seconds.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import redis.asyncio as aioredis
import websockets

from rtserver.web.app import create_app

from ..clusterutil import chat, redis_server, scripted_node
from ..serverutil import ScriptedEngine, hello, make_settings, recv_json, serve


async def _chatted(url: str, turns: int = 2) -> tuple[str, str]:
    """A customer who chats `turns` turns (each acknowledged with `done`) and leaves: (id, token)."""
    async with websockets.connect(url) as ws:
        ready = await hello(ws, client="customer")
        for i in range(turns):
            assert (await chat(ws, f"c{i}", f"my order number is {1000 + i}"))[-1]["type"] == "done"
        return ready["session_id"], ready["resume_token"]


async def _lost_turns(url: str, sid: str, token: str, turns: int) -> tuple[int, dict]:
    """How many of the customer's acknowledged turns its resume does not show, and its `ready`."""
    async with websockets.connect(url) as ws:
        ready = await hello(ws, session_id=sid, resume_token=token)
        if ready["type"] == "error":  # session_expired: a fresh, empty session follows
            return turns, await recv_json(ws)
        users = [m["content"] for m in ready["history"] if m["role"] == "user"]
        return turns - len(users), ready


async def _refused(ws) -> tuple[dict, int]:
    """The error a hello got and the close code that followed."""
    err = await recv_json(ws)
    with pytest.raises(websockets.ConnectionClosed) as info:
        await asyncio.wait_for(ws.recv(), 30)
    assert info.value.rcvd is not None
    return err, info.value.rcvd.code


def _app(smol, **sections):
    settings = make_settings(**sections)
    return create_app(
        settings, lambda: smol, engine_factory=lambda loaded, s: ScriptedEngine(loaded)
    ), settings


async def test_a_session_flood_keeps_a_customers_conversation(smol):
    """The issue's flood (550 hellos with max_sessions=500), scaled down: a customer who chatted and
    left, then 3x the table in new sessions. Before: the customer's session was dropped to make room
    and its resume came back `session_expired` with an empty history."""
    app, _ = _app(smol, sessions={"max_sessions": 10})
    async with serve(app, _) as (_base, url):
        registry = app.state.hub.sessions
        sid, token = await _chatted(url, turns=2)
        for _ in range(30):  # sessions that say hello and go: the newest empty ones make room
            async with websockets.connect(url) as ws:
                assert (await hello(ws))["type"] == "ready"
        assert len(registry) == 10 and sid in registry.sessions
        assert registry.shed_total == 21
        # a flood that stays connected fills the table: the newcomer is refused, nobody is dropped
        held = []
        try:
            for _ in range(9):  # with the customer's, the table is full of sessions worth keeping
                ws = await websockets.connect(url)
                held.append(ws)
                assert (await hello(ws))["type"] == "ready"
            async with websockets.connect(url) as ws:
                await ws.send(json.dumps({"type": "hello"}))
                err, code = await _refused(ws)
            assert err["code"] == "sessions_full" and err["retry_after_s"] >= 1, err
            assert code == 1013  # try again later (or on another node)
            lost, ready = await _lost_turns(url, sid, token, turns=2)
        finally:
            for ws in held:
                await ws.close()
        assert lost == 0, ready  # every acknowledged turn survived the flood
        assert ready["resumed"] is True and len(ready["history"]) == 4


async def test_an_address_holds_at_most_its_cap_of_sessions_connected_or_not(smol):
    """Standalone, `security.max_sessions_per_ip` counts the sessions an address holds, detached ones
    with a conversation included. Before: at the cap its oldest detached session was dropped — a
    conversation of another customer behind the same address — and the flood went on without end."""
    app, settings = _app(smol, security={"max_sessions_per_ip": 3})
    async with serve(app, settings) as (_base, url):
        registry = app.state.hub.sessions
        customers = [await _chatted(url, turns=1) for _ in range(3)]
        for _ in range(5):  # the same address again: refused with a hint, nobody dropped
            async with websockets.connect(url) as ws:
                await ws.send(json.dumps({"type": "hello"}))
                err, code = await _refused(ws)
            assert err["code"] == "too_many_sessions" and err["retry_after_s"] >= 1 and code == 4429, err
        assert registry.per_ip["127.0.0.1"] == 3
        lost = [(await _lost_turns(url, sid, token, 1))[0] for sid, token in customers]
        assert lost == [0, 0, 0]


async def test_resume_rotates_the_token_and_the_old_one_stops_working(smol):
    app, settings = _app(smol)
    async with serve(app, settings) as (_base, url):
        sid, first = await _chatted(url, turns=1)
        async with websockets.connect(url) as ws:
            ready = await hello(ws, session_id=sid, resume_token=first)
        assert ready["resumed"] is True and ready["resume_token"] != first
        async with websockets.connect(url) as ws:  # someone who copied the old token
            err = await hello(ws, session_id=sid, resume_token=first)
            assert err["code"] == "session_expired", err
            assert (await recv_json(ws))["session_id"] != sid
        lost, again = await _lost_turns(url, sid, ready["resume_token"], 1)
        assert lost == 0 and again["resumed"] is True


async def _records(client: aioredis.Redis) -> int:
    return len([k async for k in client.scan_iter("rtserver:session:*")])


async def test_clustered_an_address_is_capped_across_nodes_and_empty_sessions_write_nothing(smol, tmp_path):
    """Item 7b: one address made 394 sessions and 394 Redis records in 20 s. Clustered, the cap counts
    the sessions the address holds on every node (connected or not), and an empty session writes no
    record. Before: a disconnected session freed its slot, and every hello wrote a record."""
    sec = {"max_sessions_per_ip": 2}
    with redis_server(tmp_path) as redis:
        client = aioredis.Redis.from_url(redis.url)
        try:
            async with (
                scripted_node(smol, redis.url, "a", security=sec) as (_, url_a, _, app_a),
                scripted_node(smol, redis.url, "b", security=sec) as (_, url_b, _, _),
            ):
                hub_a = app_a.state.hub
                for _ in range(20):  # empty sessions that come and go: nothing stored, nothing held
                    async with websockets.connect(url_a) as ws:
                        assert (await hello(ws))["type"] == "ready"
                    await asyncio.wait_for(_until(lambda: _gone(hub_a)), 10)  # its socket is closed
                    # and its slot left the address's count (the node tells Redis after the close)
                    await asyncio.wait_for(_until(lambda: _no_slot(client)), 10)
                assert await _records(client) == 0 and len(hub_a.sessions) <= 2
                customers = [await _chatted(url_a, turns=1), await _chatted(url_b, turns=1)]
                assert await _records(client) == 2
                for url in (url_a, url_b):  # both customers left; their conversations still count
                    async with websockets.connect(url) as ws:
                        await ws.send(json.dumps({"type": "hello"}))
                        err, code = await _refused(ws)
                    assert err["code"] == "too_many_sessions" and code == 4429, err
                    assert err["retry_after_s"] >= 1
                assert await _records(client) == 2
                for (sid, token), url in zip(customers, (url_b, url_a), strict=True):  # across nodes
                    lost, ready = await _lost_turns(url, sid, token, 1)
                    assert lost == 0 and ready["resumed"] is True
        finally:
            await client.aclose()


async def test_clustered_resume_rotates_the_token_on_every_node(smol, tmp_path):
    with redis_server(tmp_path) as redis:
        async with (
            scripted_node(smol, redis.url, "a") as (_, url_a, _, _),
            scripted_node(smol, redis.url, "b") as (_, url_b, _, _),
        ):
            sid, first = await _chatted(url_a, turns=1)
            lost, ready = await _lost_turns(url_b, sid, first, 1)
            assert lost == 0 and ready["resume_token"] != first
            for url in (url_a, url_b):
                async with websockets.connect(url) as ws:
                    err = await hello(ws, session_id=sid, resume_token=first)
                    assert err["code"] == "session_expired", err
            lost, again = await _lost_turns(url_a, sid, ready["resume_token"], 1)
            assert lost == 0 and again["resumed"] is True


async def test_a_command_redis_refuses_does_not_take_the_node_down(smol, tmp_path):
    """WRONGTYPE on one session's key (OOM is refused the same way): that resume fails with
    `store_error`; the node stays ready and serves everyone else. Before: any RedisError marked Redis
    down, so /ready went 503 and every hello on the node got `unavailable`."""
    with redis_server(tmp_path) as redis:
        client = aioredis.Redis.from_url(redis.url)
        try:
            async with scripted_node(smol, redis.url, "a") as (base, url, _, app):
                cluster = app.state.rt.topology.cluster
                sid, token = await _chatted(url, turns=1)
                await client.delete(f"rtserver:session:{sid}")
                await client.hset(f"rtserver:session:{sid}", "x", "y")  # a key of the wrong type
                async with websockets.connect(url) as ws:
                    err = await hello(ws, session_id=sid, resume_token=token)
                assert err["code"] == "store_error", err
                assert "WRONGTYPE" not in err["message"]  # the detail is for the log
                assert cluster.available and cluster.command_errors == 1
                async with httpx.AsyncClient() as http:
                    assert (await http.get(base + "/ready")).status_code == 200
                async with websockets.connect(url) as ws:  # a bystander on the same node
                    assert (await hello(ws))["type"] == "ready"
                    assert (await chat(ws, "b0", "hello"))[-1]["type"] == "done"
        finally:
            await client.aclose()


async def test_a_hubs_ended_sessions_are_freed_on_its_rtserver_node(smol):
    """A hub's sessions keep KV on its rtserver node under `rtserver_session`; when the hub drops a
    session (expired, shed, reset) the node is told to free it. Before: the node kept every key until
    its LRU evicted it (and then remembered it as evicted, without bound)."""
    from rtserver.engine.backend import SamplingParams
    from rtserver.remote.backend import RemoteBackend

    node_settings = make_settings()
    engine = ScriptedEngine(smol)
    node_app = create_app(node_settings, lambda: smol, engine_factory=lambda loaded, s: engine)
    async with serve(node_app, node_settings) as (node_base, _):
        hub_settings = make_settings(model={"backend": "openai"}, backend={"urls": [node_base]})
        backend = RemoteBackend(smol.tokenizer, hub_settings.backend)
        backend.start()
        try:
            await backend.check()
            assert backend.kinds == {node_base: "rtserver"}
            ids = smol.tokenizer.encode("Hello there", add_special_tokens=False)
            for key in ("s1", "s2", "s3"):
                gen = backend.generate(ids, SamplingParams(max_new_tokens=2), session_key=key)
                await gen.result()
            for key in ("s1", "s2"):
                backend.drop_session(key)

            async def freed() -> bool:
                return {"remote:s1", "remote:s2"} <= set(engine.dropped)

            await asyncio.wait_for(_until(freed), 10)
            assert "remote:s3" not in engine.dropped  # a live session's KV stays
        finally:
            await backend.stop()


async def _no_slot(client: aioredis.Redis) -> bool:
    return await client.zcard("rtserver:ipsessions:127.0.0.1") == 0


async def _gone(hub) -> bool:
    return not hub.connections


async def _until(pred) -> None:
    while not await pred():
        await asyncio.sleep(0.05)
