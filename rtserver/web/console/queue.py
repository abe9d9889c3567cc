"""The hand-off queue: conversations waiting for a person, what their customers are told, the e-mail left.

`HandoffQueue` applies the policy (web/handoff.py) at three moments: a customer message before the bot
sees it (`on_message`: the customer asks), an auto-task's tag (`tagged`: mood, intent) and a finished
bot turn (`turn_ended`: the bot did not know). When it fires, the conversation is marked waiting and
its summary goes to every agent at once; the customer then gets `handoff` and `queue_position`. The
bot answers nobody while a conversation waits: the hub forwards its messages to the console. A
take-over or hand-back ends the wait (`end`). The queue's order lives on the bus (clustered: a Redis
sorted set), so places count every node's waiting conversations.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

from .. import events
from ..handoff import HandoffPolicy, Reason, TurnSignals, Waiting
from ..seams import ConsoleBus, StoreUnavailable
from ..session import Session, SessionRegistry
from .conversation import Conversation
from .conversations import Conversations
from .guard import spawn


class NotWaiting(Exception):
    """An e-mail left while the conversation waits for nobody."""

    code = "not_waiting"
    message = "this conversation is not waiting for a person"


def utc_now() -> datetime:
    return datetime.now(UTC)


class HandoffQueue:
    """Which conversations wait for a person, and their customers' view of the wait."""

    def __init__(
        self,
        policy: HandoffPolicy,
        conversations: Conversations,
        sessions: SessionRegistry,
        bus: ConsoleBus,
        agents_online: Callable[[], int],
        counted: Callable[[str], None] = lambda reason: None,
        now: Callable[[], datetime] = utc_now,
    ):
        self.policy = policy
        self.conversations = conversations
        self.sessions = sessions
        self.bus = bus
        self.agents_online = agents_online
        self.counted = counted  # each hand-off, by its reason (/metrics)
        self.now = now  # business hours are read on this clock (tests pass a fake)
        self.intent_task = policy.settings.intent_task
        self.mood_window = policy.settings.mood_window
        self._told: dict[str, tuple[int, int]] = {}  # session id -> (place, agents) its customer last got

    def waiting(self, session_id: str) -> Waiting | None:
        conv = self.conversations.get(session_id)
        return conv.handoff if conv is not None else None

    # -- the signals ----------------------------------------------------------------------------
    def on_message(self, session: Session, text: str) -> bool:
        """A customer message before the bot sees it: whether it goes to people instead."""
        conv = self.conversations.get(session.id)
        if conv is None or not self.policy.enabled:
            return False
        if conv.handoff is not None:
            return True
        reason = self.policy.reason(TurnSignals(text=text)) if conv.agent is None else None
        if reason is not None:
            self.fire(conv, reason)
        return reason is not None

    def tagged(self, session: Session) -> None:
        """An auto-task tagged a customer message: the mood or intent may call for a person."""
        self._check(session, TurnSignals())

    def turn_ended(self, session: Session, signals: TurnSignals) -> None:
        """The bot's turn ended: its own signals (it did not know) join the conversation's."""
        self._check(session, signals)

    def _check(self, session: Session, signals: TurnSignals) -> None:
        conv = self.conversations.get(session.id)
        if conv is None or conv.handoff is not None or conv.agent is not None or not self.policy.enabled:
            return
        full = TurnSignals(
            moods=conv.recent_moods(self.mood_window),
            intent=conv.last_tag(self.intent_task),
            bot_unknown=signals.bot_unknown,
        )
        reason = self.policy.reason(full)
        if reason is not None:
            self.fire(conv, reason)

    # -- entering and leaving -------------------------------------------------------------------
    def fire(self, conv: Conversation, reason: Reason) -> None:
        """The conversation waits for a person from now on; agents see it in this same step."""
        closed = not self.policy.hours.open_at(self.now())
        conv.handoff = Waiting(reason.code, reason.text, time.time(), closed)
        conv.updated_at = conv.handoff.since
        self.conversations.changed(conv)
        self.counted(reason.code)
        spawn(self._entered(conv.session_id, conv.handoff))

    async def _entered(self, session_id: str, waiting: Waiting) -> None:
        await self._tell(session_id, events.handoff_event(True, waiting.out_of_hours, waiting.email))
        await self.bus.queue_add(session_id, waiting.since)
        await self.refresh()

    def end(self, conv: Conversation) -> None:
        """An agent took the conversation over or handed it back, or the customer reset it: it waits
        no more."""
        if conv.handoff is None:
            return
        conv.handoff, conv.handoff_after = None, conv.seq
        self._told.pop(conv.session_id, None)
        spawn(self._left(conv.session_id))

    async def _left(self, session_id: str) -> None:
        await self._tell(session_id, events.handoff_event(False))
        await self.bus.queue_remove(session_id)
        await self.refresh()

    def dropped(self, session_id: str, waiting: Waiting | None) -> None:
        """The session expired here; its place goes unless another node serves it now."""
        self._told.pop(session_id, None)
        if waiting is not None:
            spawn(self._forget(session_id))

    async def _forget(self, session_id: str) -> None:
        record = await self.bus.conversation(session_id)
        if record is None or record.get("node") == self.conversations.node_id:
            await self.bus.queue_remove(session_id)
            await self.refresh()

    def attached(self, session: Session) -> None:
        """A customer (re)connected: a conversation still waiting says so again."""
        waiting = self.waiting(session.id)
        if waiting is not None:
            self._told.pop(session.id, None)
            spawn(self._entered(session.id, waiting))

    async def leave_email(self, session: Session, email: str) -> events.Event:
        """The customer's e-mail, kept on the conversation and shown to agents; the customer's answer."""
        conv = self.conversations.get(session.id)
        if conv is None or conv.handoff is None:
            raise NotWaiting()
        conv.handoff.email = email
        conv.updated_at = time.time()
        self.conversations.changed(conv)
        return events.handoff_event(True, conv.handoff.out_of_hours, email)

    # -- places ---------------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Each waiting customer of this node gets its place when it or the agents online changed."""
        waiting = [c.session_id for c in self.conversations if c.handoff is not None and c.connected]
        if not waiting:
            return
        try:
            ranks = await self.bus.queue_ranks(waiting)
        except StoreUnavailable:  # told at the next heartbeat
            return
        agents = self.agents_online()
        for sid, rank in zip(waiting, ranks, strict=True):
            conv = self.conversations.get(sid)
            if rank is None and conv is not None and conv.handoff is not None:  # (resumed from a record)
                await self.bus.queue_add(sid, conv.handoff.since)
            if rank is None or self._told.get(sid) == (rank + 1, agents):
                continue
            self._told[sid] = (rank + 1, agents)
            await self._tell(sid, events.queue_position_event(rank + 1, agents))

    async def _tell(self, session_id: str, event: events.Event) -> None:
        session = self.sessions.sessions.get(session_id)
        conn = session.connection if session is not None else None
        if conn is not None:
            await conn.send(event)
