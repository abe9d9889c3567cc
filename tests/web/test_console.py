"""/ws/console (the agent console's hub) over a real uvicorn server with the scripted engine."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import websockets

from rtserver.web.console.login import LOGIN_WINDOW_S, MAX_LOGIN_DELAY_S, LoginFailures, digest, login_delay

from ..fakeclock import FakeClock, FakeTimer
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


def console_url(url: str) -> str:
    return url + "/console"


async def login(
    url: str, name: str = "Alice", agent_id: str | None = None, token: str = TOKEN, rejoin: str | None = None
):
    ws = await websockets.connect(console_url(url))
    msg = {"type": "login", "token": token, "agent": name}
    if agent_id:
        msg["agent_id"] = agent_id  # ignored by the server: it assigns agent ids
    if rejoin:
        msg["rejoin"] = rejoin
    await ws.send(json.dumps(msg))
    return ws, await recv_json(ws)


def fake_timer(app) -> FakeTimer:
    """The console's login deadline and take-over grace, on a clock the test moves."""
    timer = FakeTimer()
    console = app.state.hub.console
    console.door.timer = console.actions.timer = timer
    return timer


async def grace_started(timer: FakeTimer, grace_s: float) -> None:
    """The server saw the agent's console go: its take-over's grace has begun."""
    await wait_for(lambda: _true(timer.pending(grace_s) == 1))


async def customer_turn(cust, client: str, text: str) -> str:
    """A customer's hello and first chat turn, waited to its end; the session id."""
    sid = (await hello(cust, client=client))["session_id"]
    await cust.send(json.dumps({"type": "chat", "id": "1", "text": text}))
    await recv_until(cust, is_end("1"))
    return sid


def settings_with(**extra):
    sections = {"security": {"console_token": TOKEN}}
    for k, v in extra.items():
        sections.setdefault(k, {}).update(v)
    return make_settings(**sections)


async def test_console_disabled_without_token_and_wrong_token_refused(smol):
    settings = make_settings(tasks={"auto_tasks": []})
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        async with websockets.connect(console_url(url)) as ws:
            err = await recv_json(ws)
            assert err["type"] == "error" and err["code"] == "console_disabled"
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 30)
            assert info.value.rcvd.code == 4403
    settings = settings_with(tasks={"auto_tasks": []})
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        ws, err = await login(url, token="wrong")
        assert err["code"] == "unauthorized"
        with pytest.raises(websockets.ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), 30)
        assert info.value.rcvd.code == 4401
        async with websockets.connect(console_url(url)) as ws:  # anything before login: refused
            await ws.send(json.dumps({"type": "take_over", "session_id": "x"}))
            assert (await recv_json(ws))["code"] == "unauthorized"


async def test_live_events_then_snapshot_for_late_agent(smol):
    settings = settings_with()
    ids = smol.tokenizer.encode(" one two three", add_special_tokens=False)
    engine = ScriptedEngine(smol, script=ids, delay=0.01)
    async with serve(scripted_app(smol, settings, engine), settings) as (base, url):
        a, ready_a = await login(url, "Alice")
        assert ready_a["type"] == "console_ready" and ready_a["conversations"] == []
        assert ready_a["protocol"] == "1.1" and ready_a["agent"]["name"] == "Alice"
        async with websockets.connect(url) as cust:
            ready = await hello(cust, client="Dana <b>")
            sid = ready["session_id"]
            # listed to agents from its first message on
            await cust.send(json.dumps({"type": "chat", "id": "c1", "text": "I am very happy!"}))
            ev = await recv_until(a, lambda e: e["type"] == "conversation")
            assert len(ev) == 1
            conv = ev[-1]["conversation"]
            assert conv["session_id"] == sid and conv["customer"] == "Dana <b>" and conv["connected"]
            assert conv["mood"]["label"] == "unknown" and conv["seq"] == 1
            done = (await recv_until(cust, is_end("c1")))[-1]
            assert done["type"] == "done"
            # the agent sees: the customer message, the streamed tokens, the bot's reply, the sentiment tag
            seen = await recv_until(a, lambda e: e["type"] == "message" and e["message"]["role"] == "bot")
            user = [e for e in seen if e["type"] == "message" and e["message"]["role"] == "user"]
            assert (
                user and user[0]["message"]["text"] == "I am very happy!" and user[0]["message"]["id"] == "c1"
            )
            streamed = "".join(e["text"] for e in seen if e["type"] == "token" and e["session_id"] == sid)
            assert streamed == done["text"] == seen[-1]["message"]["text"]
            tags = [e for e in seen if e["type"] == "tag"]
            if not tags:
                tags = await recv_until(a, lambda e: e["type"] == "tag")
            tag = tags[-1]
            assert tag["seq"] == user[0]["message"]["seq"] and tag["task"] == "sentiment"
            assert tag["label"] in ("positive", "negative") and tag["mood"]["n"] == 1
            # a late agent gets the conversation's summary, and its messages when it opens it
            b, ready_b = await login(url, "Bob")
            [snap] = ready_b["conversations"]
            assert "messages" not in snap and snap["seq"] == 2
            assert snap["mood"]["label"] in ("positive", "negative")
            assert snap["last_message"]["role"] == "bot"
            await b.send(json.dumps({"type": "open", "session_id": sid}))
            opened = await recv_json(b)
            assert opened["type"] == "messages" and opened["streaming"] is None and not opened["more"]
            roles = [m["role"] for m in opened["messages"]]
            assert roles == ["user", "bot"] and opened["messages"][0]["sentiment"] == tag["label"]
            await b.close()
        ev = await recv_until(a, lambda e: e["type"] == "conversation")
        assert ev[-1]["conversation"]["connected"] is False
        await a.close()


async def test_take_over_reply_hand_back(smol):
    settings = settings_with(tasks={"auto_tasks": []})
    engine = ScriptedEngine(smol)
    async with serve(scripted_app(smol, settings, engine), settings) as (base, url):
        a, _ = await login(url, "Alice", agent_id="agent-a")
        b, _ = await login(url, "Bob", agent_id="agent-b")
        async with websockets.connect(url) as cust:
            ready = await hello(cust, client="Eve")
            sid = ready["session_id"]
            assert ready["history"] == [] and ready["agent"] is None
            await cust.send(json.dumps({"type": "chat", "id": "1", "text": "hello bot"}))
            assert (await recv_until(cust, is_end("1")))[-1]["type"] == "done"
            # Alice takes over; Bob cannot
            await a.send(json.dumps({"type": "take_over", "session_id": sid}))
            handover = await recv_json(cust)
            assert handover == {"type": "handover", "to": "agent", "agent": "Alice"}
            conv = (
                await recv_until(b, lambda e: e["type"] == "conversation" and e["conversation"]["agent"])
            )[-1]
            assert conv["conversation"]["agent"]["name"] == "Alice"
            await b.send(json.dumps({"type": "take_over", "session_id": sid}))
            err = (await recv_until(b, lambda e: e["type"] == "error"))[-1]
            assert err["code"] == "already_taken" and err["agent"]["name"] == "Alice"
            await b.send(json.dumps({"type": "agent_message", "session_id": sid, "text": "sneaky"}))
            assert (await recv_until(b, lambda e: e["type"] == "error"))[-1]["code"] == "not_taken_over"
            # the customer's message goes to the agent, not the bot
            prompts = len(engine.prompts)
            await cust.send(json.dumps({"type": "chat", "id": "2", "text": "I want a human"}))
            fwd = (await recv_until(cust, is_end("2")))[-1]
            assert fwd == {"type": "forwarded", "id": "2", "agent": "Alice"}
            assert len(engine.prompts) == prompts
            msg = (
                await recv_until(
                    a,
                    lambda e: (
                        e["type"] == "message"
                        and e["message"]["role"] == "user"
                        and e["message"]["id"] == "2"
                    ),
                )
            )[-1]
            assert msg["message"]["to_agent"] is True
            # the agent's reply reaches the customer as its own event type
            await a.send(
                json.dumps({"type": "agent_message", "session_id": sid, "text": "Hi, Alice here <i>"})
            )
            got = await recv_json(cust)
            assert got == {"type": "agent_message", "text": "Hi, Alice here <i>", "agent": "Alice"}
        # resume while taken over: history (with the agent's message) and the agent's name in ready
        async with websockets.connect(url) as cust:
            again = await hello(cust, session_id=sid, resume_token=ready["resume_token"])
            assert again["resumed"] and again["agent"] == "Alice"
            assert [m["role"] for m in again["history"]] == ["user", "assistant", "user", "assistant"]
            assert again["history"][-1] == {
                "role": "assistant",
                "content": "Hi, Alice here <i>",
                "agent": "Alice",
            }
            # Bob cannot hand back; Alice can, and the bot answers again, knowing what the agent said
            await b.send(json.dumps({"type": "hand_back", "session_id": sid}))
            assert (await recv_until(b, lambda e: e["type"] == "error"))[-1]["code"] == "not_taken_over"
            await a.send(json.dumps({"type": "hand_back", "session_id": sid}))
            assert (await recv_json(cust)) == {"type": "handover", "to": "bot", "agent": None}
            await cust.send(json.dumps({"type": "chat", "id": "3", "text": "thanks"}))
            assert (await recv_until(cust, is_end("3")))[-1]["type"] == "done"
            assert "Hi, Alice here" in smol.tokenizer.decode(engine.prompts[-1])
        await a.close()
        await b.close()


async def test_agent_reconnect_keeps_take_over_and_grace_hands_back(smol):
    settings = settings_with(tasks={"auto_tasks": []}, sessions={"console_takeover_grace_s": 0.5})
    app = scripted_app(smol, settings, ScriptedEngine(smol))
    timer = fake_timer(app)
    async with serve(app, settings) as (base, url):
        async with websockets.connect(url) as cust:
            sid = await customer_turn(cust, "Dana", "hello")  # listed to agents from its first message
            a, first = await login(url, "Alice")
            await a.send(json.dumps({"type": "take_over", "session_id": sid}))
            assert (await recv_json(cust))["to"] == "agent"
            await a.close()
            await grace_started(timer, 0.5)
            # back within the grace period: the snapshot says the conversation is still hers
            a, snap = await login(url, "Alice", rejoin=first["rejoin"])
            assert snap["conversations"][0]["agent"]["id"] == first["agent"]["id"]
            timer.advance(1.0)  # past the grace her login cancelled
            await a.send(json.dumps({"type": "agent_message", "session_id": sid, "text": "still here"}))
            assert (await recv_json(cust))["type"] == "agent_message"
            await a.close()
            # gone for good: handed back to the bot after the grace period
            await grace_started(timer, 0.5)
            timer.advance(0.5)
            got = await recv_json(cust)
            assert got == {"type": "handover", "to": "bot", "agent": None}
            await cust.send(json.dumps({"type": "chat", "id": "x", "text": "anyone?"}))
            assert (await recv_until(cust, is_end("x")))[-1]["type"] == "done"


async def test_unknown_session_and_bad_frames(smol):
    settings = settings_with(tasks={"auto_tasks": []})
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        a, _ = await login(url)
        await a.send(json.dumps({"type": "take_over", "session_id": "nope"}))
        assert (await recv_json(a))["code"] == "unknown_session"
        await a.send("not json")
        assert (await recv_json(a))["code"] == "bad_json"
        await a.send(json.dumps({"type": "dance"}))
        assert (await recv_json(a))["code"] == "unknown_type"
        await a.send(json.dumps({"type": "ping", "data": 7}))
        assert (await recv_json(a)) == {"type": "pong", "data": 7}
        await a.close()


async def test_console_refuses_a_foreign_origin(smol):
    # the widget's pages (security.allowed_origins) are not the console's: it takes its own page only
    settings = settings_with(tasks={"auto_tasks": []}, security={"allowed_origins": ["https://evil.example"]})
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        async with websockets.connect(console_url(url), origin="https://evil.example") as ws:
            err = await recv_json(ws)
            assert err["code"] == "forbidden_origin" and "evil.example" in err["message"]
            assert "security.console_origins" in err["message"]
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 30)
            assert info.value.rcvd.code == 1008
        async with websockets.connect(console_url(url), origin=base) as ws:  # its own page
            await ws.send(json.dumps({"type": "login", "token": TOKEN}))
            assert (await recv_json(ws))["type"] == "console_ready"


async def _closed_with(ws) -> int:
    with pytest.raises(websockets.ConnectionClosed) as info:
        while True:
            await asyncio.wait_for(ws.recv(), 10)
    assert info.value.rcvd is not None
    return info.value.rcvd.code


async def test_a_console_socket_that_does_not_log_in_is_closed_at_the_deadline(smol):
    settings = settings_with(tasks={"auto_tasks": []}, security={"console_login_timeout_s": 0.5})
    app = scripted_app(smol, settings, ScriptedEngine(smol))
    timer = fake_timer(app)
    async with serve(app, settings) as (base, url):
        async with websockets.connect(console_url(url)) as ws:
            await ws.send(json.dumps({"type": "ping", "data": 1}))  # pings are no login
            assert (await recv_json(ws)) == {"type": "pong", "data": 1}
            timer.advance(0.4)  # before the deadline the socket is open
            await ws.send(json.dumps({"type": "ping", "data": 1}))
            assert (await recv_json(ws)) == {"type": "pong", "data": 1}
            timer.advance(0.1)
            err = await asyncio.wait_for(recv_json(ws), 10)
            assert err["type"] == "error" and err["code"] == "login_timeout", err
            assert await _closed_with(ws) == 4408
        # an agent that logged in in time stays past the deadline
        a, ready = await login(url)
        assert ready["type"] == "console_ready"
        timer.advance(0.8)
        await a.send(json.dumps({"type": "ping", "data": 2}))
        assert (await recv_json(a)) == {"type": "pong", "data": 2}
        await a.close()


async def test_wrong_console_tokens_are_counted_once_each_and_slow_their_address():
    clock = FakeClock()
    failures = LoginFailures(3, clock=clock)
    assert [login_delay(n, 3) for n in (0, 2, 3, 4, 5, 40)] == [0.0, 0.0, 1.0, 2.0, 4.0, MAX_LOGIN_DELAY_S]
    assert login_delay(100, 0) == 0.0  # no limit: no delay
    assert failures.failed("10.0.0.1", digest("a")) and not failures.failed("10.0.0.1", digest("a"))
    assert failures.failed("10.0.0.1", digest("b")) and failures.delay("10.0.0.1") == 0.0
    assert failures.failed("10.0.0.1", digest("c")) and failures.delay("10.0.0.1") == 1.0
    assert failures.delay("10.0.0.2") == 0.0  # per address
    clock.advance(LOGIN_WINDOW_S + 1)  # the window from the first failure is over
    assert failures.delay("10.0.0.1") == 0.0 and failures.failed("10.0.0.1", digest("a"))


async def test_an_address_past_its_wrong_logins_waits_but_the_right_token_gets_in(smol):
    settings = settings_with(tasks={"auto_tasks": []}, security={"console_login_failures_per_min": 3})
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        ok, ready = await login(url)  # a right token counts nothing
        assert ready["type"] == "console_ready"
        await ok.close()
        for guess in ("a", "b", 7):
            ws, err = await login(url, token=guess)  # type: ignore[arg-type]
            assert err["code"] == "unauthorized", err
            assert await _closed_with(ws) == 4401
        # over the limit: each login waits before its token is checked, the right one gets in
        started = asyncio.get_running_loop().time()
        ws, ready = await login(url)
        assert ready["type"] == "console_ready" and asyncio.get_running_loop().time() - started >= 1.0
        await ws.close()


async def test_the_server_assigns_agent_ids_and_a_rejoin_token_gives_one_back(smol):
    settings = settings_with(tasks={"auto_tasks": []})
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        a, ready_a = await login(url, "Alice", agent_id="agent-b")
        b, ready_b = await login(url, "Bob\x00\u202e" + "x" * 500, agent_id="agent-b")
        ids = {ready_a["agent"]["id"], ready_b["agent"]["id"]}
        assert len(ids) == 2 and "agent-b" not in ids, (ready_a, ready_b)
        assert ready_b["agent"]["name"] == "Bob" + "x" * 57  # cleaned, bounded
        async with websockets.connect(url) as cust:
            sid = (await hello(cust))["session_id"]
            await b.send(json.dumps({"type": "take_over", "session_id": sid}))
            assert (await recv_json(cust))["to"] == "agent"
            # Alice cannot pose as Bob: not by his id, nor by a rejoin token she made up
            forged = f"{ready_b['agent']['id']}.{'0' * 64}"
            for extra in ({"agent_id": ready_b["agent"]["id"]}, {"rejoin": forged}):
                ws = await websockets.connect(console_url(url))
                await ws.send(json.dumps({"type": "login", "token": TOKEN, "agent": "Alice", **extra}))
                snap = await recv_json(ws)
                assert snap["agent"]["id"] != ready_b["agent"]["id"], snap
                await ws.send(json.dumps({"type": "agent_message", "session_id": sid, "text": "hi"}))
                err = await recv_until(ws, lambda e: e["type"] == "error")
                assert err[-1]["code"] == "not_taken_over", err
                await ws.close()
            # Bob's own rejoin token gives him his id and his take-over back
            await b.close()
            b = await websockets.connect(console_url(url))
            await b.send(json.dumps({"type": "login", "token": TOKEN, "rejoin": ready_b["rejoin"]}))
            snap = await recv_json(b)
            assert snap["agent"]["id"] == ready_b["agent"]["id"], snap
            await b.send(json.dumps({"type": "agent_message", "session_id": sid, "text": "back"}))
            got = await recv_json(cust)
            assert got["type"] == "agent_message" and got["text"] == "back", got
        await a.close()
        await b.close()


async def test_a_message_forwarded_to_the_agent_survives_the_cancel_of_the_bot_turn_before_it(smol):
    settings = settings_with(tasks={"auto_tasks": []})
    engine = ScriptedEngine(smol)
    async with serve(scripted_app(smol, settings, engine), settings) as (base, url):
        a, _ = await login(url, "Alice")
        async with websockets.connect(url) as cust:
            ready = await hello(cust)
            sid = ready["session_id"]
            engine.gate = asyncio.Event()  # the bot's turn waits
            await cust.send(json.dumps({"type": "chat", "id": "1", "text": "bot, are you there?"}))
            await recv_until(a, lambda e: e["type"] == "message" and e["message"]["id"] == "1")
            await a.send(json.dumps({"type": "take_over", "session_id": sid}))
            assert (await recv_json(cust))["to"] == "agent"
            await cust.send(json.dumps({"type": "chat", "id": "2", "text": "I want a human"}))
            assert (await recv_until(cust, is_end("2")))[-1]["type"] == "forwarded"
            await cust.send(json.dumps({"type": "cancel", "id": "1"}))
            await wait_for(lambda: _true(bool(engine.cancelled)))
            engine.gate.set()
            end = (await recv_until(cust, is_end("1")))[-1]
            assert end["type"] == "done" and end["finish_reason"] == "cancelled", end
        async with websockets.connect(url) as cust:
            again = await hello(cust, session_id=sid, resume_token=ready["resume_token"])
            # the acknowledged message is kept; the cancelled turn's own message is gone
            assert [m["content"] for m in again["history"]] == ["I want a human"], again["history"]
        await a.close()


async def _true(value: bool) -> bool:
    return value


async def test_chats_cancelled_at_once_leave_nothing_in_the_console_store(smol):
    settings = settings_with(tasks={"auto_tasks": []})
    engine = ScriptedEngine(smol)
    async with serve(scripted_app(smol, settings, engine), settings) as (base, url):
        a, _ = await login(url, "Alice")
        async with websockets.connect(url) as cust:
            await hello(cust)
            await cust.send(json.dumps({"type": "chat", "id": "ok", "text": "a real question"}))
            assert (await recv_until(cust, is_end("ok")))[-1]["type"] == "done"
            engine.gate = asyncio.Event()
            for i in range(5):
                await cust.send(json.dumps({"type": "chat", "id": f"x{i}", "text": "x" * 3000}))
                await cust.send(json.dumps({"type": "cancel", "id": f"x{i}"}))
                await wait_for(lambda i=i: _true(len(engine.cancelled) == i + 1))
                engine.gate.set()
                assert (await recv_until(cust, is_end(f"x{i}")))[-1]["finish_reason"] == "cancelled"
                engine.gate.clear()
                # the live agent is told which message the cancelled turn took back
                seen = await recv_until(a, lambda e, i=i: e["type"] == "stream_end" and e["id"] == f"x{i}")
                added = [e["message"]["seq"] for e in seen if e["type"] == "message"]
                assert seen[-1]["dropped"] == added[-1], seen
            b, snap = await login(url, "Bob")
            [conv] = snap["conversations"]
            await b.send(json.dumps({"type": "open", "session_id": conv["session_id"]}))
            messages = (await recv_json(b))["messages"]
            assert [m["text"] for m in messages] == ["a real question", "Hello"], messages
            await b.close()
        await a.close()


async def test_assist_calls_answer_the_agent_who_asked_with_valid_json(smol):
    """`assist` on the embedded model: drafts and fields of a live conversation, as JSON valid under
    the tasks' schemas, to the asking agent only; bad frames get their codes."""
    import jsonschema

    from rtserver.web.app import create_app

    settings = settings_with(tasks={"auto_tasks": []})
    settings.chat.max_new_tokens = 8
    app = create_app(settings, lambda: smol)
    async with serve(app, settings) as (base, url):
        a, _ = await login(url, "Alice")
        b, _ = await login(url, "Bob")
        async with websockets.connect(url) as cust:
            sid = await customer_turn(cust, "Eve", "My order AB-1234 is late!")
            await recv_until(a, lambda e: e["type"] == "message" and e["message"]["role"] == "bot")

            async def ask(ws, **frame) -> dict:
                await ws.send(json.dumps({"type": "assist", "session_id": sid, **frame}))
                return (await recv_until(ws, lambda e: e["type"] in ("assist", "error")))[-1]

            assert (await ask(a, id="x" * 65, task="extract"))["code"] == "invalid_field"
            err = await ask(a, id="t", task="translate_reply", text="We will send it today.")
            assert err["code"] == "unknown_task" and "'language' task" in err["message"], err
            err = await ask(a, id="1", task="sentiment")
            assert err["code"] == "unknown_task" and "suggest_reply" in err["message"] and err["id"] == "1"
            err = await ask(a, id="2", task="extract", session_id="nope")
            assert err["code"] == "unknown_session" and err["id"] == "2"
            registry = app.state.rt.tasks
            drafts = await ask(a, id="d", task="suggest_reply")
            assert drafts["type"] == "assist" and drafts["session_id"] == sid, drafts
            assert 1 <= len(drafts["output"]["samples"]) <= 3
            assert all(isinstance(d["text"], str) for d in drafts["output"]["samples"])
            out = await ask(a, id="e", task="extract")
            assert out["type"] == "assist" and out["task"] == "extract", out
            jsonschema.validate(out["output"], registry.get("extract").task.output.schema)
            assert set(out["output"]) == {"order_number", "email", "product"}
            # Bob asked nothing and got nothing: results go to the asking agent alone
            await b.send(json.dumps({"type": "ping", "data": 1}))
            assert not [
                e for e in await recv_until(b, lambda e: e["type"] == "pong") if e["type"] == "assist"
            ]
        await a.close()
        await b.close()


async def test_streamed_drafts_come_first_spell_the_answer_and_end_with_the_console(smol):
    """`assist` with `stream`: the drafts' text arrives in `assist_delta` frames before the answer, and
    per draft they spell exactly the raw text the answer carries. A console that closes mid-draft
    cancels its drafts' generations. The drafts run to their token limit here (no EOS, no stop
    string), so only the cancel can end them early."""
    from rtserver.engine.backend import FinishReason, Priority
    from rtserver.engine.core import Engine
    from rtserver.web.app import create_app

    settings = settings_with(tasks={"auto_tasks": []})
    settings.chat.max_new_tokens = 8
    engine = Engine(smol, settings.engine)
    drafts: list = []
    generate = engine.generate

    def generate_to_the_limit(prompt_ids, params, **kwargs):
        if params.priority is Priority.ASSIST:
            params = dataclasses.replace(params, ignore_eos=True, stop=[])
        stream = generate(prompt_ids, params, **kwargs)
        if params.priority is Priority.ASSIST:
            drafts.append(stream)
        return stream

    engine.generate = generate_to_the_limit
    app = create_app(settings, lambda: smol, engine_factory=lambda loaded, s: engine)
    async with serve(app, settings) as (base, url):
        a, _ = await login(url, "Alice")
        b, _ = await login(url, "Bob")
        async with websockets.connect(url) as cust:
            sid = await customer_turn(cust, "Eve", "Where is my parcel?")
            frame = {"type": "assist", "session_id": sid, "task": "suggest_reply"}
            await a.send(json.dumps({**frame, "id": "bad", "stream": "yes"}))
            err = (await recv_until(a, lambda e: e["type"] == "error"))[-1]
            assert err["code"] == "invalid_field" and "'stream'" in err["message"], err

            await a.send(json.dumps({**frame, "id": "d1", "stream": True}))
            got = await recv_until(a, lambda e: e["type"] in ("assist", "error") and e.get("id") == "d1")
            answer = got[-1]
            assert answer["type"] == "assist", answer
            deltas = [e for e in got if e["type"] == "assist_delta"]
            assert {(e["id"], e["session_id"], e["task"]) for e in deltas} == {("d1", sid, "suggest_reply")}
            spelled: dict[int, str] = {}
            for e in deltas:
                spelled[e["sample"]] = spelled.get(e["sample"], "") + e["text"]
            assert sorted(spelled) == [0, 1, 2]
            assert "\n".join(spelled[i] for i in range(3)) == answer["text"]
            assert len(deltas) > 3  # gathered, not one frame a draft: the text came in pieces
            results = [await d.result() for d in drafts]
            assert all(r.finish_reason is FinishReason.LENGTH for r in results)
            # the conversation lives here: the lead draft's prompt is the chat's own, its KV the session's
            lead = results[0].usage
            assert lead.cached_tokens >= lead.prompt_tokens - 8, lead

            before = len(drafts)
            await a.send(json.dumps({**frame, "id": "d2", "stream": True}))
            await recv_until(a, lambda e: e["type"] == "assist_delta" and e["id"] == "d2")
            await a.close()
            await wait_for(lambda: _true(len(drafts) == before + 3))
            results = [await asyncio.wait_for(d.result(), 30) for d in drafts[before:]]
            assert all(r.finish_reason is FinishReason.CANCELLED for r in results), results
            assert all(r.usage.generated_tokens < 64 for r in results)
            # Bob asked nothing: no deltas reached him
            await b.send(json.dumps({"type": "ping", "data": 1}))
            seen = await recv_until(b, lambda e: e["type"] == "pong")
            assert not [e for e in seen if e["type"].startswith("assist")]
        await b.close()


async def test_an_agents_reply_is_translated_to_the_language_of_the_customers_message(smol):
    """`translate_reply`: the language task names the customer's language from their last message,
    and the reply is translated to it; the prompt names that language on the input's first line.
    A missing reply is refused by name."""
    from pathlib import Path

    from rtserver.web.app import create_app

    root = Path(__file__).resolve().parents[2]
    settings = settings_with(
        tasks={
            "auto_tasks": [],
            "learned_heads": False,
            "plugin_dirs": [str(root / "plugins"), str(root / "examples" / "plugins")],
        }
    )
    settings.chat.max_new_tokens = 8
    settings.task = {"translate_reply": {"max_new_tokens": 24}}
    app = create_app(settings, lambda: smol)
    prompts: list[list[int]] = []
    async with serve(app, settings) as (base, url):
        engine = app.state.rt.backend
        generate = engine.generate

        def recording(prompt_ids, params, **kwargs):
            prompts.append(list(prompt_ids))
            return generate(prompt_ids, params, **kwargs)

        engine.generate = recording
        a, _ = await login(url, "Alice")
        async with websockets.connect(url) as cust:
            sid = await customer_turn(
                cust, "Jean", "Bonjour, ma commande n'est pas arrivée et je suis très inquiet."
            )
            frame = {"type": "assist", "session_id": sid, "task": "translate_reply"}
            await a.send(json.dumps({**frame, "id": "none"}))
            err = (await recv_until(a, lambda e: e.get("id") == "none"))[-1]
            assert err["code"] == "invalid_field" and "the reply to translate" in err["message"], err
            await a.send(json.dumps({**frame, "id": "r", "text": "We will send your order today."}))
            answer = (await recv_until(a, lambda e: e.get("id") == "r"))[-1]
            assert answer["type"] == "assist", answer
            assert answer["output"]["language"] == "french" and answer["output"]["text"].strip()
            said = smol.tokenizer.decode(prompts[-1])
            assert "\nFrench\nWe will send your order today." in said, said
        await a.close()
