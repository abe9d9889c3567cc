"""This node's console connections, and the fan-out of events to the logged-in ones."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

from starlette.websockets import WebSocket

from .. import events
from ..commands import Holder
from ..connection import Close, QueuedConnection
from ..seams import ConsoleEvent

log = logging.getLogger("rtserver.console")


class Agent(QueuedConnection):
    """One console connection; an agent once it has logged in."""

    def __init__(self, ws: WebSocket, queue_size: int):
        super().__init__(ws, queue_size)
        self.id = ""
        self.name = ""
        self.logged_in = False
        self.held: list[ConsoleEvent] | None = None  # events held while its snapshot is read from Redis
        self.rejoin: str | None = None  # given back at a later login, it restores this id

    def holder(self) -> Holder:
        return Holder(self.id, self.name)

    def put(self, event: ConsoleEvent) -> None:
        """Queue an event; an agent that does not read is closed (it resyncs from a snapshot)."""
        if self.stopping.is_set():
            return
        if self.held is not None and event.get("type") != "console_ready":
            self.held.append(event)
            return
        try:
            self.queue.put_nowait(events.dumps(event))
        except asyncio.QueueFull:
            log.warning("closing console connection of %s: not reading", self.name)
            self.stop(Close.SLOW_CLIENT, "slow client")


class Agents:
    """The console connections of this node."""

    def __init__(self) -> None:
        self._all: set[Agent] = set()

    def __iter__(self) -> Iterator[Agent]:
        return iter(list(self._all))

    def add(self, agent: Agent) -> None:
        self._all.add(agent)

    def discard(self, agent: Agent) -> None:
        self._all.discard(agent)

    def count(self) -> int:
        return sum(1 for a in self._all if a.logged_in)

    def online(self, agent_id: str) -> bool:
        """Some console of this agent id is logged in here."""
        return any(a.id == agent_id and a.logged_in for a in self._all)

    def deliver(self, event: ConsoleEvent) -> None:
        """To this node's agents (events of other nodes come in here from the bus)."""
        for agent in list(self._all):
            if agent.logged_in:
                agent.put(event)
