"""The console's typed messages between nodes: who holds a take-over, and the actions sent to a node.

A command comes off the bus as JSON from Redis, which is untrusted input. `parse_command` reads it
once; a malformed one comes out as None, and the bus drops it with a log line. Below that point the
console only sees the dataclasses here. The JSON each one writes is the wire format between nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Holder:
    """The agent answering a conversation instead of the bot."""

    id: str
    name: str

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "name": self.name}

    @classmethod
    def from_json(cls, raw: object) -> Holder | None:
        """The holder a JSON value names, or None when it is not one."""
        if not isinstance(raw, dict):
            return None
        agent_id, name = raw.get("id"), raw.get("name")
        if not isinstance(agent_id, str) or not isinstance(name, str):
            return None
        return cls(agent_id, name)


@dataclass(frozen=True)
class TakeOver:
    """The agent answers the conversation from now on."""

    session_id: str
    agent: Holder

    def to_json(self) -> dict[str, Any]:
        return {"cmd": "take_over", "session_id": self.session_id, "agent": self.agent.to_json()}


@dataclass(frozen=True)
class HandBack:
    """The bot answers the conversation again."""

    session_id: str

    def to_json(self) -> dict[str, Any]:
        return {"cmd": "hand_back", "session_id": self.session_id}


MAX_MESSAGE_ID_CHARS = 64


@dataclass(frozen=True)
class AgentMessage:
    """An agent's reply, already checked and cleaned, for the customer; `id` is the message's own, so
    the node serving the conversation applies it once however often it arrives."""

    session_id: str
    agent: Holder
    text: str
    id: str

    def to_json(self) -> dict[str, Any]:
        return {
            "cmd": "agent_message",
            "session_id": self.session_id,
            "text": self.text,
            "agent": self.agent.to_json(),
            "id": self.id,
        }


@dataclass(frozen=True)
class SessionTaken:
    """The customer resumed the session on another node: its connection here is closed."""

    session_id: str

    def to_json(self) -> dict[str, Any]:
        return {"cmd": "session_taken", "session_id": self.session_id}


BusCommand = TakeOver | HandBack | AgentMessage | SessionTaken


def parse_command(data: object) -> BusCommand | None:
    """The command a JSON value holds, or None when it is malformed."""
    if not isinstance(data, dict):
        return None
    sid, kind = data.get("session_id"), data.get("cmd")
    if not isinstance(sid, str):
        return None
    if kind == "hand_back":
        return HandBack(sid)
    if kind == "session_taken":
        return SessionTaken(sid)
    agent = Holder.from_json(data.get("agent"))
    if agent is None:
        return None
    if kind == "take_over":
        return TakeOver(sid, agent)
    text, message_id = data.get("text"), data.get("id")
    if (
        kind == "agent_message"
        and isinstance(text, str)
        and isinstance(message_id, str)
        and 0 < len(message_id) <= MAX_MESSAGE_ID_CHARS
    ):
        return AgentMessage(sid, agent, text, message_id)
    return None
