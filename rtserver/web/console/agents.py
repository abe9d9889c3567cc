"""This node's console connections, and the fan-out of events to the logged-in ones.

An event for every agent is encoded once (`Shared`), whatever the number of agents. A `conversation`
event is a state: one still queued for an agent is replaced by the newer one, so a customer who comes
and goes in a loop costs a slow agent one queued event, not one per visit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from starlette.websockets import WebSocket

from .. import events
from ..commands import Holder
from ..connection import Close, QueuedConnection
from ..seams import ConsoleEvent

log = logging.getLogger("rtserver.console")

STATE = "\0"  # starts a queue entry naming a session whose newest state is in `Agent.states` (no JSON does)
FOR_AGENT = "for_agent"  # an event for the agent id it names alone (on any node)


@dataclass(frozen=True)
class Shared:
    """One event as agents are sent it: encoded once; `state` is the session id of a conversation state
    (a newer one replaces it in a queue), else None."""

    event: ConsoleEvent
    raw: str
    state: str | None = None

    @classmethod
    def of(cls, event: ConsoleEvent) -> Shared:
        conv = event.get("conversation") if event.get("type") == "conversation" else None
        state = conv.get("session_id") if isinstance(conv, dict) else None
        return cls(event, events.dumps(event), state if isinstance(state, str) else None)


class Agent(QueuedConnection):
    """One console connection; an agent once it has logged in."""

    def __init__(self, ws: WebSocket, queue_size: int):
        super().__init__(ws, queue_size)
        self.id = ""
        self.name = ""
        self.logged_in = False
        self.held: list[Shared] | None = None  # events held while its snapshot is read from Redis
        self.rejoin: str | None = None  # given back at a later login, it restores this id
        self.states: dict[str, str] = {}  # session id -> its newest state event, queued, not yet sent

    def holder(self) -> Holder:
        return Holder(self.id, self.name)

    def put(self, event: ConsoleEvent) -> None:
        """Queue an event for this agent alone."""
        self.send_shared(Shared(event, events.dumps(event)))

    def send_shared(self, out: Shared) -> None:
        """Queue an event; an agent that does not read is closed (it resyncs from a snapshot)."""
        if self.stopping.is_set():
            return
        if self.held is not None and out.event.get("type") != "console_ready":
            self.held.append(out)
            return
        if out.state is not None and out.state in self.states:  # still queued: the newer one goes
            self.states[out.state] = out.raw
            return
        try:
            self.queue.put_nowait(out.raw if out.state is None else STATE + out.state)
        except asyncio.QueueFull:
            log.warning("closing console connection of %s: not reading", self.name)
            self.stop(Close.SLOW_CLIENT, "slow client")
            return
        if out.state is not None:
            self.states[out.state] = out.raw

    async def writer(self) -> None:
        try:
            while True:
                entry = await self.queue.get()
                if entry.startswith(STATE):
                    entry = self.states.pop(entry[1:])
                await self.ws.send_text(entry)
        except asyncio.CancelledError:
            raise
        except Exception:  # client gone
            self.stop()


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
        self.deliver_shared(Shared.of(event))

    def deliver_shared(self, out: Shared) -> None:
        """To this node's logged-in agents, or to the one agent id the event is for."""
        only = out.event.get(FOR_AGENT)
        for agent in list(self._all):
            if agent.logged_in and (only is None or agent.id == only):
                agent.send_shared(out)
