"""Agents' actions on a conversation: take over, hand back, reply; the grace of a gone agent; a
session resumed on another node.

An action is decided through the bus (clustered: the take-over is claimed in Redis) and applied on
the node serving the conversation, where the customer's connection lives: here, or on another node
as a bus command. An agent whose console disconnects keeps its take-overs for
`sessions.console_takeover_grace_s` (to reconnect), then they are handed back. An agent's message is
stored in the session before anyone sees it (not stored: the agent is told why, the customer gets
nothing), and applied once by its id however often the bus delivers it.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from .. import events
from ..commands import AgentMessage, BusCommand, HandBack, Holder, SessionTaken, TakeOver
from ..connection import Close
from ..display import clean_text
from ..seams import ConsoleBus, ConsoleEvent, Resumed, SessionStore, StoreUnavailable
from ..session import Session, SessionRegistry
from .agents import Agent, Agents
from .conversation import Conversation
from .conversations import Conversations
from .guard import spawn
from .timer import Cancellable, Timer

log = logging.getLogger("rtserver.console")

MAX_AGENT_MESSAGE_CHARS = 4000
SEEN_MESSAGES = 4096  # the newest agent message ids applied here: one delivered again is dropped

Decide = Callable[[Agent, str], Awaitable[BusCommand | None]]


class Actions:
    """Decides agents' actions through the bus and applies those for conversations served here."""

    def __init__(
        self,
        conversations: Conversations,
        sessions: SessionRegistry,
        store: SessionStore,
        bus: ConsoleBus,
        agents: Agents,
        grace_s: float,
        timer: Timer,
        end_wait: Callable[[Conversation], None] = lambda conv: None,
    ):
        self.conversations = conversations
        self.sessions = sessions
        self.store = store  # agent messages are stored in the session's record through it
        self.bus = bus
        self.agents = agents
        self.node_id = conversations.node_id
        self.grace_s = grace_s
        self.timer = timer
        self.end_wait = end_wait  # a take-over or hand-back ends a wait for a person (queue.py)
        self._holds: dict[str, str] = {}  # session id -> agent id: take-overs claimed by this node's agents
        self._release: dict[str, Cancellable] = {}  # grace timers of agents gone from this node
        self._applied: OrderedDict[str, None] = OrderedDict()  # agent message ids applied here

    # -- decided through the bus ----------------------------------------------------------------
    async def take_over(self, agent: Agent, session_id: str) -> None:
        await self._act(agent, session_id, self._claim)

    async def hand_back(self, agent: Agent, session_id: str) -> None:
        await self._act(agent, session_id, self._give_back)

    async def agent_message(self, agent: Agent, session_id: str, text: object) -> None:
        async def reply(agent: Agent, session_id: str) -> BusCommand | None:
            return await self._reply(agent, session_id, text)

        await self._act(agent, session_id, reply)

    async def _act(self, agent: Agent, session_id: str, decide: Decide) -> None:
        """The holder on the bus decides (clustered: in Redis), the node serving it applies it."""
        try:
            record = await self.bus.conversation(session_id)
            if record is None and session_id in self.conversations:
                record = {"node": self.node_id}
            if record is None:
                message = f"no live conversation {session_id!r}"
                agent.put(events.error_event("unknown_session", message, session_id=session_id))
                return
            command = await decide(agent, session_id)
            if command is not None:
                await self._send(agent, record.get("node"), command)
        except StoreUnavailable as exc:
            agent.put(events.error_event(exc.code, exc.message, session_id=session_id))

    async def _send(self, agent: Agent, node: object, command: BusCommand) -> None:
        if node == self.node_id:
            await self.apply(command)
        elif not isinstance(node, str) or not await self.bus.command(node, command):
            sid = command.session_id
            message = f"the node serving conversation {sid!r} is not reachable"
            agent.put(events.error_event("unknown_session", message, session_id=sid))

    async def _claim(self, agent: Agent, session_id: str) -> BusCommand | None:
        holder = await self.bus.claim(session_id, agent.holder())
        if holder.id != agent.id:
            agent.put(_taken_error(session_id, holder))
            return None
        self._holds[session_id] = agent.id
        return TakeOver(session_id, holder)

    async def _give_back(self, agent: Agent, session_id: str) -> BusCommand | None:
        if not await self.bus.release(session_id, agent.id):
            message = "you have not taken over this conversation"
            agent.put(events.error_event("not_taken_over", message, session_id=session_id))
            return None
        self._holds.pop(session_id, None)
        return HandBack(session_id)

    async def _reply(self, agent: Agent, session_id: str, text: object) -> BusCommand | None:
        current = await self.bus.holder(session_id)
        if current is None or current.id != agent.id:
            message = "take over the conversation before replying"
            agent.put(events.error_event("not_taken_over", message, session_id=session_id))
            return None
        if not isinstance(text, str):
            agent.put(events.error_event("invalid_field", "'text' must be a string", session_id=session_id))
            return None
        clean = clean_text(text, MAX_AGENT_MESSAGE_CHARS)
        if not clean:
            agent.put(events.error_event("empty_text", "the message is empty", session_id=session_id))
            return None
        return AgentMessage(session_id, agent.holder(), clean, secrets.token_urlsafe(12))

    # -- applied on the node serving the conversation -------------------------------------------
    async def apply(self, command: BusCommand) -> None:
        """An action for a conversation this node serves (from an agent here or on another node)."""
        match command:
            case SessionTaken(session_id=sid):  # the customer resumed its session on another node
                await self._close_taken(sid)
            case TakeOver(session_id=sid, agent=holder):
                await self.apply_take_over(sid, holder)
            case HandBack(session_id=sid):
                await self.apply_hand_back(sid)
            case AgentMessage():
                await self.apply_agent_message(command)

    async def _close_taken(self, session_id: str) -> None:
        session = self.sessions.sessions.get(session_id)
        conn = session.connection if session is not None else None
        if conn is not None:
            await conn.error("session_taken_over", "this session was resumed by another connection")
            conn.cancel_all()
            conn.stop(Close.TAKEN_OVER, "session taken over")

    async def apply_take_over(self, session_id: str, holder: Holder) -> None:
        """The agent answers from now on."""
        self.cancel_release(session_id)
        conv = self.conversations.get(session_id)
        session = self.sessions.sessions.get(session_id)
        if conv is None or session is None:
            return
        if conv.agent is not None and conv.agent.id == holder.id:  # already: say so again
            self.conversations.changed(conv)
            return
        conv.agent = holder
        conv.updated_at = time.time()
        self.end_wait(conv)
        self.conversations.changed(conv)
        await _to_customer(session, events.handover_event(holder.name))

    async def apply_hand_back(self, session_id: str) -> None:
        self.cancel_release(session_id)
        conv = self.conversations.get(session_id)
        session = self.sessions.sessions.get(session_id)
        if conv is None or session is None or conv.agent is None:  # (handed back already)
            return
        conv.agent = None
        conv.updated_at = time.time()
        self.end_wait(conv)
        self.conversations.changed(conv)
        await _to_customer(session, events.handover_event(None))

    async def apply_agent_message(self, command: AgentMessage) -> None:
        """Stored in the session first (clustered: its record in Redis), then shown and delivered."""
        sid, text, holder = command.session_id, command.text, command.agent
        if command.id in self._applied:  # delivered again (a bus message retried)
            return
        self._applied[command.id] = None
        while len(self._applied) > SEEN_MESSAGES:
            self._applied.popitem(last=False)
        conv = self.conversations.get(sid)
        session = self.sessions.sessions.get(sid)
        if conv is None or session is None:
            message = f"conversation {sid!r} has ended; the message was not sent"
            self.conversations.tell(holder.id, events.error_event("unknown_session", message, session_id=sid))
            return
        entry = {"role": "assistant", "content": text, "agent": holder.name}
        session.history = [*session.history, entry]  # a new list: a snapshot taken before keeps its own
        session.touch(self.sessions.clock())
        try:  # into the session's record (clustered, it survives this node)
            await self.store.save(session, getattr(session.connection, "client_name", None))
        except StoreUnavailable as exc:  # (SessionConflict, StoreError too): nobody gets it
            session.history = [m for m in session.history if m is not entry]
            self._applied.pop(command.id, None)  # the agent may send it again
            log.warning("agent message in session %s not stored: %s", sid, type(exc).__name__)
            error = events.error_event(exc.code, f"your message was not sent: {exc.message}", session_id=sid)
            self.conversations.tell(holder.id, error)
            return
        msg = conv.add({"role": "agent", "text": text, "agent": holder.name, "id": command.id})
        self.conversations.message_event(conv, msg)
        await _to_customer(session, events.agent_message_event(text, holder.name))

    async def resumed(self, found: Resumed) -> None:
        """A session resumed: who holds it, and close its connection on the node that served it."""
        session = found.session
        # clustered: maybe from another node
        self.conversations.set_holder(session.id, await self.bus.holder(session.id))
        if found.served_on and found.served_on != self.node_id:
            # a connection to it on another node is closed there (4409)
            await self.bus.command(found.served_on, SessionTaken(session.id))

    # -- the heartbeat --------------------------------------------------------------------------
    async def renew_holds(self) -> None:
        """Clustered heartbeat: the take-overs of this node's agents stay alive."""
        await self.bus.renew_holds(dict(self._holds))

    async def expire_holders(self) -> None:
        """A conversation served here whose holder's key is gone (its node died) goes back to the bot."""
        held = [conv.session_id for conv in self.conversations if conv.agent is not None]
        if not held:
            return
        for sid, holder in zip(held, await self.bus.holders(held), strict=True):
            conv = self.conversations.get(sid)
            if holder is None and conv is not None and conv.agent is not None:
                log.info("conversation %s handed back: its agent's take-over expired", sid)
                await self.apply_hand_back(sid)

    # -- the grace of an agent gone from this node ----------------------------------------------
    def agent_left(self, agent: Agent) -> None:
        """Schedule hand-back of the take-overs of an agent id that has no console connected."""
        if not agent.id or self.agents.online(agent.id):
            return
        for sid, agent_id in list(self._holds.items()):  # the take-overs its agents claimed, any node's
            if agent_id == agent.id and sid not in self._release:
                release = functools.partial(self._release_orphan, sid, agent_id)
                self._release[sid] = self.timer.call_later(self.grace_s, release)

    def agent_back(self, agent_id: str) -> None:
        """An agent logged in again: its take-overs are its own still."""
        for sid, timer in list(self._release.items()):
            conv = self.conversations.get(sid)
            if (conv is not None and conv.agent is not None and conv.agent.id == agent_id) or (
                self._holds.get(sid) == agent_id
            ):
                timer.cancel()
                self._release.pop(sid, None)

    def _release_orphan(self, session_id: str, agent_id: str) -> None:
        self._release.pop(session_id, None)
        if not self.agents.online(agent_id):
            self._holds.pop(session_id, None)
            spawn(self._release_held(session_id, agent_id))

    async def _release_held(self, session_id: str, agent_id: str) -> None:
        if not await self.bus.release(session_id, agent_id):
            return
        record = await self.bus.conversation(session_id)
        node = record.get("node") if record else self.node_id
        if node == self.node_id:
            await self.apply(HandBack(session_id))
        elif isinstance(node, str):
            await self.bus.command(node, HandBack(session_id))

    def cancel_release(self, session_id: str) -> None:
        timer = self._release.pop(session_id, None)
        if timer is not None:
            timer.cancel()

    def close(self) -> None:
        for timer in self._release.values():
            timer.cancel()
        self._release.clear()


def _taken_error(session_id: str, holder: Holder) -> ConsoleEvent:
    return events.error_event(
        "already_taken",
        f"{holder.name} has already taken over this conversation",
        session_id=session_id,
        agent=holder.to_json(),
    )


async def _to_customer(session: Session, event: ConsoleEvent) -> None:
    conn = session.connection
    if conn is not None:
        await conn.send(event)
