"""What happens in customer sessions, as typed events: the hub publishes them, the console subscribes.

Subscribers are called synchronously, in order, as the hub publishes. An event is never awaited on,
so a subscriber's state and what it queues for its own clients change in one step. A subscriber that
raises is logged and skipped: it never breaks the customer's turn.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..tasks.citations import Source
from .handoff import TurnSignals
from .session import Session

log = logging.getLogger("rtserver.session_events")


@dataclass(frozen=True)
class Attached:
    """A connection took the session (new, resumed, or taken from another connection)."""

    session: Session
    client_name: str | None
    resumed: bool


@dataclass(frozen=True)
class Detached:
    """The session's connection closed; it may resume until it expires."""

    session: Session


@dataclass(frozen=True)
class Dropped:
    """The session expired or was evicted: its history is gone."""

    session: Session


@dataclass(frozen=True)
class TurnStarted:
    """A customer message the bot answers is in the history."""

    session: Session
    request_id: str
    text: str


@dataclass(frozen=True)
class Forwarded:
    """A customer message went to the agent who holds the session, stored."""

    session: Session
    request_id: str
    text: str


@dataclass(frozen=True)
class Token:
    """Text the bot streamed for a turn."""

    session: Session
    request_id: str
    text: str


@dataclass(frozen=True)
class TurnFinished:
    """The bot's turn ended; `reply` is None when it left no text in the history."""

    session: Session
    request_id: str
    reply: str | None
    finish_reason: str
    sources: tuple[Source, ...] = ()  # with knowledge on: the articles the reply cited


@dataclass(frozen=True)
class Tagged:
    """An auto-task's output for a customer message."""

    session: Session
    request_id: str
    task: str
    output: object


@dataclass(frozen=True)
class Signalled:
    """A bot turn ended and was stored: what it tells the hand-off policy."""

    session: Session
    request_id: str
    signals: TurnSignals


@dataclass(frozen=True)
class Cleared:
    """The customer reset the session: its history is empty."""

    session: Session


@dataclass(frozen=True)
class ActionCalled:
    """An action ran for a customer message (or was refused): its arguments and outcome, for agents."""

    session: Session
    request_id: str
    call: dict[str, object]  # `Outcome.to_json()`: action, arguments, status, result, error, ms


SessionEvent = (
    Attached
    | Detached
    | Dropped
    | TurnStarted
    | Forwarded
    | Token
    | TurnFinished
    | Tagged
    | Cleared
    | Signalled
    | ActionCalled
)
Subscriber = Callable[[SessionEvent], None]


class SessionEvents:
    """The fan-out from the hub to its subscribers."""

    def __init__(self) -> None:
        self.subscribers: list[Subscriber] = []

    def subscribe(self, subscriber: Subscriber) -> None:
        self.subscribers.append(subscriber)

    def publish(self, event: SessionEvent) -> None:
        for subscriber in self.subscribers:
            try:
                subscriber(event)
            except Exception:
                log.exception("a subscriber failed on %s", type(event).__name__)
