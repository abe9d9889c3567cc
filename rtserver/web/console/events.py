"""The console's wire format, server side: every `/ws/console` event an agent gets, declared as a
TypedDict and built by one function. What it shares with `/ws` (errors, pong, handover) comes from
web/events.py. Reference: docs/protocol.md (Agent console).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, NotRequired

from typing_extensions import TypedDict  # pydantic needs this one on Python < 3.12

from ..protocol import PROTOCOL_VERSION
from ..seams import ConsoleEvent, ConsoleRecord

Record = Mapping[str, object]  # a summary, a message or a mood, as conversation.py makes it


class AgentId(TypedDict):
    id: str | None
    name: str


class ConsoleReadyEvent(TypedDict):
    """Answers `login`: who the agent is, its rejoin token, the listed conversations' summaries."""

    type: Literal["console_ready"]
    protocol: str
    agent: AgentId
    rejoin: str | None
    mood_window: int
    conversations: list[ConsoleRecord]


class ConversationEvent(TypedDict):
    """A conversation is listed, or its summary changed."""

    type: Literal["conversation"]
    conversation: Record


class MessageEvent(TypedDict):
    """A message added to a conversation, with its mood after it."""

    type: Literal["message"]
    session_id: str
    message: Record
    mood: Record
    updated_at: float


class RemovedEvent(TypedDict):
    type: Literal["removed"]
    session_id: str


class ConsoleTokenEvent(TypedDict):
    """A text delta of the bot's reply `id`."""

    type: Literal["token"]
    session_id: str
    id: str
    text: str


class StreamEndEvent(TypedDict):
    """The bot's reply `id` left no message; `dropped`: the seq of its user message, removed."""

    type: Literal["stream_end"]
    session_id: str
    id: str
    finish_reason: str
    dropped: NotRequired[int]


class ActionEvent(TypedDict):
    """An action ran for a customer message: `message` has role `action` and its `call` (arguments,
    status, result or error, ms)."""

    type: Literal["action"]
    session_id: str
    message: Record
    updated_at: float


class TagEvent(TypedDict):
    """An auto-task's label on the user message `seq`."""

    type: Literal["tag"]
    session_id: str
    seq: int
    id: str
    task: str
    label: object
    mood: Record


class MessagesEvent(TypedDict):
    """Answers `open`: a page of a conversation's messages, `more` when older ones are left."""

    type: Literal["messages"]
    session_id: str
    messages: Sequence[Record]
    more: bool
    streaming: Record | None
    seq: int


class AssistEvent(TypedDict):
    """Answers `assist`: the task's output for the agent who asked."""

    type: Literal["assist"]
    id: str
    session_id: str
    task: str
    output: Record
    text: str
    timing: Record


class AssistDeltaEvent(TypedDict):
    """With `stream`: the text so far of one reply (`sample`) of the `assist` call `id`."""

    type: Literal["assist_delta"]
    id: str
    session_id: str
    task: str
    sample: int
    text: str


ConsoleServerEvent = (
    ConsoleReadyEvent
    | ConversationEvent
    | MessageEvent
    | RemovedEvent
    | ConsoleTokenEvent
    | StreamEndEvent
    | TagEvent
    | MessagesEvent
    | AssistEvent
    | AssistDeltaEvent
    | ActionEvent
)


def console_ready(
    agent_id: str | None, name: str, rejoin: str | None, mood_window: int, conversations: list[ConsoleRecord]
) -> ConsoleEvent:
    return dict(
        ConsoleReadyEvent(
            type="console_ready",
            protocol=PROTOCOL_VERSION,
            agent={"id": agent_id, "name": name},
            rejoin=rejoin,
            mood_window=mood_window,
            conversations=conversations,
        )
    )


def conversation(summary: Record) -> ConsoleEvent:
    return dict(ConversationEvent(type="conversation", conversation=summary))


def message(session_id: str, msg: Record, mood: Record, updated_at: float) -> ConsoleEvent:
    return dict(
        MessageEvent(type="message", session_id=session_id, message=msg, mood=mood, updated_at=updated_at)
    )


def removed(session_id: str) -> ConsoleEvent:
    return dict(RemovedEvent(type="removed", session_id=session_id))


def token(session_id: str, request_id: str, text: str) -> ConsoleEvent:
    return dict(ConsoleTokenEvent(type="token", session_id=session_id, id=request_id, text=text))


def stream_end(
    session_id: str, request_id: str, finish_reason: str, dropped: int | None = None
) -> ConsoleEvent:
    event = StreamEndEvent(
        type="stream_end", session_id=session_id, id=request_id, finish_reason=finish_reason
    )
    if dropped is not None:
        event["dropped"] = dropped
    return dict(event)


def tag(session_id: str, seq: int, request_id: str, task: str, label: object, mood: Record) -> ConsoleEvent:
    return dict(
        TagEvent(type="tag", session_id=session_id, seq=seq, id=request_id, task=task, label=label, mood=mood)
    )


def messages(
    session_id: str, shown: Sequence[Record], more: bool, streaming: Record | None, seq: int
) -> ConsoleEvent:
    return dict(
        MessagesEvent(
            type="messages", session_id=session_id, messages=shown, more=more, streaming=streaming, seq=seq
        )
    )


def assist(
    request_id: str, session_id: str, task: str, output: Record, text: str, timing: Record
) -> ConsoleEvent:
    return dict(
        AssistEvent(
            type="assist",
            id=request_id,
            session_id=session_id,
            task=task,
            output=output,
            text=text,
            timing=timing,
        )
    )


def assist_delta(request_id: str, session_id: str, task: str, sample: int, text: str) -> ConsoleEvent:
    return dict(
        AssistDeltaEvent(
            type="assist_delta", id=request_id, session_id=session_id, task=task, sample=sample, text=text
        )
    )


def action(session_id: str, msg: Record, updated_at: float) -> ConsoleEvent:
    return dict(ActionEvent(type="action", session_id=session_id, message=msg, updated_at=updated_at))
