"""The console's bus commands (rtserver/web/commands.py): the JSON one node sends is the command the
other reads, and anything else off the bus (untrusted, from Redis) reads as None, never raises."""

from __future__ import annotations

import json

import pytest

from rtserver.web.commands import AgentMessage, HandBack, Holder, SessionTaken, TakeOver, parse_command

ALICE = Holder("a1", "Alice")


@pytest.mark.parametrize(
    "command",
    [TakeOver("s1", ALICE), HandBack("s1"), AgentMessage("s1", ALICE, "hi", "m1"), SessionTaken("s1")],
)
def test_a_command_reads_back_as_itself_through_json(command):
    assert parse_command(json.loads(json.dumps(command.to_json()))) == command


def test_the_wire_format_between_nodes():
    assert TakeOver("s1", ALICE).to_json() == {
        "cmd": "take_over",
        "session_id": "s1",
        "agent": {"id": "a1", "name": "Alice"},
    }
    assert AgentMessage("s1", ALICE, "hi", "m1").to_json() == {
        "cmd": "agent_message",
        "session_id": "s1",
        "text": "hi",
        "agent": {"id": "a1", "name": "Alice"},
        "id": "m1",
    }


@pytest.mark.parametrize(
    "data",
    [
        None,
        [],
        "take_over",
        {"cmd": "take_over"},
        {"cmd": "hand_back", "session_id": 7},
        {"cmd": "take_over", "session_id": "s1"},
        {"cmd": "take_over", "session_id": "s1", "agent": {"id": 1, "name": "Alice"}},
        {"cmd": "take_over", "session_id": "s1", "agent": ["a1", "Alice"]},
        {"cmd": "agent_message", "session_id": "s1", "agent": {"id": "a1", "name": "A"}},
        {"cmd": "agent_message", "session_id": "s1", "agent": {"id": "a1", "name": "A"}, "text": 5},
        {"cmd": "agent_message", "session_id": "s1", "agent": {"id": "a1", "name": "A"}, "text": "hi"},
        {"cmd": "agent_message", "session_id": "s1", "agent": {"id": "a", "name": "A"}, "text": "x", "id": 5},
        {"cmd": "dance", "session_id": "s1", "agent": {"id": "a1", "name": "A"}},
        {"cmd": ["hand_back"], "session_id": "s1"},
    ],
)
def test_a_malformed_command_reads_as_none(data):
    assert parse_command(data) is None


def test_a_holder_is_read_only_from_an_object_of_two_strings():
    assert Holder.from_json({"id": "a1", "name": "Alice", "extra": 1}) == ALICE
    assert Holder.from_json({"id": "a1"}) is None
    assert Holder.from_json("a1") is None
