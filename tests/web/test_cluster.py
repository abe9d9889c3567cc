"""Many nodes as one through a real redis-server (rtserver/web/cluster/): in-process nodes on the
scripted engine, so these run in the default suite. The real-process, real-model tests (SIGKILL of a
node over 50 sessions) are in tests/web/test_cluster_nodes.py."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest
import websockets

from rtserver.config import ConfigError, settings_from_mapping

from ..clusterutil import chat, heartbeat, redis_server, scripted_node, stored_conversation
from ..serverutil import hello, metric, recv_json, wait_for


async def _status(base: str, path: str) -> tuple[int, dict]:
    async with httpx.AsyncClient() as client:
        r = await client.get(base + path)
        return r.status_code, r.json()


async def test_session_resumes_on_another_node_with_its_history(smol, tmp_path):
    with redis_server(tmp_path) as redis:
        async with (
            scripted_node(smol, redis.url, "a") as (_, url_a, _, _),
            scripted_node(smol, redis.url, "b") as (_, url_b, engine_b, _),
        ):
            async with websockets.connect(url_a) as ws:
                ready = await hello(ws, client="alice")
                sid, token = ready["session_id"], ready["resume_token"]
                replies = []
                for i, text in enumerate(["my name is Zorblax", "I like turnips"]):
                    events = await chat(ws, f"c{i}", text)
                    assert events[-1]["type"] == "done", events
                    replies.append(events[-1]["text"])
            async with websockets.connect(url_b) as ws:
                ready = await hello(ws, session_id=sid, resume_token=token)
                assert ready["type"] == "ready" and ready["resumed"] is True, ready
                assert ready["session_id"] == sid
                assert [m["content"] for m in ready["history"]] == [
                    "my name is Zorblax",
                    replies[0],
                    "I like turnips",
                    replies[1],
                ]
                assert ready["resume_token"] != token  # each resume rotates the token
                token = ready["resume_token"]
                events = await chat(ws, "c2", "what is my name?")
                assert events[-1]["type"] == "done", events
                # node B's prompt was rendered from the stored history (its KV rebuilt from it)
                prompt = smol.tokenizer.decode(engine_b.prompts[-1])
                assert "Zorblax" in prompt and "turnips" in prompt and "what is my name?" in prompt
            # and back on A: A's cached copy is stale (a turn happened on B), the record wins
            async with websockets.connect(url_a) as ws:
                ready = await hello(ws, session_id=sid, resume_token=token)
                assert ready["resumed"] is True and len(ready["history"]) == 6, ready


async def test_wrong_token_or_unknown_id_is_session_expired_on_every_node(smol, tmp_path):
    with redis_server(tmp_path) as redis:
        async with (
            scripted_node(smol, redis.url, "a") as (_, url_a, _, _),
            scripted_node(smol, redis.url, "b") as (_, url_b, _, _),
        ):
            async with websockets.connect(url_a) as ws:
                sid = (await hello(ws))["session_id"]
            for session_id, token in ((sid, "not-the-token"), ("no-such-session", "x")):
                async with websockets.connect(url_b) as ws:
                    err = await hello(ws, session_id=session_id, resume_token=token)
                    assert err["type"] == "error" and err["code"] == "session_expired", err
                    fresh = await recv_json(ws)
                    assert fresh["type"] == "ready" and fresh["resumed"] is False
                    assert fresh["session_id"] != sid


async def test_redis_unreachable_at_start_makes_ready_false_with_the_reason(smol, tmp_path):
    from rtbench.serverproc import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    async with scripted_node(smol, url, "a", wait_redis=False) as (base, ws_url, _, _):
        code, body = await _status(base, "/ready")
        assert code == 503 and body["ready"] is False
        assert "Redis" in body["reason"] and "unreachable" in body["reason"], body
        code, health = await _status(base, "/health")
        assert health["cluster"]["redis"] == "down" and "reason" in health["cluster"], health
        async with websockets.connect(ws_url) as ws:
            err = await hello(ws)
            assert err["type"] == "error" and err["code"] == "unavailable", err


async def test_redis_lost_while_serving_typed_errors_then_recovers_by_itself(smol, tmp_path):
    with redis_server(tmp_path) as redis:
        async with (
            scripted_node(smol, redis.url, "a") as (base_a, url_a, engine_a, _),
            scripted_node(smol, redis.url, "b") as (base_b, url_b, _, _),
        ):
            async with websockets.connect(url_a) as ws:
                ready = await hello(ws)
                sid, token = ready["session_id"], ready["resume_token"]
                assert (await chat(ws, "c0", "first"))[-1]["type"] == "done"
                # a reply running when Redis goes: it streams to the end, but is not acknowledged
                engine_a.gate = asyncio.Event()
                asked = len(engine_a.prompts)
                await ws.send(json.dumps({"type": "chat", "id": "c1", "text": "second"}))
                await wait_for(lambda: _true(len(engine_a.prompts) > asked))  # the reply waits at the gate
                redis.stop()
                engine_a.gate.set()
                engine_a.gate = None
                events = []
                while not (
                    events and events[-1].get("id") == "c1" and events[-1]["type"] in ("done", "error")
                ):
                    events.append(await recv_json(ws))
                assert events[-1]["type"] == "error" and events[-1]["code"] == "unavailable", events
                assert any(e["type"] == "token" for e in events)  # the reply itself ran to its end
                # a new turn meanwhile: refused at once, typed
                err = (await chat(ws, "c2", "third"))[-1]
                assert err["type"] == "error" and err["code"] == "unavailable", err
                # new sessions and resumes on the other node: typed errors, no crash
                await wait_for(lambda: _not_ready(base_b))
                async with websockets.connect(url_b) as ws2:
                    err = await hello(ws2)
                    assert err["code"] == "unavailable", err
                async with websockets.connect(url_b) as ws2:
                    err = await hello(ws2, session_id=sid, resume_token=token)
                    assert err["code"] == "unavailable", err
                redis.start()  # same port, same data folder (append-only file, fsync always)
                await wait_for(lambda: _ready(base_a))
                await wait_for(lambda: _ready(base_b))
                assert (await chat(ws, "c3", "fourth"))[-1]["type"] == "done"
            async with websockets.connect(url_b) as ws:
                ready = await hello(ws, session_id=sid, resume_token=token)
                assert ready["resumed"] is True, ready
                # what was acknowledged is there; the unacknowledged turn is not
                users = [m["content"] for m in ready["history"] if m["role"] == "user"]
                assert users == ["first", "fourth"], ready["history"]


async def _ready(base: str) -> bool:
    return (await _status(base, "/ready"))[0] == 200


async def _not_ready(base: str) -> bool:
    return (await _status(base, "/ready"))[0] == 503


async def test_per_ip_rate_limit_is_one_bucket_across_nodes(smol, tmp_path):
    sec = {"ip_rate_limit_per_s": 0.5, "ip_rate_limit_burst": 6}
    with redis_server(tmp_path) as redis:
        async with (
            scripted_node(smol, redis.url, "a", security=sec) as (base_a, url_a, _, _),
            scripted_node(smol, redis.url, "b", security=sec) as (_, url_b, _, _),
        ):
            async with websockets.connect(url_a) as wa, websockets.connect(url_b) as wb:
                outcomes = []
                for i in range(8):  # alternating nodes: 8 pings against one bucket of 6
                    ws = (wa, wb)[i % 2]
                    await ws.send(json.dumps({"type": "ping", "data": i}))
                    outcomes.append((await recv_json(ws))["type"])
                assert outcomes[:6] == ["pong"] * 6, outcomes
                assert outcomes[6:] == ["error", "error"], outcomes
            async with httpx.AsyncClient() as client:  # the HTTP API draws on the same bucket
                r = await client.get(base_a + "/v1/tasks")
                assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited", r.text


async def test_sessions_per_ip_counted_across_nodes(smol, tmp_path):
    sec = {"max_sessions_per_ip": 2}
    with redis_server(tmp_path) as redis:
        async with (
            scripted_node(smol, redis.url, "a", security=sec) as (_, url_a, _, _),
            scripted_node(smol, redis.url, "b", security=sec) as (_, url_b, _, _),
        ):
            async with websockets.connect(url_a) as w1, websockets.connect(url_b) as w2:
                assert (await hello(w1))["type"] == "ready"
                assert (await hello(w2))["type"] == "ready"
                async with websockets.connect(url_b) as w3:
                    err = await hello(w3)
                    assert err["type"] == "error" and err["code"] == "too_many_sessions", err
            # both disconnected: their slots are free again, on either node
            async with websockets.connect(url_a) as w4:
                assert (await hello(w4))["type"] == "ready"


async def test_health_shows_the_cluster(smol, tmp_path):
    with redis_server(tmp_path) as redis:
        async with (
            scripted_node(smol, redis.url, "a") as (base_a, url_a, _, _),
            scripted_node(smol, redis.url, "b", security={"console_token": "tok"}) as (_, url_b, _, _),
        ):
            async with websockets.connect(url_a) as w1, websockets.connect(url_b) as w2:
                await hello(w1)
                await hello(w2)
                assert (await chat(w1, "c0", "hi"))[-1]["type"] == "done"  # a record is written
                agent, snap = await _console_login(url_b, "Bob", "bob")
                assert snap["type"] == "console_ready"

                async def both_counted() -> dict | None:
                    cluster = (await _status(base_a, "/health"))[1]["cluster"]
                    counted = cluster["nodes_alive"] == 2 and cluster["sessions"] == 2
                    return cluster if counted and cluster["console_agents"] == 1 else None

                cluster = await wait_for(both_counted)
                assert {n["node_id"] for n in cluster["nodes"]} == {"a", "b"}
                assert cluster["redis"] == "up" and cluster["node_id"] == "a"

                async def metrics_counted() -> bool:
                    return await metric(base_a, "rtserver_cluster_sessions") == 2

                await wait_for(metrics_counted)
                assert await metric(base_a, "rtserver_cluster_nodes_alive") == 2
                assert await metric(base_a, "rtserver_cluster_redis_up") == 1
                assert await metric(base_a, "rtserver_cluster_session_writes_total") >= 1
                assert await metric(base_a, "rtserver_cluster_console_agents") == 1
                await agent.close()


@pytest.mark.parametrize(
    "table, message",
    [
        ({"redis_url": "http://x"}, "not a redis://"),
        ({"key_prefix": "a b"}, "key_prefix"),
        ({"node_id": "a b"}, "node_id"),
        ({"heartbeat_s": 0}, "allowed range"),
    ],
)
def test_cluster_settings_are_checked(table, message):
    with pytest.raises(ConfigError, match=message):
        settings_from_mapping({"cluster": table}, env={})


CONSOLE = {"console_token": "tok"}


async def _console_login(url: str, name: str, agent_id: str):
    ws = await websockets.connect(url + "/console")
    await ws.send(json.dumps({"type": "login", "token": "tok", "agent": name, "agent_id": agent_id}))
    return ws, await recv_json(ws)


async def _until(ws, pred) -> list[dict]:
    out = []
    while True:
        ev = await recv_json(ws)
        out.append(ev)
        if pred(ev):
            return out


async def test_console_agent_on_b_sees_takes_over_and_writes_to_a_customer_on_a(smol, tmp_path):
    ids = smol.tokenizer.encode(" one two three", add_special_tokens=False)
    with redis_server(tmp_path) as redis:
        async with (
            scripted_node(smol, redis.url, "a", security=CONSOLE) as (_, url_a, engine_a, _),
            scripted_node(smol, redis.url, "b", security=CONSOLE) as (_, url_b, _, _),
        ):
            engine_a.script, engine_a.delay = ids, 0.01
            async with websockets.connect(url_a) as cust:
                ready = await hello(cust, client="Dana")
                sid, token = ready["session_id"], ready["resume_token"]
                assert (await chat(cust, "c0", "hello there"))[-1]["type"] == "done"
                await stored_conversation(redis.url, sid, messages=2)
                # an agent on B logs in: the snapshot (from Redis) has the customer on A
                agent, snap = await _console_login(url_b, "Bob", "bob")
                assert snap["type"] == "console_ready", snap
                convs = {c["session_id"]: c for c in snap["conversations"]}
                assert sid in convs and convs[sid]["customer"] == "Dana" and convs[sid]["connected"]
                assert "messages" not in convs[sid] and convs[sid]["seq"] == 2
                # its messages, asked for on B: from the record A wrote in Redis
                await agent.send(json.dumps({"type": "open", "session_id": sid}))
                page = (await _until(agent, lambda e: e["type"] == "messages"))[-1]
                assert [m["role"] for m in page["messages"]] == ["user", "bot"]
                # live: the customer's next message, the tokens, the reply and the mood reach B
                await cust.send(json.dumps({"type": "chat", "id": "c1", "text": "this is great"}))
                seen = await _until(agent, lambda e: e["type"] == "message" and e["message"]["role"] == "bot")
                assert any(e["type"] == "message" and e["message"]["text"] == "this is great" for e in seen)
                assert "".join(e["text"] for e in seen if e["type"] == "token") == " one two three"
                if not any(e["type"] == "tag" for e in seen):
                    seen += await _until(agent, lambda e: e["type"] == "tag")
                tag = [e for e in seen if e["type"] == "tag"][-1]
                assert tag["session_id"] == sid and tag["mood"]["n"] >= 1, tag
                await _until(cust, lambda e: e.get("id") == "c1" and e["type"] == "done")
                # two agents race to take over (Bob on B, Carol on A): exactly one wins
                carol, _ = await _console_login(url_a, "Carol", "carol")
                await asyncio.gather(
                    agent.send(json.dumps({"type": "take_over", "session_id": sid})),
                    carol.send(json.dumps({"type": "take_over", "session_id": sid})),
                )
                outcomes = []
                for ws, name in ((agent, "Bob"), (carol, "Carol")):
                    # (the loser may see the winner's take-over before its own error)
                    evs = await _until(
                        ws,
                        lambda e, name=name: (
                            (e["type"] == "error" and e["code"] == "already_taken")
                            or (
                                e["type"] == "conversation"
                                and (e["conversation"]["agent"] or {}).get("name") == name
                            )
                        ),
                    )
                    outcomes.append(evs[-1])
                winners = [o for o in outcomes if o["type"] == "conversation"]
                losers = [o for o in outcomes if o["type"] == "error"]
                assert len(losers) == 1 and len(winners) == 1, outcomes
                winner_name = losers[0]["agent"]["name"]
                winner_ws = agent if winner_name == "Bob" else carol
                handover = await _until(cust, lambda e: e["type"] == "handover")
                assert handover[-1] == {"type": "handover", "to": "agent", "agent": winner_name}
                # the agent writes; the customer on A receives it
                await winner_ws.send(
                    json.dumps({"type": "agent_message", "session_id": sid, "text": "Hi, I'm here"})
                )
                got = await _until(cust, lambda e: e["type"] == "agent_message")
                assert got[-1]["text"] == "Hi, I'm here" and got[-1]["agent"] == winner_name
                # the customer's message now goes to the agent, not the bot
                await cust.send(json.dumps({"type": "chat", "id": "c2", "text": "thanks"}))
                assert (await _until(cust, lambda e: e.get("id") == "c2"))[-1]["type"] == "forwarded"
                fwd = await _until(
                    winner_ws, lambda e: e["type"] == "message" and e["message"]["role"] == "user"
                )
                assert fwd[-1]["message"]["text"] == "thanks" and fwd[-1]["message"]["to_agent"]
                await winner_ws.send(json.dumps({"type": "hand_back", "session_id": sid}))
                back = await _until(cust, lambda e: e["type"] == "handover")
                assert back[-1]["to"] == "bot"
                await agent.close()
                await carol.close()
            # the agent's message and the forwarded one are in the stored session, on any node
            async with websockets.connect(url_b) as cust:
                ready = await hello(cust, session_id=sid, resume_token=token)
                contents = [m["content"] for m in ready["history"]]
                assert "Hi, I'm here" in contents and "thanks" in contents, ready["history"]


async def test_an_agent_on_b_gets_drafts_of_a_conversation_on_a_streamed(smol, tmp_path):
    """Assist across nodes: a customer chats on A; an agent on B asks reply drafts with `stream`. B
    reads the conversation from its record in Redis and runs the task on its own engine: the prompt
    holds the customer's words, the streamed pieces spell each draft, and A's engine does none of it."""
    reply = smol.tokenizer.encode(" Sure, I will check.", add_special_tokens=False)
    draft = smol.tokenizer.encode(" Your parcel is on its way.", add_special_tokens=False)
    with redis_server(tmp_path) as redis:
        async with (
            scripted_node(smol, redis.url, "a", security=CONSOLE) as (_, url_a, engine_a, _),
            scripted_node(smol, redis.url, "b", security=CONSOLE) as (_, url_b, engine_b, _),
        ):
            engine_a.script, engine_b.script = reply, draft
            async with websockets.connect(url_a) as cust:
                sid = (await hello(cust, client="Dana"))["session_id"]
                assert (await chat(cust, "c0", "My order AB-1234 is late"))[-1]["type"] == "done"
                await stored_conversation(redis.url, sid, messages=2)
                prompts_on_a = len(engine_a.prompts)
                agent, _ = await _console_login(url_b, "Bob", "bob")
                frame = {"type": "assist", "id": "d", "session_id": sid, "task": "suggest_reply"}
                await agent.send(json.dumps({**frame, "stream": True}))
                got = await _until(agent, lambda e: e.get("id") == "d" and e["type"] in ("assist", "error"))
                answer = got[-1]
                assert answer["type"] == "assist", answer
                assert answer["output"] == {"samples": [{"text": "Your parcel is on its way."}]}
                spelled: dict[int, str] = {}
                for e in got:
                    if e["type"] == "assist_delta":
                        spelled[e["sample"]] = spelled.get(e["sample"], "") + e["text"]
                assert spelled == {i: " Your parcel is on its way." for i in range(3)}, spelled
                prompt = smol.tokenizer.decode(engine_b.prompts[-1])
                assert "Customer: My order AB-1234 is late" in prompt and "Bot: Sure, I will check." in prompt
                assert len(engine_a.prompts) == prompts_on_a
                await agent.close()


async def test_resume_on_another_node_closes_the_old_connection(smol, tmp_path):
    with redis_server(tmp_path) as redis:
        async with (
            scripted_node(smol, redis.url, "a") as (_, url_a, _, _),
            scripted_node(smol, redis.url, "b") as (base_b, url_b, _, _),
        ):
            async with websockets.connect(url_a) as old:
                ready = await hello(old)
                assert (await chat(old, "c", "hi"))[-1]["type"] == "done"  # stored from its first turn
                async with websockets.connect(url_b) as new:
                    again = await hello(
                        new, session_id=ready["session_id"], resume_token=ready["resume_token"]
                    )
                    assert again["resumed"] is True
                    err = await recv_json(old)
                    assert err["type"] == "error" and err["code"] == "session_taken_over", err
                    with pytest.raises(websockets.ConnectionClosed) as info:
                        await asyncio.wait_for(old.recv(), 30)
                    assert info.value.rcvd.code == 4409
                    assert (await chat(new, "c0", "still here"))[-1]["type"] == "done"


async def test_a_malformed_command_on_the_bus_is_dropped_and_the_next_one_applied(smol, tmp_path, caplog):
    """A node's command channel is read from Redis: what is not a command is logged and dropped, and
    the subscription goes on to apply the next one (here: the session resumed elsewhere)."""
    caplog.set_level(logging.WARNING, "rtserver.cluster")
    with redis_server(tmp_path) as redis:
        async with scripted_node(smol, redis.url, "a") as (_, url, _, app):
            async with websockets.connect(url) as cust:
                sid = (await hello(cust))["session_id"]
                bus = app.state.hub.console.bus
                channel = bus.node_channel("a")
                bad = [
                    [1],
                    {"cmd": "take_over", "session_id": sid},
                    {"cmd": "agent_message", "session_id": sid, "agent": {"id": "x", "name": "X"}, "text": 5},
                    {"cmd": "session_taken", "session_id": 7},
                ]
                for data in [*bad, {"cmd": "session_taken", "session_id": sid}]:
                    await bus.cluster.redis.publish(channel, json.dumps(data))
                err = await recv_json(cust)
                assert err["type"] == "error" and err["code"] == "session_taken_over", err
                with pytest.raises(websockets.ConnectionClosed) as info:
                    await asyncio.wait_for(cust.recv(), 30)
                assert info.value.rcvd.code == 4409
    dropped = [r for r in caplog.records if "malformed command" in r.getMessage()]
    assert len(dropped) == len(bad), caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_an_unreadable_record_in_redis_is_an_expired_session_not_a_crash(smol, tmp_path):
    import redis.asyncio as aioredis

    with redis_server(tmp_path) as redis:
        async with scripted_node(smol, redis.url, "a") as (_, url_a, _, _):
            async with websockets.connect(url_a) as ws:
                ready = await hello(ws)
                assert (await chat(ws, "c", "hi"))[-1]["type"] == "done"  # stored from its first turn
            client = aioredis.Redis.from_url(redis.url)
            try:
                for bad in (b"not json", b'{"v": 1, "id": 5}', b'{"v": 1, "history": "x"}', b"[]"):
                    await client.set(f"rtserver:session:{ready['session_id']}", bad)
                    async with websockets.connect(url_a) as ws:
                        err = await hello(
                            ws, session_id=ready["session_id"], resume_token=ready["resume_token"]
                        )
                        assert err["code"] == "session_expired", (bad, err)
                        assert (await recv_json(ws))["type"] == "ready"
            finally:
                await client.aclose()


async def test_agent_gone_from_b_hands_back_a_customer_on_a_after_the_grace(smol, tmp_path):
    sections = {"security": CONSOLE, "sessions": {"console_takeover_grace_s": 0.5}}
    with redis_server(tmp_path) as redis:
        async with (
            scripted_node(smol, redis.url, "a", **sections) as (_, url_a, _, _),
            scripted_node(smol, redis.url, "b", **sections) as (_, url_b, _, _),
        ):
            async with websockets.connect(url_a) as cust:
                sid = (await hello(cust, client="Dana"))["session_id"]
                # a conversation reaches the console (and Redis) with its first message
                assert (await chat(cust, "c0", "hello there"))[-1]["type"] == "done"
                await stored_conversation(redis.url, sid, messages=2)
                agent, _ = await _console_login(url_b, "Bob", "bob")
                await agent.send(json.dumps({"type": "take_over", "session_id": sid}))
                assert (await _until(cust, lambda e: e["type"] == "handover"))[-1]["to"] == "agent"
                await agent.close()  # Bob's console goes away and does not come back
                back = await _until(cust, lambda e: e["type"] == "handover")
                assert back[-1]["to"] == "bot", back
                # the take-over was released in Redis: another agent, on A, may take it now
                carol, _ = await _console_login(url_a, "Carol", "carol")
                await carol.send(json.dumps({"type": "take_over", "session_id": sid}))
                got = await _until(
                    carol,
                    lambda e: (
                        e["type"] == "error" or (e["type"] == "conversation" and e["conversation"]["agent"])
                    ),
                )
                assert (
                    got[-1]["type"] == "conversation" and got[-1]["conversation"]["agent"]["name"] == "Carol"
                )
                await carol.close()


async def test_console_resyncs_its_agents_after_redis_comes_back(smol, tmp_path):
    with redis_server(tmp_path) as redis:
        async with (
            scripted_node(smol, redis.url, "a", security=CONSOLE) as (base_a, url_a, _, _),
            scripted_node(smol, redis.url, "b", security=CONSOLE) as (base_b, url_b, _, _),
        ):
            agent, _ = await _console_login(url_b, "Bob", "bob")
            redis.stop()
            await wait_for(lambda: _not_ready(base_b))
            await agent.send(json.dumps({"type": "take_over", "session_id": "any"}))
            err = await _until(agent, lambda e: e["type"] == "error")
            assert err[-1]["code"] == "unavailable", err
            redis.start()
            await wait_for(lambda: _ready(base_a))
            # events may have been missed meanwhile: the agent gets a fresh snapshot
            snap = await _until(agent, lambda e: e["type"] == "console_ready")
            assert snap[-1]["agent"]["name"] == "Bob"
            # and live events flow again from the other node
            async with websockets.connect(url_a) as cust:
                sid = (await hello(cust, client="Dana"))["session_id"]
                await chat(cust, "c0", "hello")  # listed to agents from its first message
                ev = await _until(
                    agent, lambda e: e["type"] == "conversation" and e["conversation"]["session_id"] == sid
                )
                assert ev[-1]["conversation"]["customer"] == "Dana"
            await agent.close()


async def test_a_stale_copy_cannot_overwrite_a_newer_record(tmp_path):
    """Two nodes holding the same session: the write of the one whose copy is stale is refused
    (`session_taken_over`), so what the other stored and acknowledged stays."""
    from rtserver.config import Settings
    from rtserver.web.cluster import Cluster
    from rtserver.web.cluster.store import SessionConflict, SessionRecord, SessionStore

    with redis_server(tmp_path) as redis:
        settings = Settings()
        settings.cluster.redis_url = redis.url
        cluster = Cluster(settings)
        try:
            assert await cluster.check()
            store = SessionStore(cluster, 60)
            base = {"id": "s1", "token_sha256": "x" * 64}
            await store.save(SessionRecord(**base, version=1, history=[]))
            newer = [{"role": "user", "content": "on B"}, {"role": "assistant", "content": "ok"}]
            await store.save(SessionRecord(**base, version=2, history=newer))  # node B
            with pytest.raises(SessionConflict) as info:  # node A, still at version 1
                await store.save(SessionRecord(**base, version=2, history=[]))
            assert info.value.code == "session_taken_over"
            stored = await store.load("s1")
            assert stored is not None and stored.version == 2 and stored.history == newer
        finally:
            await cluster.stop()


async def test_failed_console_logins_are_counted_across_nodes(smol, tmp_path):
    sec = {"console_token": "tok", "console_login_failures_per_min": 3}
    with redis_server(tmp_path) as redis:
        async with (
            scripted_node(smol, redis.url, "a", security=sec) as (_, url_a, _, _),
            scripted_node(smol, redis.url, "b", security=sec) as (_, url_b, _, _),
        ):
            for url, token in ((url_a, "x"), (url_b, "y"), (url_a, "z")):
                ws = await websockets.connect(url + "/console")
                await ws.send(json.dumps({"type": "login", "token": token}))
                err = await recv_json(ws)
                assert err["type"] == "error" and err["code"] == "unauthorized", (url, err)
                with pytest.raises(websockets.ConnectionClosed) as info:
                    await asyncio.wait_for(ws.recv(), 30)
                assert info.value.rcvd.code == 4401
            # three failures from this address, two of them on A: B waits before it checks the right
            # token (counted in Redis), and then lets it in: someone else's guesses never lock it out
            async with websockets.connect(url_b + "/console") as ws:
                start = time.monotonic()
                await ws.send(json.dumps({"type": "login", "token": "tok"}))
                ready = await recv_json(ws)
                assert ready["type"] == "console_ready", ready
                assert time.monotonic() - start >= 0.9


class ReplyDropper:
    """A TCP proxy in front of Redis that can swallow the next replies: the command runs in Redis, the
    client never hears back (as when a reply times out)."""

    def __init__(self, redis_url: str):
        self.target = redis_url.split("//")[1].split("/")[0].rsplit(":", 1)
        self.drop = 0
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def __aenter__(self) -> ReplyDropper:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.target[0], int(self.target[1]))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, replies: bool) -> None:
            try:
                while data := await src.read(65536):
                    if replies and self.drop > 0:
                        self.drop -= 1
                        continue
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))


async def test_a_save_whose_reply_was_lost_is_not_a_conflict(tmp_path):
    """A write that landed but whose reply timed out: its retry (redis-py retries once) and the
    session's later writes succeed; the version moves on, nothing is refused as another node's."""
    from rtserver.config import Settings
    from rtserver.web.cluster import Cluster, ClusterUnavailable
    from rtserver.web.cluster.limits import ClusterLimits
    from rtserver.web.cluster.sessions import ClusterSessions
    from rtserver.web.cluster.store import SessionStore
    from rtserver.web.session import SessionRegistry

    with redis_server(tmp_path) as redis:
        async with ReplyDropper(redis.url) as proxy:
            settings = Settings()
            settings.cluster.redis_url = proxy.url
            settings.cluster.op_timeout_s = 0.3
            cluster = Cluster(settings)
            try:
                assert await cluster.check()
                store = SessionStore(cluster, 60)
                sessions = ClusterSessions(
                    cluster, store, ClusterLimits(cluster, 0, 1, 0), SessionRegistry(60, 10)
                )
                session = await sessions.create("127.0.0.1", "c")
                assert session.version == 0  # nothing in it: not stored
                session.history.append({"role": "user", "content": "zero"})
                await sessions.save(session, "c")  # the script is loaded now
                assert session.version == 1
                # the reply of the first try is lost, the retry's arrives
                session.history.append({"role": "user", "content": "one"})
                proxy.drop = 1
                await sessions.save(session, "c")
                assert session.version == 2
                # both tries' replies lost: reported as failed, though the write landed
                session.history.append({"role": "user", "content": "two"})
                proxy.drop = 2
                with pytest.raises(ClusterUnavailable):
                    await sessions.save(session, "c")
                assert session.version == 2
                assert await cluster.check()
                stored = await store.load(session.id)
                assert stored is not None and stored.version == 3  # it did land
                # the session's next write replaces its own unacknowledged one
                session.history[-1] = {"role": "user", "content": "three"}
                await sessions.save(session, "c")
                await sessions.save(session, "c")
                stored = await store.load(session.id)
                assert stored is not None and stored.version == session.version == 4
                assert [m["content"] for m in stored.history] == ["zero", "one", "three"]
            finally:
                await cluster.stop()


async def test_a_take_over_ends_when_the_agents_node_dies(smol, tmp_path):
    """The holder's node goes (its agent never hands back, the grace never runs out there): the key it
    renewed expires, the customer's node hands the conversation back and tells its consoles."""
    import redis.asyncio as aioredis

    with redis_server(tmp_path) as redis:
        async with scripted_node(smol, redis.url, "a", security=CONSOLE) as (_, url_a, _, _):
            async with websockets.connect(url_a) as cust:
                sid = (await hello(cust, client="Dana"))["session_id"]
                assert (await chat(cust, "c0", "hello there"))[-1]["type"] == "done"
                watcher, _ = await _console_login(url_a, "Wendy", "")
                async with scripted_node(smol, redis.url, "b", security=CONSOLE) as (_, url_b, _, app_b):
                    await stored_conversation(redis.url, sid, messages=2)
                    agent, _ = await _console_login(url_b, "Bob", "")
                    await agent.send(json.dumps({"type": "take_over", "session_id": sid}))
                    got = await _until(cust, lambda e: e["type"] == "handover")
                    assert got[-1] == {"type": "handover", "to": "agent", "agent": "Bob"}
                    await _until(
                        watcher,
                        lambda e: e["type"] == "conversation" and e["conversation"]["agent"] is not None,
                    )
                    # the take-over's key runs down (Redis's clock): B's heartbeat renews it while B lives
                    bus = app_b.state.rt.topology.bus
                    client = aioredis.Redis.from_url(redis.url)
                    try:
                        await client.pexpire(bus.holder_key(sid), bus.hold_ttl_ms // 2)
                        await heartbeat(app_b)
                        assert await client.pttl(bus.holder_key(sid)) > bus.hold_ttl_ms // 2
                    finally:
                        await client.aclose()
                    await agent.send(json.dumps({"type": "ping"}))  # still held while B lives
                    assert (await _until(agent, lambda e: e["type"] == "pong"))[-1]["type"] == "pong"
                # B is gone; Bob's take-over ends within a few heartbeats
                back = await _until(cust, lambda e: e["type"] == "handover")
                assert back[-1] == {"type": "handover", "to": "bot", "agent": None}, back
                seen = await _until(
                    watcher, lambda e: e["type"] == "conversation" and e["conversation"]["agent"] is None
                )
                assert seen[-1]["conversation"]["session_id"] == sid
                assert (await chat(cust, "c1", "anyone?"))[-1]["type"] == "done"  # the bot answers
                await watcher.close()


MARK = "test:mark"


async def _hash_writes(client, key: str, counts: list[str], marks: list[str]) -> None:
    """Collect the keyspace events of `key` (hset, hdel, ...) into `counts`, and what is published on
    MARK into `marks`: one subscription delivers in order, so a mark comes after every earlier event."""
    async with client.pubsub() as pubsub:
        await pubsub.subscribe(f"__keyspace@0__:{key}", MARK)
        while True:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if msg is not None:
                (marks if msg["channel"] == MARK else counts).append(msg["data"])


async def _after_heartbeats(client, app, marks: list[str]) -> None:
    """Two heartbeats of the node, then every keyspace event up to now collected."""
    for _ in range(2):
        await heartbeat(app)
    seen = len(marks)
    await client.publish(MARK, "mark")
    await wait_for(lambda: _true(len(marks) > seen))


async def test_a_turn_writes_the_console_record_once_and_a_cancelled_one_not_at_all(smol, tmp_path):
    import redis.asyncio as aioredis

    with redis_server(tmp_path) as redis:
        async with scripted_node(smol, redis.url, "a", security=CONSOLE) as (_, url_a, engine, app):
            client = aioredis.Redis.from_url(redis.url, decode_responses=True)
            await client.config_set("notify-keyspace-events", "Kh")
            events: list[str] = []
            marks: list[str] = []
            listener = asyncio.create_task(_hash_writes(client, "rtserver:console:convs", events, marks))
            try:
                async with websockets.connect(url_a) as cust:
                    sid = (await hello(cust))["session_id"]  # an empty conversation: not stored
                    got = await chat(cust, "c0", "I am happy today")
                    assert got[-1]["type"] == "done"
                    if not any(e.get("auto") for e in got):
                        await _until(cust, lambda e: bool(e.get("auto")))  # the sentiment tag
                    await wait_for(lambda: _true(len(events) >= 1))  # the turn's write
                    await _after_heartbeats(client, app, marks)
                    assert events == ["hset"], events  # the turn, once, with its tag
                    record = json.loads(await client.hget("rtserver:console:convs", sid))
                    assert [m["role"] for m in record["messages"]] == ["user", "bot"]
                    assert record["messages"][0]["sentiment"], record["messages"][0]
                    # the session record does not carry a second copy of the conversation
                    session = json.loads(await client.get(f"rtserver:session:{sid}"))
                    assert session.get("console") is None, session
                    engine.gate = asyncio.Event()
                    await cust.send(json.dumps({"type": "chat", "id": "c1", "text": "never mind"}))
                    await cust.send(json.dumps({"type": "cancel", "id": "c1"}))
                    await wait_for(lambda: _true(bool(engine.cancelled)))
                    engine.gate.set()
                    await _until(cust, lambda e: e.get("id") == "c1" and e["type"] == "done")
                    await _after_heartbeats(client, app, marks)
                    assert events == ["hset"], events  # nothing stored changed
            finally:
                listener.cancel()
                await client.aclose()


async def _true(value: bool) -> bool:
    return value


async def test_conversations_of_a_dead_node_expire_from_redis(smol, tmp_path):
    import redis.asyncio as aioredis

    sections = {"security": CONSOLE, "sessions": {"idle_timeout_s": 1.5}}
    with redis_server(tmp_path) as redis:
        client = aioredis.Redis.from_url(redis.url, decode_responses=True)
        try:
            async with scripted_node(smol, redis.url, "b", **sections) as (_, url_b, _, app_b):
                watcher, _ = await _console_login(url_b, "Wendy", "")
                async with scripted_node(smol, redis.url, "a", **sections) as (_, url_a, _, app_a):
                    async with websockets.connect(url_a) as cust:
                        sid = (await hello(cust, client="Dana"))["session_id"]
                        # listed for agents from its first message
                        assert (await chat(cust, "c0", "hello there"))[-1]["type"] == "done"
                        await _until(
                            watcher,
                            lambda e: e["type"] == "conversation" and e["conversation"]["session_id"] == sid,
                        )
                        # its deadline comes near (Redis's clock): a node that lives renews its
                        # conversations, and the other's sweep leaves it
                        expiry = "rtserver:console:convs:expiry"
                        now = (await client.time())[0]
                        await client.zadd(expiry, {sid: now + 1}, xx=True)
                        await heartbeat(app_a)
                        assert await client.zscore(expiry, sid) >= now + 2
                        await heartbeat(app_b)
                        assert await client.hexists("rtserver:console:convs", sid)
                # A is gone and left its conversation: B's heartbeat removes it when it expires
                gone = await _until(watcher, lambda e: e["type"] == "removed" and e["session_id"] == sid)
                assert gone[-1]["session_id"] == sid
                assert not await client.hexists("rtserver:console:convs", sid)
                assert await client.ttl("rtserver:console:convs") in (-2, *range(1, 62))  # bounded too
                await watcher.close()
        finally:
            await client.aclose()


async def test_an_agent_id_is_the_servers_and_its_rejoin_token_works_on_any_node(smol, tmp_path):
    with redis_server(tmp_path) as redis:
        async with (
            scripted_node(smol, redis.url, "a", security=CONSOLE) as (_, url_a, _, _),
            scripted_node(smol, redis.url, "b", security=CONSOLE) as (_, url_b, _, _),
        ):
            first, snap = await _console_login(url_a, "Bob", "bob")
            assert snap["agent"]["id"] != "bob" and snap["rejoin"], snap
            await first.close()
            again = await websockets.connect(url_b + "/console")
            await again.send(json.dumps({"type": "login", "token": "tok", "rejoin": snap["rejoin"]}))
            back = await recv_json(again)
            assert back["agent"]["id"] == snap["agent"]["id"], back
            await again.close()
            forged = await websockets.connect(url_b + "/console")
            token = snap["rejoin"].split(".")[0] + ".00"
            await forged.send(json.dumps({"type": "login", "token": "tok", "rejoin": token}))
            assert (await recv_json(forged))["agent"]["id"] != snap["agent"]["id"]
            await forged.close()
