"""Hand-off to people (rtserver/web/handoff.py, console/queue.py): the policy's rules on their own, then
the queue over a real server: the customer asking, the bot's "I don't know", places in the queue, the
e-mail form out of hours and hostile e-mails. The mood on the real model and the pages: test_handoff_pages.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest
import websockets
from jsonschema import Draft202012Validator
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from rtserver.config import ConfigError, HandoffSettings, settings_from_mapping
from rtserver.web import session_events as se
from rtserver.web.handoff import BusinessHours, HandoffPolicy, TurnSignals, Waiting, check_email
from rtserver.web.schema import protocol_schema

from ..clusterutil import redis_server, scripted_node
from ..serverutil import ScriptedEngine, hello, is_end, metric, recv_json, recv_until, scripted_app, serve
from .test_console import TOKEN, login, settings_with

WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


def policy(**fields: object) -> HandoffPolicy:
    return HandoffPolicy(HandoffSettings(**{"enabled": True, **fields}))  # type: ignore[arg-type]


# -- the policy ------------------------------------------------------------------------------------


def test_each_signal_names_its_reason_and_none_fires_when_off():
    p = policy(intents=["complaint"])
    assert p.reason(TurnSignals(text="Can I talk to a HUMAN please?")).code == "asked"
    assert p.reason(TurnSignals(text="I want to  speak   to someone now")).code == "asked"
    assert p.reason(TurnSignals(text="That is humane of you")) is None  # whole words only
    assert p.reason(TurnSignals(intent="complaint")).code == "intent"
    assert p.reason(TurnSignals(intent="billing")) is None
    assert p.reason(TurnSignals(bot_unknown=True)).code == "unknown"
    assert policy(bot_unknown=False).reason(TurnSignals(bot_unknown=True)) is None
    mood = p.reason(TurnSignals(moods=(-1.0, -1.0)))
    assert mood is not None and mood.code == "mood" and "-1.00 over 2" in mood.text
    # the customer asking comes first
    assert p.reason(TurnSignals(text="a real person!", moods=(-1.0, -1.0), bot_unknown=True)).code == "asked"
    off = HandoffPolicy(HandoffSettings(intents=["complaint"]))
    for signals in (TurnSignals(text="human"), TurnSignals(moods=(-1.0,) * 3), TurnSignals(bot_unknown=True)):
        assert off.reason(signals) is None


def test_mood_is_the_mean_of_the_newest_rated_messages():
    p = policy(mood_window=3, mood_min_messages=2, mood_at_most=-0.5)
    assert p.reason(TurnSignals(moods=(-1.0,))) is None  # one rated message is not enough
    assert p.reason(TurnSignals(moods=(-1.0, 0.0))).code == "mood"  # mean -0.5
    assert p.reason(TurnSignals(moods=(-1.0, 1.0, -1.0))) is None  # mean -1/3
    assert p.reason(TurnSignals(moods=(-1.0, -1.0, -1.0, 1.0, 1.0))).code == "mood"  # only the newest 3
    assert p.reason(TurnSignals(moods=(1.0, -1.0, -1.0, -1.0))) is None  # the newest is happy again
    assert policy(mood_min_messages=1).reason(TurnSignals(moods=(-1.0,))).code == "mood"


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def test_business_hours_are_read_in_their_own_time_zone():
    # Tokyo, weekdays 09:00-17:00: a Sunday evening in UTC is Monday morning there
    tokyo = BusinessHours("Asia/Tokyo", WEEKDAYS[:5], "09:00", "17:00")
    assert not tokyo.open_at(at("2026-12-06T23:30"))  # Mon 08:30 JST
    assert tokyo.open_at(at("2026-12-07T00:30"))  # Mon 09:30 JST (still Sunday in UTC)
    assert not tokyo.open_at(at("2026-12-07T08:00"))  # Mon 17:00 JST: closed from 17:00 on
    assert tokyo.open_at(at("2026-12-04T07:59"))  # Fri 16:59 JST
    assert not tokyo.open_at(at("2026-12-05T01:00"))  # Sat 10:00 JST
    # New York across its daylight-saving change: the same UTC hour is 08:30 in winter, 09:30 in summer
    ny = BusinessHours("America/New_York", WEEKDAYS[:5], "09:00", "17:00")
    assert not ny.open_at(at("2026-03-06T13:30"))  # Fri 08:30 EST
    assert ny.open_at(at("2026-03-09T13:30"))  # Mon 09:30 EDT
    # until midnight, and any aware datetime
    late = BusinessHours("Europe/Paris", ["sun"], "20:00", "24:00")
    assert late.open_at(at("2026-12-06T22:59"))  # Sun 23:59 CET
    assert not late.open_at(at("2026-12-06T23:00"))  # Mon 00:00 CET
    assert late.open_at(datetime.fromisoformat("2026-12-06T20:00+01:00"))


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"timezone": "Mars/Olympus"}, "not an IANA time zone"),
        ({"days": ["monday"]}, "unknown"),
        ({"opens": "9:00"}, "HH:MM"),
        ({"closes": "25:00"}, "HH:MM"),
        ({"opens": "18:00", "closes": "09:00"}, "must come before"),
        ({"ask_phrases": [" "]}, "1..100 characters"),
    ],
)
def test_handoff_settings_are_checked(table, message):
    with pytest.raises(ConfigError, match=message):
        settings_from_mapping({"handoff": table}, env={})


HOSTILE_EMAILS = [
    "a" * 250 + "@example.com",  # over 254 characters
    "<script>alert(1)</script>@example.com",
    'x"><img src=x onerror=alert(1)>@example.com',
    "jo\x00e@example.com",
    "joe@exa\nmple.com",
    "joe@example.com\r\nBcc: all@example.com",
    "jo\u202ee@example.com",  # a bidi override
    "jöe@example.com",
    "joe",
    "@example.com",
    "joe@-example.com",
    "",
]


def test_check_email_takes_what_an_email_field_takes():
    assert check_email("  joe.bloggs+shop@mail.example.co.uk ") == "joe.bloggs+shop@mail.example.co.uk"
    for bad in HOSTILE_EMAILS:
        with pytest.raises(ValueError, match="e-mail address like name@example.com"):
            check_email(bad)


def test_a_stored_wait_is_checked_before_it_is_shown():
    good = Waiting("mood", "upset", 1.5, True, "joe@example.com")
    assert Waiting.from_json(json.loads(json.dumps(good.to_json()))) == good
    text = "x\u202e" + "y" * 500
    forged = {"reason": "mood", "text": text, "since": 1, "email": "<b>@x", "out_of_hours": 1}
    read = Waiting.from_json(forged)
    assert read is not None and read.email is None and read.out_of_hours is False
    assert "\u202e" not in read.text and len(read.text) <= 200
    bribe, mistyped = {"reason": "bribe", "text": "", "since": 1}, {"reason": "mood", "text": 5, "since": 1}
    for bad in (bribe, mistyped, "x", None):
        assert Waiting.from_json(bad) is None


# -- the queue over a real server (the scripted engine: the bot's replies are not the point) -------


def handoff_settings(**handoff: object):
    return settings_with(tasks={"auto_tasks": []}, handoff={"enabled": True, **handoff})


def event_validator() -> Draft202012Validator:
    schema = protocol_schema()
    registry = Registry().with_resource(schema["$id"], DRAFT202012.create_resource(schema))
    return Draft202012Validator({"$ref": schema["$id"] + "#/$defs/ServerEvent"}, registry=registry)


async def until_type(ws, kind: str) -> dict:
    return (await recv_until(ws, lambda e: e["type"] == kind))[-1]


async def waiting_summary(agent, sid: str) -> dict:
    """The agent's next summary of `sid` that shows it waiting for a person."""
    events = await recv_until(
        agent,
        lambda e: (
            e["type"] == "conversation"
            and e["conversation"]["session_id"] == sid
            and e["conversation"]["handoff"] is not None
        ),
    )
    return events[-1]["conversation"]


async def test_asking_for_a_person_queues_the_conversation_and_the_bot_stops(smol):
    settings = handoff_settings()
    engine = ScriptedEngine(smol)
    validate = event_validator().validate
    async with serve(scripted_app(smol, settings, engine), settings) as (base, url):
        agent, _ = await login(url, "Sam")
        async with websockets.connect(url) as first, websockets.connect(url) as second:
            sid = (await hello(first, client="Dana"))["session_id"]
            await first.send(json.dumps({"type": "chat", "id": "1", "text": "hello"}))
            assert (await recv_until(first, is_end("1")))[-1]["type"] == "done"
            prompts = len(engine.prompts)
            asked = time.time()
            await first.send(json.dumps({"type": "chat", "id": "2", "text": "Let me talk to a real person"}))
            summary = await waiting_summary(agent, sid)
            seen = time.time() - asked
            assert seen < 1.0, f"the agent saw the waiting conversation {seen:.3f} s after the message"
            assert summary["handoff"]["reason"] == "asked" and summary["handoff"]["email"] is None
            assert summary["handoff"]["text"] == "The customer asked for a person."
            got = await recv_until(first, lambda e: e["type"] == "queue_position")
            assert [e["type"] for e in got] == ["forwarded", "handoff", "queue_position"], got
            assert got[0]["id"] == "2" and got[0]["agent"] is None
            assert got[1]["state"] == "waiting" and got[1]["out_of_hours"] is False
            assert got[2]["position"] == 1 and got[2]["agents_online"] == 1
            for event in got:
                validate(event)
            # the bot stays silent: the next message goes to the console too
            await first.send(json.dumps({"type": "chat", "id": "3", "text": "hello?"}))
            assert (await recv_json(first))["type"] == "forwarded"
            assert len(engine.prompts) == prompts

            # a second customer waits behind the first
            sid2 = (await hello(second, client="Eve"))["session_id"]
            await second.send(json.dumps({"type": "chat", "id": "1", "text": "I need a human"}))
            assert (await until_type(second, "queue_position"))["position"] == 2
            assert (await waiting_summary(agent, sid2))["handoff"]["reason"] == "asked"

            # the agent takes the first: it waits no more, the second moves up
            await agent.send(json.dumps({"type": "take_over", "session_id": sid}))
            ended = await recv_until(first, lambda e: e["type"] == "handoff")
            assert ended[-1] == {"type": "handoff", "state": "ended", "out_of_hours": False, "email": None}
            if ended[0]["type"] != "handover":
                await until_type(first, "handover")
            assert (await until_type(second, "queue_position"))["position"] == 1
            note = {"type": "agent_message", "session_id": sid, "text": "Hi, Sam here."}
            await agent.send(json.dumps(note))
            reply = await until_type(first, "agent_message")
            assert reply["text"] == "Hi, Sam here." and reply["agent"] == "Sam"
            # handed back, the bot answers again and asking again is a new wait
            await agent.send(json.dumps({"type": "hand_back", "session_id": sid}))
            await until_type(first, "handover")
            await first.send(json.dumps({"type": "chat", "id": "4", "text": "thanks"}))
            assert (await recv_until(first, is_end("4")))[-1]["type"] == "done"
            await first.send(json.dumps({"type": "chat", "id": "5", "text": "an agent again, please"}))
            assert (await until_type(first, "queue_position"))["position"] == 2  # behind Eve now
            assert await metric(base, "rtserver_handoffs_total", 'reason="asked"') == 3
            # starting over leaves the queue: the bot answers the new conversation
            await first.send(json.dumps({"type": "reset"}))
            assert (await until_type(first, "handoff"))["state"] == "ended"
            await first.send(json.dumps({"type": "chat", "id": "6", "text": "hi again"}))
            assert (await recv_until(first, is_end("6")))[-1]["type"] == "done"
        await agent.close()


async def test_the_bots_i_dont_know_hands_off(smol):
    """What the turn service publishes after a stored turn (`Signalled`): the knowledge base's "I don't
    know" arrives through it."""
    settings = handoff_settings()
    app = scripted_app(smol, settings, ScriptedEngine(smol))
    async with serve(app, settings) as (base, url):
        async with websockets.connect(url) as cust:
            sid = (await hello(cust))["session_id"]
            await cust.send(json.dumps({"type": "chat", "id": "1", "text": "What is your refund policy?"}))
            await recv_until(cust, is_end("1"))
            hub = app.state.hub
            session = hub.sessions.sessions[sid]
            hub.events.publish(se.Signalled(session, "1", TurnSignals(bot_unknown=False)))
            hub.events.publish(se.Signalled(session, "1", TurnSignals(bot_unknown=True)))
            assert (await until_type(cust, "handoff"))["state"] == "waiting"
            alone = await until_type(cust, "queue_position")
            assert alone == {"type": "queue_position", "position": 1, "agents_online": 0}
            # an agent signs in: the snapshot has the wait, and the customer learns someone is there
            agent, ready = await login(url, "Sam")
            [conv] = ready["conversations"]
            assert conv["session_id"] == sid and conv["handoff"]["reason"] == "unknown"
            assert conv["handoff"]["text"] == "The bot did not know the answer."
            assert (await until_type(cust, "queue_position"))["agents_online"] == 1
            await agent.close()
            assert (await until_type(cust, "queue_position"))["agents_online"] == 0


def closed_today(timezone: str = "UTC") -> list[str]:
    """Every weekday but today's in `timezone` (the business's): the business is closed now."""
    today = WEEKDAYS[datetime.now(ZoneInfo(timezone)).weekday()]
    return [d for d in WEEKDAYS if d != today]


async def test_out_of_hours_the_customer_leaves_an_email_the_agents_see(smol):
    settings = handoff_settings(days=closed_today())
    validate = event_validator().validate
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        agent, _ = await login(url, "Sam")
        async with websockets.connect(url) as cust:
            sid = (await hello(cust))["session_id"]
            await cust.send(json.dumps({"type": "handoff_email", "email": "joe@example.com"}))
            refused = await recv_json(cust)
            assert refused["code"] == "not_waiting" and "not waiting" in refused["message"]
            await cust.send(json.dumps({"type": "chat", "id": "1", "text": "Can I speak to someone?"}))
            state = await until_type(cust, "handoff")
            assert state["out_of_hours"] is True and state["email"] is None
            await waiting_summary(agent, sid)
            # hostile e-mails: each a clear error naming the field and what it must be; nothing kept
            for bad in HOSTILE_EMAILS:
                await cust.send(json.dumps({"type": "handoff_email", "email": bad}))
                error = await until_type(cust, "error")
                validate(error)
                assert error["code"] == "invalid_field", (bad, error)
                assert error["message"] == (
                    "'email' must be an e-mail address like name@example.com (at most 254 characters)"
                )
            await cust.send(json.dumps({"type": "handoff_email", "email": 5}))
            assert (await until_type(cust, "error"))["code"] == "invalid_field"
            await cust.send(json.dumps({"type": "handoff_email", "email": "x" * 70_000}))
            huge = await until_type(cust, "error")
            assert huge["code"] == "frame_too_large" and "65536 bytes" in huge["message"]
            # a good one is kept, told back and shown to agents
            await cust.send(json.dumps({"type": "handoff_email", "email": " joe@example.com "}))
            kept = await until_type(cust, "handoff")
            validate(kept)
            assert kept == {
                "type": "handoff",
                "state": "waiting",
                "out_of_hours": True,
                "email": "joe@example.com",
            }
            summary = await recv_until(
                agent, lambda e: e["type"] == "conversation" and e["conversation"]["handoff"]["email"]
            )
            assert summary[-1]["conversation"]["handoff"]["email"] == "joe@example.com"
        # a late agent's snapshot has it too
        late, ready = await login(url, "Kim")
        [conv] = ready["conversations"]
        assert conv["handoff"]["email"] == "joe@example.com" and conv["handoff"]["out_of_hours"] is True
        await asyncio.gather(agent.close(), late.close())


async def test_the_queue_spans_nodes_and_a_wait_survives_a_resume_elsewhere(smol, tmp_path):
    """Two nodes and a real redis-server: an agent on B sees a customer on A waiting, places count both
    nodes' waits, a take-over from B ends the wait on A, and a waiting session resumed on the other node
    still waits (the bot stays silent there too)."""
    sections = {
        "security": {"console_token": TOKEN},
        "tasks": {"auto_tasks": []},
        "handoff": {"enabled": True},
    }
    with redis_server(tmp_path) as redis:
        async with (
            scripted_node(smol, redis.url, "a", **sections) as (_, url_a, engine_a, _),
            scripted_node(smol, redis.url, "b", **sections) as (_, url_b, _, _),
        ):
            agent, _ = await login(url_b, "Bob")
            async with websockets.connect(url_a) as on_a, websockets.connect(url_b) as on_b:
                sid_a = (await hello(on_a, client="Ann"))["session_id"]
                ready_b = await hello(on_b, client="Ben")
                sid_b, token_b = ready_b["session_id"], ready_b["resume_token"]
                asked = time.time()
                await on_a.send(json.dumps({"type": "chat", "id": "1", "text": "Get me a human, please"}))
                summary = await waiting_summary(agent, sid_a)
                assert time.time() - asked < 1.0 and summary["handoff"]["reason"] == "asked"
                # Bob (on B) counts as online on A once B's heartbeat said so
                place = await recv_until(on_a, lambda e: e["type"] == "queue_position" and e["agents_online"])
                assert place[-1] == {"type": "queue_position", "position": 1, "agents_online": 1}
                await on_b.send(json.dumps({"type": "chat", "id": "1", "text": "a real person now"}))
                assert (await until_type(on_b, "queue_position"))["position"] == 2
                # Bob takes Ann (served by A): her wait ends there, Ben (on B) moves up
                await agent.send(json.dumps({"type": "take_over", "session_id": sid_a}))
                ended = await recv_until(on_a, lambda e: e["type"] == "handoff")
                assert ended[-1]["state"] == "ended"
                assert (await until_type(on_b, "queue_position"))["position"] == 1
            # Ben comes back on A: still waiting, told so, and the bot on A stays silent
            prompts = len(engine_a.prompts)
            async with websockets.connect(url_a) as again:
                ready = await hello(again, session_id=sid_b, resume_token=token_b)
                assert ready["resumed"] is True
                state = await until_type(again, "handoff")
                assert state["state"] == "waiting"
                assert (await until_type(again, "queue_position"))["position"] == 1
                await again.send(json.dumps({"type": "chat", "id": "2", "text": "still there?"}))
                assert (await until_type(again, "forwarded"))["agent"] is None
                assert len(engine_a.prompts) == prompts
            await agent.close()


async def test_an_intent_label_hands_off(smol):
    """The intent auto-task's label on a customer message (a category the operator added), through the
    same tag hook as the mood. The scripted engine scores every label alike: the first one wins."""
    settings = settings_with(
        tasks={"auto_tasks": ["intent"]}, handoff={"enabled": True, "intents": ["complaint"]}
    )
    settings.task = {"intent": {"categories": {"complaint": " complaint", "other": " something else"}}}
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        agent, _ = await login(url, "Sam")
        async with websockets.connect(url) as cust:
            sid = (await hello(cust))["session_id"]
            await cust.send(json.dumps({"type": "chat", "id": "1", "text": "I wish to complain."}))
            tag = await recv_until(cust, lambda e: e["type"] == "result" and e.get("auto"))
            assert tag[-1]["output"]["label"] == "complaint"
            summary = await waiting_summary(agent, sid)
            assert summary["handoff"]["reason"] == "intent"
            assert summary["handoff"]["text"] == "The customer's intent is 'complaint'."
            assert (await until_type(cust, "handoff"))["state"] == "waiting"
        await agent.close()
