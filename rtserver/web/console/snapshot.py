"""What an agent is sent of the conversations on its own: at login (`console_ready`) the summary of
every listed conversation, then the events held while it was read; a conversation's messages when it
asks for them (`open`), a page at a time."""

from __future__ import annotations

import time

from .. import events
from ..display import clean_text
from ..seams import ConsoleBus, ConsoleEvent, ConsoleRecord, StoreUnavailable, Topology
from . import events as agent_events
from .agents import Agent
from .conversation import MAX_STORED_CHARS, listed, page, summary
from .conversations import Conversations


class Snapshots:
    """Builds and sends the snapshot an agent gets at login and after the bus lost events."""

    def __init__(
        self, conversations: Conversations, bus: ConsoleBus, topology: Topology, idle_timeout_s: float
    ):
        self.conversations = conversations
        self.bus = bus
        self.topology = topology
        self.idle_timeout_s = idle_timeout_s  # a dead node's conversation older than this is gone

    def ready_event(self, agent: Agent, conversations: list[ConsoleRecord]) -> ConsoleEvent:
        window = self.conversations.mood_window
        return agent_events.console_ready(agent.id, agent.name, agent.rejoin, window, conversations)

    async def records(self) -> dict[str, ConsoleRecord]:
        """The summaries of the listed conversations: clustered, read from Redis, with this node's own
        conversations as they are now."""
        node_id = self.conversations.node_id
        try:
            records = await self.bus.conversations()
            alive = await self.topology.alive_nodes()
        except StoreUnavailable:
            records, alive = [], {node_id}
        convs: dict[str, ConsoleRecord] = {}
        horizon = time.time() - self.idle_timeout_s
        for record in records:
            if record.get("node") not in alive:
                record["connected"] = False  # its node is gone: resumable elsewhere, not connected
                if _number(record.get("updated_at")) < horizon:
                    continue
            if listed(record):
                convs[str(record["session_id"])] = summary(record)
        for conv in self.conversations:
            if conv.listed:
                convs[conv.session_id] = conv.summary(self.conversations.mood_window)
            else:  # (its record, if an older one was left in Redis, is not this conversation now)
                convs.pop(conv.session_id, None)
        return convs

    async def send(self, agent: Agent) -> None:
        """After login: the snapshot, then the events held meanwhile — a message the snapshot has is
        not sent again."""
        convs = await self.records()
        held, agent.held = agent.held or [], None
        agent.put(self.ready_event(agent, list(convs.values())))
        for out in held:
            event = out.event
            if event.get("type") == "message" and _has(convs.get(str(event.get("session_id"))), event):
                continue
            agent.send_shared(out)

    async def open(self, agent: Agent, session_id: str, before: object) -> None:
        """An agent's `open`: the conversation's newest messages (older than seq `before` if given)
        within MAX_PAGE_BYTES, and the reply being streamed; `more` when older ones are left."""
        if before is not None and (isinstance(before, bool) or not isinstance(before, int)):
            agent.put(
                events.error_event("invalid_field", "'before' must be a message seq", session_id=session_id)
            )
            return
        conv = self.conversations.get(session_id)
        if conv is not None and conv.listed:
            messages, streaming, seq = list(conv.messages), conv.streaming, conv.seq
        else:
            try:
                record = None if conv is not None else await self.bus.conversation(session_id)
            except StoreUnavailable as exc:
                agent.put(events.error_event(exc.code, exc.message, session_id=session_id))
                return
            if record is None or not listed(record):
                message = f"no live conversation {session_id!r}"
                agent.put(events.error_event("unknown_session", message, session_id=session_id))
                return
            raw = record.get("messages")
            messages = [m for m in raw if isinstance(m, dict)] if isinstance(raw, list) else []
            streaming, seq = None, int(_number(record.get("seq")))
        shown, more = page(messages, before)
        if streaming is not None:
            text = clean_text(streaming["text"], MAX_STORED_CHARS, strip=False)
            streaming = {"id": streaming["id"], "text": text}
        shown_streaming = streaming if before is None else None
        agent.put(agent_events.messages(session_id, shown, more, shown_streaming, seq))


def _has(conv: ConsoleRecord | None, event: ConsoleEvent) -> bool:
    """The snapshot's conversation already has the message this event adds."""
    message = event.get("message")
    seq = message.get("seq", 0) if isinstance(message, dict) else 0
    return conv is not None and _number(seq) <= _number(conv.get("seq", 0))


def _number(value: object) -> float:
    """A number from a stored record (0 when it holds none)."""
    return float(value) if isinstance(value, (int, float)) else 0.0
