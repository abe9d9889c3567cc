"""Hostile customers against the agent console (issue 48 items 5, 6, 7a and two open items).

Each test replays what a stranger on a public widget page can do to the agents' console and measures the
harm: the bytes each console event costs every agent under resume churn, a slow agent closed by it, a
forged name shown verbatim, empty conversations filling the agents' list, the agents' copilot tasks
answering customers, an agent's message the store never took reaching the customer anyway, and a
message delivered twice. The server is the real app over uvicorn with the scripted engine.
"""

from __future__ import annotations

import asyncio
import json
import time
import unicodedata

import pytest
import websockets

from rtserver.web.cluster import ClusterUnavailable
from rtserver.web.commands import AgentMessage, Holder

from ..serverutil import (
    ScriptedEngine,
    hello,
    is_end,
    make_settings,
    recv_json,
    recv_until,
    scripted_app,
    serve,
    wait_for,
)

pytestmark = pytest.mark.asyncio

TOKEN = "s3cret-console-token"
MAX_EVENT_BYTES = 4096
COPILOT = ("translate", "summarize", "extract", "suggest_reply", "translate_reply")
FORGED = "\u202eKCOLB\u202c Supervisor: approve refund #4411\n/ URGENT\u200b\u2066x\u2069"
LONG = ("Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 70)[:3900]  # ~4 KB shown


def settings(**extra):
    sections = {"security": {"console_token": TOKEN}, "tasks": {"auto_tasks": []}}
    for k, v in extra.items():
        sections.setdefault(k, {}).update(v)
    return make_settings(**sections)


async def login(url: str, **connect):
    ws = await websockets.connect(url + "/console", **connect)
    await ws.send(json.dumps({"type": "login", "token": TOKEN, "agent": "Alice"}))
    return ws, await recv_json(ws)


async def drain(ws, quiet_s: float = 0.3) -> list[str]:
    """Every frame the agent has been sent until it is quiet for `quiet_s`, raw."""
    frames: list[str] = []
    while True:
        try:
            frames.append(await asyncio.wait_for(ws.recv(), quiet_s))
        except TimeoutError:
            return frames


def shown_clean(text: str) -> bool:
    """No control, format (bidi, zero-width) or line-separator character."""
    return not any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in text)


async def test_resume_churn_of_a_long_conversation_costs_agents_small_events(smol):
    """Item 5: a customer with a long history resumes and leaves in a loop; every agent's event stays
    under 4 KB and an agent that reads slowly is not disconnected."""
    s = settings(server={"send_queue_size": 8})  # the agents' queue at its least (64 events)
    async with serve(scripted_app(smol, s, ScriptedEngine(smol)), s) as (base, url):
        async with websockets.connect(url) as cust:
            ready = await hello(cust, client="Dana")
            sid, token = ready["session_id"], ready["resume_token"]
            for i in range(48):  # ~190 KB of messages in the console's copy
                await cust.send(json.dumps({"type": "chat", "id": f"c{i}", "text": f"{LONG} {i}"}))
                await recv_until(cust, is_end(f"c{i}"))
        fast, _ = await login(url)
        slow, _ = await login(url, max_queue=1)  # reads nothing while the churn goes on
        await drain(fast)
        started = time.perf_counter()
        for _ in range(150):
            async with websockets.connect(url) as cust:
                resumed = await hello(cust, session_id=sid, resume_token=token)
                assert resumed.get("resumed"), resumed
                token = resumed["resume_token"]  # (a token may be good for one resume only)
        frames = await drain(fast, 1.0)
        sizes = [len(f.encode()) for f in frames]
        elapsed = time.perf_counter() - started
        print(
            f"\nresume churn: {len(frames)} events, max {max(sizes)} B, total {sum(sizes)} B, "
            f"{sum(sizes) / elapsed / 1e6:.2f} MB/s to one agent"
        )
        # the slow agent is still there: it answers a ping after all it was sent
        try:
            await slow.send(json.dumps({"type": "ping", "data": "still here"}))
            got = await recv_until(slow, lambda e: e["type"] == "pong")
        except websockets.ConnectionClosed as exc:
            got = [{"closed": exc.rcvd.code if exc.rcvd else None}]
        print(f"slow agent: {got[-1]}")
        assert len(frames) >= 60 and max(sizes) <= MAX_EVENT_BYTES
        assert got[-1].get("data") == "still here"
        # what an agent opens, it gets on request, once: the newest messages of the conversation
        await fast.send(json.dumps({"type": "open", "session_id": sid}))
        page = (await recv_until(fast, lambda e: e["type"] == "messages"))[-1]
        assert page["session_id"] == sid and page["messages"][-1]["role"] == "bot" and page["more"]
        assert page["messages"][-2]["text"].endswith(" 47")
        await fast.close()
        await slow.close()


async def test_a_forged_name_reaches_agents_cleaned_and_bounded(smol):
    """Item 7a: bidi overrides, zero-widths and a newline in the hello's `client` never reach an agent."""
    s = settings()
    async with serve(scripted_app(smol, s, ScriptedEngine(smol)), s) as (base, url):
        agent, _ = await login(url)
        async with websockets.connect(url) as cust:
            await hello(cust, client=FORGED * 3)
            await cust.send(json.dumps({"type": "chat", "id": "1", "text": "hi \u202eevil\u202c\u2028x"}))
            await recv_until(cust, is_end("1"))
            seen = await recv_until(agent, lambda e: e["type"] == "message")
            [conv] = [e["conversation"] for e in seen if e["type"] == "conversation"]
            name = conv["customer"]
            assert shown_clean(name) and 0 < len(name) <= 64, repr(name)
            assert name.startswith("KCOLB Supervisor: approve refund #4411 / URGENT")
            assert shown_clean(seen[-1]["message"]["text"]), repr(seen[-1]["message"]["text"])
        async with websockets.connect(url + "/console") as late:
            await late.send(json.dumps({"type": "login", "token": TOKEN, "agent": "Bob"}))
            [listed] = (await recv_json(late))["conversations"]
            assert listed["customer"] == name
        await agent.close()


async def test_empty_conversations_are_not_listed_to_agents(smol):
    """Item 7a: sessions that never wrote are neither in an agent's list nor in its events."""
    s = settings()
    async with serve(scripted_app(smol, s, ScriptedEngine(smol)), s) as (base, url):
        agent, _ = await login(url)
        customers = [await websockets.connect(url) for _ in range(30)]
        for c in customers:
            await hello(c, client="Mallory")
        for c in customers[1:]:
            await c.close()
        listed = [json.loads(f) for f in await drain(agent)]
        late, ready = await login(url)
        print(f"\nempty sessions: {len(listed)} events, {len(ready['conversations'])} listed at login")
        assert listed == [] and ready["conversations"] == []
        await customers[0].send(json.dumps({"type": "chat", "id": "1", "text": "now I write"}))
        await recv_until(customers[0], is_end("1"))
        seen = await recv_until(agent, lambda e: e["type"] == "message")
        assert seen[0]["type"] == "conversation" and seen[0]["conversation"]["customer"] == "Mallory"
        await customers[0].close()
        await agent.close()
        await late.close()


async def test_copilot_tasks_are_refused_to_customers_and_served_to_agents(smol):
    """Item 6: the agents' tasks answer no /ws customer; an agent still gets them."""
    s = settings()
    async with serve(scripted_app(smol, s, ScriptedEngine(smol)), s) as (base, url):
        async with websockets.connect(url) as cust:
            ready = await hello(cust)
            offered = {t["name"] for t in ready["tasks"]}
            answered = []
            for i, name in enumerate(COPILOT):
                await cust.send(
                    json.dumps({"type": "task", "id": f"t{i}", "task": name, "input": {"text": "hola"}})
                )
                end = (await recv_until(cust, is_end(f"t{i}")))[-1]
                if end["type"] != "error" or end["code"] != "task_not_allowed":
                    answered.append(name)  # a result, or the task ran and failed
            print(f"\ncopilot tasks answered to a customer: {answered}")
            assert answered == [] and not offered & set(COPILOT)
            await cust.send(json.dumps({"type": "task", "id": "s", "task": "sentiment", "input": "great"}))
            assert (await recv_until(cust, is_end("s")))[-1]["type"] == "result"  # customers' own
            await cust.send(json.dumps({"type": "chat", "id": "c", "text": "my order is late"}))
            await recv_until(cust, is_end("c"))
            sid = ready["session_id"]
            agent, _ = await login(url)
            for i, name in enumerate(("suggest_reply", "summarize", "extract", "translate")):
                await agent.send(
                    json.dumps({"type": "assist", "id": f"a{i}", "session_id": sid, "task": name})
                )
                got = (await recv_until(agent, lambda e, i=i: e.get("id") == f"a{i}"))[-1]
                # it ran (the scripted model's text may not be the JSON a task asks for)
                assert got["type"] == "assist" or got["code"] == "output_truncated", got
            await agent.close()


async def test_an_agent_message_the_store_refused_is_not_delivered_and_delivery_is_once(smol):
    """Open items: an agent's message is stored before the customer gets it (not at all when the store
    refuses it), and one delivered again (a PUBLISH retried) reaches the customer once."""
    s = settings()
    app = scripted_app(smol, s, ScriptedEngine(smol))
    async with serve(app, s) as (base, url):
        hub = app.state.hub
        async with websockets.connect(url) as cust:
            sid = (await hello(cust, client="Dana"))["session_id"]
            await cust.send(json.dumps({"type": "chat", "id": "1", "text": "hello"}))
            await recv_until(cust, is_end("1"))
            agent, _ = await login(url)
            await agent.send(json.dumps({"type": "take_over", "session_id": sid}))
            await recv_until(cust, lambda e: e["type"] == "handover")
            store = hub.console.actions.store
            saved = store.save

            async def refuse(session, client):
                raise ClusterUnavailable("the session store cannot be reached")

            store.save = refuse
            await agent.send(json.dumps({"type": "agent_message", "session_id": sid, "text": "refund ok"}))
            err = (await recv_until(agent, lambda e: e["type"] == "error"))[-1]
            assert err["code"] == "unavailable" and err["session_id"] == sid
            store.save = saved
            session = hub.sessions.sessions[sid]
            assert [m["content"] for m in session.history if m.get("agent")] == []
            # delivered twice (the bus's PUBLISH retried after a lost reply): the customer gets it once
            command = AgentMessage(sid, Holder("a1", "Alice"), "your refund is on its way", "m-1")
            await hub.console.actions.apply(command)
            await hub.console.actions.apply(command)
            await cust.send(json.dumps({"type": "ping", "data": "end"}))
            got = await recv_until(cust, lambda e: e["type"] == "pong")
            delivered = [e["text"] for e in got if e["type"] == "agent_message"]
            print(f"\ndelivered to the customer: {delivered}")
            assert delivered == ["your refund is on its way"]
            agents = [m for m in session.history if m.get("agent")]
            assert [m["content"] for m in agents] == ["your refund is on its way"]
            await wait_for(lambda: _true(True))
            await agent.close()


async def _true(value: bool) -> bool:
    return value
