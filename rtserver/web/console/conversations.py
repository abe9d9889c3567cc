"""The registry of this node's conversations: the hub's session events, fan-out and store writes.

Each hook updates a conversation and broadcasts one event in the same synchronous step, so an agent's
snapshot followed by the events after it misses nothing and doubles nothing. Events carry what changed
(a summary, a message, a token), never the conversation's messages, each within MAX_EVENT_BYTES, and are
encoded once for all agents. A conversation is shown to agents (listed, stored) from its first message
on. Clustered, the record a conversation keeps in Redis is written once a turn, with its auto-task tags
(or after TAG_WAIT_S).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from ...tasks.citations import Source
from ..commands import Holder
from ..display import clean_text
from ..handoff import Waiting
from ..seams import ConsoleBus, ConsoleEvent, ConsoleRecord
from ..session import Session
from ..state import AppState
from . import events as agent_events
from .agents import FOR_AGENT, Agents, Shared
from .conversation import (
    MAX_EVENT_TEXT_BYTES,
    Conversation,
    Message,
    action_call,
    bounded,
    customer_name,
)
from .guard import spawn

SENTIMENT_TASK = "sentiment"
TAG_WAIT_S = 5.0  # clustered: a finished turn waits this long for its auto-task tags to be written with


class Conversations:
    """This node's conversations, by session id, and the hooks the hub calls as sessions change."""

    def __init__(
        self,
        state: AppState,
        bus: ConsoleBus,
        agents: Agents,
        node_id: str,
        clock: Callable[[], float],
    ):
        self.state = state
        self.bus = bus
        self.agents = agents
        self.node_id = node_id
        self.clock = clock  # when a turn's record waits for its tags (TAG_WAIT_S)
        ss = state.settings.sessions
        self.mood_window = ss.console_mood_window
        self.max_messages = ss.console_max_messages
        self._by_id: dict[str, Conversation] = {}
        self._holders: dict[str, Holder | None] = {}  # read from Redis at resume, until the session attaches
        self._handoffs: dict[str, Waiting] = {}  # the same for a hand-off under way
        self.closing = False  # the node is stopping

    def get(self, session_id: str) -> Conversation | None:
        return self._by_id.get(session_id)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._by_id

    def __iter__(self) -> Iterator[Conversation]:
        return iter(list(self._by_id.values()))

    # -- fan-out and store writes ---------------------------------------------------------------
    def broadcast(self, event: ConsoleEvent) -> None:
        self.agents.deliver_shared(Shared.of(event))  # encoded once for all of them
        self.bus.publish(event)

    def tell(self, agent_id: str, event: ConsoleEvent) -> None:
        """An event for one agent, on whichever node its console is."""
        self.broadcast({**event, FOR_AGENT: agent_id})

    def record(self, conv: Conversation) -> ConsoleRecord:
        """The conversation as stored in Redis (and in the session's record)."""
        return {**conv.to_json(self.mood_window), "streaming": None, "node": self.node_id}

    def save(self, conv: Conversation, force: bool = False) -> None:
        conv.dirty, conv.hold_until, conv.stored_seq = False, 0.0, conv.seq
        if conv.listed:  # an empty conversation is not stored either
            self.bus.save_conversation(self.record(conv), force)

    def _tagged(self, message: Message) -> bool:
        """Every auto-task has tagged this customer message."""
        return set(self.state.tasks.auto_tasks) <= set(message.get("tags", {}))

    def _store_turn(self, conv: Conversation, message: Message | None) -> None:
        """A turn ended (customer `message` answered or forwarded): write it once, with its tags."""
        if message is None or self._tagged(message):
            self.save(conv)
        else:  # written when the tags come, or by the heartbeat after TAG_WAIT_S
            conv.dirty, conv.hold_until = True, self.clock() + TAG_WAIT_S

    def changed(self, conv: Conversation, force: bool = False, save: bool = True) -> None:
        """The conversation's own fields changed: agents get its summary, the store all of it."""
        self.announce(conv)
        if save:
            self.save(conv, force)
        else:  # the heartbeat writes it (clustered)
            conv.dirty = True

    def announce(self, conv: Conversation) -> None:
        """Agents get the conversation's summary (once it is listed)."""
        if conv.listed:
            self.broadcast(agent_events.conversation(conv.summary(self.mood_window)))

    def message_event(self, conv: Conversation, msg: Message, save: bool = True) -> None:
        if conv.seq == 1:  # its first message: agents see the conversation from now on
            self.announce(conv)
        if save:
            self.save(conv)
        mood = conv.mood(self.mood_window)
        self.broadcast(agent_events.message(conv.session_id, bounded(msg), mood, conv.updated_at))

    async def beat(self) -> None:
        """Clustered heartbeat: changed conversations are written, this node's renewed, expired ones
        removed (agents are told)."""
        now = self.clock()
        for conv in list(self._by_id.values()):
            if conv.dirty and conv.hold_until <= now:
                self.save(conv)
        for sid in await self.bus.renew_and_sweep(list(self._by_id)):
            if sid not in self._by_id:
                self.broadcast(agent_events.removed(sid))

    # -- who answers ----------------------------------------------------------------------------
    def holder_of(self, session_id: str) -> Holder | None:
        """The agent answering this session instead of the bot, or None."""
        conv = self._by_id.get(session_id)
        if conv is None:
            return self._holders.get(session_id)
        return conv.agent

    def set_holder(self, session_id: str, agent: Holder | None) -> None:
        """Clustered resume: who holds the session, as Redis says (the node may not know it yet)."""
        conv = self._by_id.get(session_id)
        if conv is not None:
            conv.agent = agent
        else:
            self._holders[session_id] = agent

    def set_handoff(self, session_id: str, waiting: Waiting | None) -> None:
        """Clustered resume: the hand-off the record holds (the conversation may not be here yet)."""
        conv = self._by_id.get(session_id)
        if conv is not None:
            conv.handoff = waiting
        elif waiting is not None:
            self._handoffs[session_id] = waiting

    # -- hooks (the hub's session events, through ConsoleHub.on_event; synchronous) ---------------
    def attached(self, session: Session, client_name: str | None, resumed: bool) -> None:
        conv = self._by_id.get(session.id)
        if conv is None:
            conv = Conversation(session.id, client_name, self.max_messages)
            conv.agent = self._holders.pop(session.id, None)
            conv.handoff = self._handoffs.pop(session.id, None)
            self._by_id[session.id] = conv
            conv.add_history(session.history)
        elif client_name:
            conv.customer = customer_name(client_name, session.id)
        conv.connected = True
        conv.updated_at = time.time()
        self.changed(conv, force=True)  # clustered: this node serves the conversation now

    def detached(self, session: Session) -> None:
        conv = self._by_id.get(session.id)
        if conv is not None and session.connection is None:
            conv.connected = False
            conv.streaming = None
            self.changed(conv, save=False)  # only `connected` changed: the heartbeat writes it

    def drop(self, session: Session) -> bool:
        """The session expired here: whether this node had its conversation."""
        self._holders.pop(session.id, None)
        self._handoffs.pop(session.id, None)
        conv = self._by_id.pop(session.id, None)
        if conv is None:
            return False
        if not self.closing:  # clustered: only if no other node serves it since; a node that
            # stops leaves its conversations in Redis (their sessions resume elsewhere)
            spawn(self._remove(session.id, conv.listed))
        return True

    async def _remove(self, session_id: str, listed: bool) -> None:
        record = await self.bus.conversation(session_id)
        if record is None or record.get("node") == self.node_id:
            self.bus.remove_conversation(session_id)
            if record is not None or listed:
                self.broadcast(agent_events.removed(session_id))

    def user_message(self, session: Session, request_id: str, text: str, to_agent: bool = False) -> None:
        conv = self._by_id.get(session.id)
        if conv is None:
            return
        msg = conv.add(
            {"role": "user", "id": request_id, "text": text, "sentiment": None, "to_agent": to_agent}
        )
        # clustered: a message the bot answers is stored with the reply (bot_done), keeping Redis work
        # off the way to the first token; one for an agent ends its turn
        self.message_event(conv, msg, save=False)
        if to_agent:
            self._store_turn(conv, msg)

    def bot_token(self, session: Session, request_id: str, delta: str) -> None:
        conv = self._by_id.get(session.id)
        if conv is None:
            return
        if conv.streaming is None or conv.streaming["id"] != request_id:
            conv.streaming = {"id": request_id, "text": ""}
        conv.streaming["text"] += delta
        # (the streamed text the conversation keeps is the reply's, bounded by its token limit)
        step = MAX_EVENT_TEXT_BYTES // 4  # characters: a long delta goes as several events
        for i in range(0, len(delta), step):
            piece = clean_text(delta[i : i + step], step, strip=False)
            self.broadcast(agent_events.token(session.id, request_id, piece))

    def bot_done(
        self,
        session: Session,
        request_id: str,
        text: str | None,
        finish_reason: str,
        sources: tuple[Source, ...] = (),
    ) -> None:
        """The bot's turn ended: `text` is the reply (None when it failed or left no text). `sources`: the
        articles it cited (knowledge on), shown to agents with it.
        """
        conv = self._by_id.get(session.id)
        if conv is None:
            return
        if conv.streaming is not None and conv.streaming["id"] == request_id:
            conv.streaming = None
        user = conv.find_user_message(request_id)
        if user is not None and user.get("to_agent"):
            user = None
        if text:
            msg = conv.add({"role": "bot", "id": request_id, "text": text, "finish_reason": finish_reason})
            if sources:
                msg["sources"] = [s.json() for s in sources]
            self.message_event(conv, msg, save=False)
            self._store_turn(conv, user)
            return
        # no reply: the turn leaves no trace here either (as in the session's history)
        dropped = None
        if user is not None:
            conv.remove(user)
            dropped = user["seq"]
            if user["seq"] <= conv.stored_seq:  # the stored record has it: write it again, later
                conv.dirty = True
        self.broadcast(agent_events.stream_end(session.id, request_id, finish_reason, dropped))

    def auto_result(self, session: Session, request_id: str, task: str, output: object) -> None:
        conv = self._by_id.get(session.id)
        msg = conv.find_user_message(request_id) if conv is not None else None
        label = output.get("label") if isinstance(output, dict) else None
        if conv is None or msg is None or label is None:
            return
        msg.setdefault("tags", {})[task] = label
        if task == SENTIMENT_TASK:
            msg["sentiment"] = label
        if session.chat_request != request_id:  # else the reply's end writes it
            if conv.hold_until and self._tagged(msg):
                self.save(conv)  # the turn was waiting for this
            else:
                conv.dirty = True  # the heartbeat writes it
        mood = conv.mood(self.mood_window)
        self.broadcast(agent_events.tag(session.id, msg["seq"], request_id, task, label, mood))

    def action_called(self, session: Session, request_id: str, call: dict[str, object]) -> None:
        """An action ran for the customer message `request_id`: agents see its arguments and outcome."""
        conv = self._by_id.get(session.id)
        if conv is None:
            return
        shown = action_call(call)
        text = f"{shown['action']} {shown['status']}" + (f": {shown['error']}" if shown.get("error") else "")
        msg = conv.add({"role": "action", "id": request_id, "text": text, "call": shown})
        self.broadcast(agent_events.action(session.id, msg, conv.updated_at))

    def reset(self, session: Session) -> None:
        conv = self._by_id.get(session.id)
        if conv is not None:
            conv.clear()
            conv.streaming = None
            conv.updated_at = time.time()
            self.changed(conv)
