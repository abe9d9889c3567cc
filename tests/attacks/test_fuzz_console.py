"""Property-based fuzzing (hypothesis) of /ws/console, the agents' WebSocket, on one real server
(tests/fuzzutil.py): random logins (right, wrong and mistyped tokens), then arbitrary JSON, binary frames,
deep nesting, odd numbers, lone surrogates and console messages with fields of every JSON type; and a
customer session taken over by an agent while both sides send fuzzed frames.

Checked: every frame gets well-formed console events (errors with a documented code, no internals), a
wrong token gets `unauthorized` and close 4401, the connection survives everything else, the taken-over
customer gets the protocol-level errors the documentation promises, the server logs no error, and
afterwards a normal chat works.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from .. import fuzzutil
from ..fuzzutil import (
    CONSOLE_EVENTS,
    CONSOLE_TOKEN,
    REPLY,
    STATS,
    WS,
    Closed,
    _hello,
    deep_json,
    expected_error,
    fuzz,
    json_values,
    mutated_message,
    odd_numbers,
    random_message,
    send_and_check,
    surrogate_frames,
)

pytestmark = fuzzutil.RANDOM_WARNING


@pytest.fixture(scope="module")
def server(smol):
    with fuzzutil.running_fuzz_server(smol) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    yield from fuzzutil.http_client(server)


@pytest.fixture(autouse=True)
def no_server_errors(request):
    """Every test: the server logs nothing at ERROR and no exception while it runs."""
    yield from fuzzutil.no_new_server_errors(request)


# -- /ws/console ----------------------------------------------------------------------------------

console_frames = st.one_of(
    st.builds(json.dumps, json_values),
    st.binary(max_size=32),
    deep_json(),
    odd_numbers(),
    surrogate_frames,
    st.builds(
        lambda kind, sid, text: json.dumps({"type": kind, "session_id": sid, "text": text}),
        st.sampled_from(["take_over", "hand_back", "agent_message", "login", "ping", "nope"]),
        json_values,
        json_values,
    ),
)


@fuzz(100)
@given(
    login=st.fixed_dictionaries(
        {
            "type": st.just("login"),
            "token": st.one_of(st.just(CONSOLE_TOKEN), st.just(CONSOLE_TOKEN), json_values),
        },
        optional={"agent": json_values, "agent_id": json_values, "rejoin": json_values},
    ),
    batch=st.lists(console_frames, min_size=1, max_size=3),
)
def test_console_frames(server, login, batch):
    ws = WS(server.url + "/console", CONSOLE_EVENTS)
    try:
        frame = json.dumps(login)
        ws.send(frame)
        ev = ws.recv()
        if expected_error(frame) == ("bad_json", None):
            assert ev["type"] == "error" and ev["code"] == "bad_json", ev
            assert ws.sync() == []  # ping needs no login; the connection stays
            return
        if login["token"] != CONSOLE_TOKEN:
            assert ev["type"] == "error" and ev["code"] == "unauthorized", ev
            assert ws.wait_closed().code == 4401
            return
        assert ev["type"] == "console_ready", ev
        for frame in batch:
            ws.send(frame)
        try:
            ws.sync()
        except (Closed, TimeoutError) as exc:
            STATS["crashes"] += 1
            raise AssertionError(
                f"console: {exc!r} after {login!r:.300} {[f[:300] for f in batch]!r}"
            ) from None
    finally:
        ws.close()


@pytest.fixture(scope="module")
def taken_over(server):
    """A customer session taken over by a console agent: chats are forwarded, the agent replies."""
    agent, customer = WS(server.url + "/console", CONSOLE_EVENTS), WS(server.url)
    agent.send(
        json.dumps({"type": "login", "token": CONSOLE_TOKEN, "agent": "Fuzz", "agent_id": "fuzz-agent"})
    )
    assert agent.recv()["type"] == "console_ready"
    sid = _hello(customer, client="fuzzed customer")[-1]["session_id"]
    agent.send(json.dumps({"type": "take_over", "session_id": sid}))
    assert customer.recv() == {"type": "handover", "to": "agent", "agent": "Fuzz"}
    agent.sync()
    yield agent, customer, sid
    agent.send(json.dumps({"type": "hand_back", "session_id": sid}))
    events = customer.sync()
    assert {"type": "handover", "to": "bot", "agent": None} in events, events
    customer.send(json.dumps({"type": "chat", "id": "bot-again", "text": "still there?"}))
    while (ev := customer.recv())["type"] != "done":
        assert ev["type"] == "token", ev
    assert ev["text"] == REPLY
    agent.close()
    customer.close()


@fuzz(60)
@given(
    customer_frames=st.lists(st.one_of(mutated_message(), random_message(), surrogate_frames), max_size=2),
    agent_frames=st.lists(
        st.builds(
            lambda kind, sid, text: {"type": kind, "session_id": sid, "text": text},
            st.sampled_from(["agent_message", "agent_message", "take_over", "hand_back"]),
            st.one_of(st.just("<sid>"), json_values),
            json_values,
        ),
        max_size=2,
    ),
)
def test_take_over_fuzz(server, taken_over, customer_frames, agent_frames):
    agent, customer, sid = taken_over
    for frame in agent_frames:
        if frame["type"] == "hand_back" and frame["session_id"] == "<sid>":
            frame["type"] = "take_over"  # keep the conversation taken over for the next examples
        frame = json.dumps(frame).replace('"<sid>"', json.dumps(sid))
        agent.send(frame)
    try:
        agent.sync()
        send_and_check(customer, customer_frames)
    except (Closed, TimeoutError) as exc:
        STATS["crashes"] += 1
        raise AssertionError(
            f"{exc!r} after agent {agent_frames!r:.500} customer {customer_frames!r:.500}"
        ) from None


# -- afterwards: the server is fine ---------------------------------------------------------------


def test_zz_normal_chat_afterwards(server, http):
    """Runs last in this module: a normal chat works, and the server logged no error since it started."""
    fuzzutil.server_fine_afterwards(server, http)
