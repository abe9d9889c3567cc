"""The seam between one process alone and many nodes as one: `Topology` and the parts it hands out.

`create_app` picks the topology once: `Alone` (everything in this process's memory) or the cluster's
(`cluster/topology.py`, Redis behind the same methods). The hub and the state call these methods and
never ask which one they have.

- `SessionStore`: where the hub's sessions are created, resumed, saved and released;
- `Limits`: the per-client-IP request bucket and the console's failed logins;
- `ConsoleBus`: the console's shared conversations, take-overs and actions (`LocalBus` alone: the
  holder is the conversation's own agent, every conversation is served here);
- `Topology`: the two above, the node's heartbeat, readiness, /health and /metrics figures;
- `StoreUnavailable`: what these raise when the shared store cannot be reached.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypedDict

from ..config import Settings
from .commands import BusCommand, Holder
from .ratelimit import IPRateLimiter
from .session import Session, SessionRegistry

Beat = Callable[[], Awaitable[None]]
ConsoleEvent = dict[str, object]  # an event for the agents' consoles (docs/protocol.md)
ConsoleRecord = dict[str, object]  # a conversation as stored for the agents' snapshots
HolderOf = Callable[[str], "Holder | None"]  # the agent holding a conversation, as this node knows it
OnEvent = Callable[[ConsoleEvent], None]
OnCommand = Callable[[BusCommand], Awaitable[None]]


class StoreUnavailable(Exception):
    """The shared store cannot be reached: the request gets `unavailable`.

    The front doors catch this one; the cluster raises its subclasses."""

    code = "unavailable"

    def __init__(self, message: str = "the session store is unavailable; retry in a moment"):
        self.message = message
        super().__init__(message)


class ClusterFigures(TypedDict):
    """The cluster in /metrics: Redis, the view of the last heartbeat and this node's counters."""

    redis_up: bool
    nodes_alive: int
    sessions: int
    console_agents: int
    session_writes: int
    resumed_from_store: int
    redis_failures: int


@dataclass
class Resumed:
    """A resumed session, the client name its record keeps, and the node that served it last."""

    session: Session
    client: str | None = None
    served_on: str = ""


class NodeFigures(TypedDict):
    """This node's counts in its heartbeat record."""

    connections: int
    sessions: int
    console_agents: int


@dataclass
class NodeView:
    """What the hub tells the topology about this node: its figures and its connected sessions."""

    figures: Callable[[], NodeFigures]
    connected: Callable[[], list[tuple[str, str]]]  # (client IP, session id) of each live connection


class SessionStore(Protocol):
    """The hub's sessions. Clustered calls raise `StoreUnavailable` while Redis is down."""

    def require(self) -> None:
        """Raise when a change could not be stored now (a turn is then refused at once)."""

    async def create(self, client_ip: str, client: str | None) -> Session: ...

    async def resume(self, session_id: str, resume_token: str, client_ip: str) -> Resumed:
        """The session; SessionExpired the same way for every cause."""
        ...

    async def save(self, session: Session, client: str | None) -> None:
        """Store the session's state; a turn is acknowledged only after this returns."""

    async def release(self, session: Session, client_ip: str) -> None:
        """The session's connection has gone (an empty one no longer counts for its IP)."""

    def forget(self, session: Session) -> None:
        """The session has expired on this node."""


class Limits(Protocol):
    ip_limiter: IPRateLimiter  # this node's own buckets (clustered: while Redis is down)

    async def take_ip(self, ip: str) -> float:
        """A token from the client IP's bucket: 0.0 = allowed, else seconds to wait."""
        ...

    async def failed_logins(self, ip: str, limit: int, window_s: float, failed: bool, local: float) -> float:
        """Seconds before this IP's next console login; `local` is this node's own count."""
        ...


class ConsoleBus(Protocol):
    """The console across nodes; the Redis one is `cluster/bus.py`."""

    def publish(self, event: ConsoleEvent) -> None: ...

    def save_conversation(self, record: ConsoleRecord, force: bool = False) -> None: ...

    def remove_conversation(self, session_id: str) -> None: ...

    async def renew_and_sweep(self, session_ids: list[str]) -> list[str]: ...

    async def conversations(self) -> list[ConsoleRecord]: ...

    async def conversation(self, session_id: str) -> ConsoleRecord | None: ...

    async def claim(self, session_id: str, agent: Holder) -> Holder: ...

    async def renew_holds(self, holds: dict[str, str]) -> None: ...

    async def holders(self, session_ids: list[str]) -> list[Holder | None]: ...

    async def release(self, session_id: str, agent_id: str = "") -> bool: ...

    async def holder(self, session_id: str) -> Holder | None: ...

    async def shared_secret(self, name: str) -> str: ...

    async def command(self, node: str, command: BusCommand) -> int: ...

    # the hand-off queue: conversations waiting for a person, oldest first (console/queue.py)
    async def queue_add(self, session_id: str, since: float) -> None: ...

    async def queue_remove(self, session_id: str) -> None: ...

    async def queue_ranks(self, session_ids: list[str]) -> list[int | None]:
        """Each conversation's place in the queue (0 = next), None when it is not in it."""
        ...


class LocalBus:
    """The console alone: nothing is shared, the conversations' own agents are the holders."""

    def __init__(self, holder_of: HolderOf):
        self.holder_of = holder_of
        self._secrets: dict[str, str] = {}
        self._queue: dict[str, float] = {}  # session id -> when it began to wait

    def publish(self, event: ConsoleEvent) -> None:
        return None

    def save_conversation(self, record: ConsoleRecord, force: bool = False) -> None:
        return None

    def remove_conversation(self, session_id: str) -> None:
        return None

    async def renew_and_sweep(self, session_ids: list[str]) -> list[str]:
        return []

    async def conversations(self) -> list[ConsoleRecord]:
        return []  # the console's own are all there are

    async def conversation(self, session_id: str) -> ConsoleRecord | None:
        return None

    async def claim(self, session_id: str, agent: Holder) -> Holder:
        return self.holder_of(session_id) or agent

    async def renew_holds(self, holds: dict[str, str]) -> None:
        return None

    async def holders(self, session_ids: list[str]) -> list[Holder | None]:
        return [self.holder_of(sid) for sid in session_ids]

    async def release(self, session_id: str, agent_id: str = "") -> bool:
        holder = self.holder_of(session_id)
        return holder is not None and holder.id == agent_id

    async def holder(self, session_id: str) -> Holder | None:
        return self.holder_of(session_id)

    async def shared_secret(self, name: str) -> str:
        return self._secrets.setdefault(name, secrets.token_hex(32))

    async def command(self, node: str, command: BusCommand) -> int:
        return 0  # there is no other node

    async def queue_add(self, session_id: str, since: float) -> None:
        self._queue.setdefault(session_id, since)

    async def queue_remove(self, session_id: str) -> None:
        self._queue.pop(session_id, None)

    async def queue_ranks(self, session_ids: list[str]) -> list[int | None]:
        order = {sid: i for i, sid in enumerate(sorted(self._queue, key=lambda s: (self._queue[s], s)))}
        return [order.get(sid) for sid in session_ids]


class Topology(Protocol):
    limits: Limits
    node_id: str

    def registry_cap(self, max_sessions_per_ip: int) -> int:
        """The cap on sessions an IP holds that the local registry keeps (0: counted elsewhere)."""
        ...

    def session_store(self, registry: SessionRegistry) -> SessionStore: ...

    def join(self, node: NodeView) -> None:
        """Start beating for this node (called once, by the hub)."""

    def on_beat(self, beat: Beat) -> None: ...

    def console_bus(
        self,
        on_event: OnEvent,
        on_command: OnCommand,
        on_resubscribed: Callable[[], None],
        holder_of: HolderOf,
    ) -> ConsoleBus:
        """The console's events and actions (across nodes when clustered)."""
        ...

    async def alive_nodes(self) -> set[str]:
        """Ids of the nodes whose heartbeat is recent."""
        ...

    def console_agents(self, here: int) -> int:
        """Agents signed in to the console on every node, `here` of them on this one."""
        ...

    async def leave(self) -> None:
        """A draining node goes out of the view."""

    def down_reason(self) -> str | None:
        """Why the shared store cannot be used now, or None."""
        ...

    async def add_health(self, body: dict[str, object]) -> None: ...

    def figures(self) -> ClusterFigures | None:
        """The cluster's figures for /metrics; None alone."""
        ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...


def ip_limiter_for(settings: Settings) -> IPRateLimiter:
    sec = settings.security
    return IPRateLimiter(sec.ip_rate_limit_per_s, sec.ip_rate_limit_burst)


class LocalSessions:
    """Sessions in this process's registry only."""

    def __init__(self, registry: SessionRegistry):
        self.registry = registry

    def require(self) -> None:
        return None

    async def create(self, client_ip: str, client: str | None) -> Session:
        return self.registry.create(client_ip)

    async def resume(self, session_id: str, resume_token: str, client_ip: str) -> Resumed:
        return Resumed(self.registry.resume(session_id, resume_token))

    async def save(self, session: Session, client: str | None) -> None:
        return None

    async def release(self, session: Session, client_ip: str) -> None:
        return None

    def forget(self, session: Session) -> None:
        return None


class LocalLimits:
    def __init__(self, ip_limiter: IPRateLimiter):
        self.ip_limiter = ip_limiter

    async def take_ip(self, ip: str) -> float:
        return self.ip_limiter.take(ip)

    async def failed_logins(self, ip: str, limit: int, window_s: float, failed: bool, local: float) -> float:
        return local


class Alone:
    """One process: sessions and limits in memory, no heartbeat, nothing that can be down."""

    node_id = ""

    def __init__(self, settings: Settings):
        self.limits: Limits = LocalLimits(ip_limiter_for(settings))

    def registry_cap(self, max_sessions_per_ip: int) -> int:
        return max_sessions_per_ip

    def session_store(self, registry: SessionRegistry) -> SessionStore:
        return LocalSessions(registry)

    def join(self, node: NodeView) -> None:
        return None

    def on_beat(self, beat: Beat) -> None:
        return None

    def console_bus(
        self,
        on_event: OnEvent,
        on_command: OnCommand,
        on_resubscribed: Callable[[], None],
        holder_of: HolderOf,
    ) -> ConsoleBus:
        return LocalBus(holder_of)

    async def alive_nodes(self) -> set[str]:
        return {self.node_id}

    def console_agents(self, here: int) -> int:
        return here

    async def leave(self) -> None:
        return None

    def down_reason(self) -> str | None:
        return None

    async def add_health(self, body: dict[str, object]) -> None:
        return None

    def figures(self) -> ClusterFigures | None:
        return None

    def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
