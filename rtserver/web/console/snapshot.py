"""An agent's snapshot (`console_ready`): every conversation, then the events held while it was read."""

from __future__ import annotations

import time
from typing import Any

from .. import protocol as P
from ..cluster import ClusterUnavailable
from ..seams import ConsoleBus, ConsoleEvent, ConsoleRecord, Topology
from .agents import Agent
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
        return {
            "type": "console_ready",
            "protocol": P.PROTOCOL_VERSION,
            "agent": {"id": agent.id, "name": agent.name},
            "rejoin": agent.rejoin,
            "mood_window": self.conversations.mood_window,
            "conversations": conversations,
        }

    async def records(self) -> dict[str, ConsoleRecord]:
        """Clustered, read from Redis, with this node's own conversations as they are now."""
        node_id = self.conversations.node_id
        try:
            records = await self.bus.conversations()
            alive = await self.topology.alive_nodes()
        except ClusterUnavailable:
            records, alive = [], {node_id}
        convs: dict[str, ConsoleRecord] = {}
        horizon = time.time() - self.idle_timeout_s
        for record in records:
            if record.get("node") not in alive:
                record["connected"] = False  # its node is gone: resumable elsewhere, not connected
                if float(record.get("updated_at") or 0) < horizon:
                    continue
            convs[record["session_id"]] = record
        for conv in self.conversations:
            convs[conv.session_id] = conv.to_json(self.conversations.mood_window)
        return convs

    async def send(self, agent: Agent) -> None:
        """After login: the snapshot, then the events held meanwhile — a message the snapshot has is
        not sent again."""
        convs = await self.records()
        held, agent.held = agent.held or [], None
        agent.put(self.ready_event(agent, list(convs.values())))
        for event in held:
            if event.get("type") == "message" and _has(convs.get(event.get("session_id", "")), event):
                continue
            agent.put(event)


def _has(conv: dict[str, Any] | None, event: ConsoleEvent) -> bool:
    """The snapshot's conversation already has the message this event adds."""
    return conv is not None and event["message"].get("seq", 0) <= conv.get("seq", 0)
