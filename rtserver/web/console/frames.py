"""The frames an agent sends on `/ws/console`, as pydantic models (protocol.py has `/ws`'s).

A frame's `type` is checked by the door first. Values are not converted here: each part of the
console checks its own fields (a wrong token is `unauthorized`, a session id that is not a string
is `unknown_session`), so a field holds what the agent sent. Reference: docs/protocol.md.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter
from pydantic.dataclasses import dataclass

SessionId = Annotated[object, Field(description="a conversation's session id (a string)")]


@dataclass
class Login:
    """The first frame: the console token, and the agent's name or rejoin token."""

    token: Annotated[object, Field(description="security.console_token")] = None
    agent: Annotated[object, Field(description="the agent's name, cleaned and cut to 60 characters")] = None
    rejoin: Annotated[object, Field(description="the rejoin token of an earlier console_ready")] = None
    type: Literal["login"] = "login"


@dataclass
class TakeOver:
    """Answer the conversation instead of the bot."""

    session_id: SessionId = None
    type: Literal["take_over"] = "take_over"


@dataclass
class HandBack:
    """Give the conversation back to the bot."""

    session_id: SessionId = None
    type: Literal["hand_back"] = "hand_back"


@dataclass
class AgentReply:
    """A reply to the customer of a conversation the agent holds."""

    session_id: SessionId = None
    text: Annotated[object, Field(description="the reply (a string)")] = None
    type: Literal["agent_message"] = "agent_message"


@dataclass
class AssistCall:
    """Run an assist task on a conversation, for this agent alone."""

    id: Annotated[object, Field(description="a string of 1..64 characters")] = None
    session_id: SessionId = None
    task: Annotated[object, Field(description="an assist task's name")] = None
    text: Annotated[object, Field(description="the text to work on (default: the conversation)")] = None
    stream: Annotated[object, Field(description="true: the text comes in assist_delta frames")] = False
    type: Literal["assist"] = "assist"


@dataclass
class Open:
    """A page of a conversation's messages, older than `before` if given."""

    session_id: SessionId = None
    before: Annotated[object, Field(description="a message seq")] = None
    type: Literal["open"] = "open"


@dataclass
class ConsolePing:
    """Answered `pong` with the same `data`."""

    data: Annotated[object, Field(description="any JSON value")] = None
    type: Literal["ping"] = "ping"


AgentFrame = Login | TakeOver | HandBack | AgentReply | AssistCall | Open | ConsolePing
AGENT_FRAME: TypeAdapter[AgentFrame] = TypeAdapter(Annotated[AgentFrame, Field(discriminator="type")])
AGENT_MESSAGE_TYPES = ("login", "take_over", "hand_back", "agent_message", "assist", "open", "ping")
