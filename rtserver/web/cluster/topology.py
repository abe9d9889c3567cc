"""Many nodes as one: the `Topology` of `seams.py` over Redis (`cluster.redis_url`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from ...config import Settings
from ..seams import (
    Beat,
    ClusterFigures,
    HolderOf,
    Limits,
    NodeView,
    OnCommand,
    OnEvent,
    Resumed,
    SessionStore,
    ip_limiter_for,
)
from ..session import Session, SessionRegistry
from . import Cluster, ClusterUnavailable
from .bus import ConsoleBus
from .limits import ClusterLimits
from .nodes import NO_VIEW, NodeRegistry
from .sessions import ClusterSessions
from .store import SessionStore as RecordStore


class SharedLimits:
    """The per-IP bucket and failed console logins counted in Redis, this node's own while it is down
    (the limit then holds per node rather than not at all)."""

    def __init__(self, cluster: Cluster, limits: ClusterLimits, settings: Settings):
        self.cluster = cluster
        self.shared = limits
        self.ip_limiter = ip_limiter_for(settings)

    async def take_ip(self, ip: str) -> float:
        if self.cluster.available and self.shared.rate > 0:
            with contextlib.suppress(ClusterUnavailable):
                return await self.shared.take(ip)
        return self.ip_limiter.take(ip)

    async def failed_logins(self, ip: str, limit: int, window_s: float, failed: bool, local: float) -> float:
        try:
            return await self.shared.login_failures(ip, limit, window_s, failed)
        except ClusterUnavailable:
            return local


class ClusterSessionStore:
    """The hub's `SessionStore` when clustered: `ClusterSessions` behind the seam's methods."""

    def __init__(self, sessions: ClusterSessions):
        self.sessions = sessions

    def require(self) -> None:
        self.sessions.cluster.require()

    async def create(self, client_ip: str, client: str | None) -> Session:
        return await self.sessions.create(client_ip, client)

    async def resume(self, session_id: str, resume_token: str, client_ip: str) -> Resumed:
        session, record = await self.sessions.resume(session_id, resume_token, client_ip)
        if record is None:  # never stored: it was served here
            return Resumed(session)
        return Resumed(session, record.client, record.node or "")

    async def save(self, session: Session, client: str | None) -> None:
        await self.sessions.save(session, client)

    async def release(self, session: Session, client_ip: str) -> None:
        with contextlib.suppress(ClusterUnavailable):  # else the slot's lease runs out
            await self.sessions.release(session, client_ip)

    def forget(self, session: Session) -> None:
        self.sessions.forget(session)


class Clustered:
    """Sessions, limits, heartbeats and the node registry in Redis, shared by every node."""

    def __init__(self, settings: Settings):
        sec = settings.security
        self.cluster = Cluster(settings)
        self.node_id = self.cluster.node_id
        self.records = RecordStore(self.cluster, settings.sessions.idle_timeout_s)
        self.shared_limits = ClusterLimits(
            self.cluster,
            sec.ip_rate_limit_per_s,
            sec.ip_rate_limit_burst,
            sec.max_sessions_per_ip,
            hold_s=settings.sessions.idle_timeout_s,
        )
        self.limits: Limits = SharedLimits(self.cluster, self.shared_limits, settings)
        self.sessions: ClusterSessions | None = None  # set by session_store (the hub's registry)
        self.nodes: NodeRegistry | None = None  # set by join
        self.bus: ConsoleBus | None = None  # set by console_bus

    def registry_cap(self, max_sessions_per_ip: int) -> int:
        # counted in Redis across the nodes (limits.py); the node's own cap sheds an address's empty
        # sessions here, which Redis does not hold
        return max_sessions_per_ip

    def session_store(self, registry: SessionRegistry) -> SessionStore:
        self.sessions = ClusterSessions(self.cluster, self.records, self.shared_limits, registry)
        return ClusterSessionStore(self.sessions)

    def join(self, node: NodeView) -> None:
        self.nodes = NodeRegistry(self.cluster, node.figures, lambda: [sid for _, sid in node.connected()])
        self.cluster.on_beat(self.nodes.beat)

        async def renew() -> None:  # connected sessions' records and per-IP slots stay alive
            connected = node.connected()
            await self.records.renew([sid for _, sid in connected])
            if self.shared_limits.max_sessions_per_ip:
                await self.shared_limits.renew([(ip, sid, self._stored(sid)) for ip, sid in connected])

        self.cluster.on_beat(renew)

    def _stored(self, session_id: str) -> bool:
        """Whether the session has a record (it then counts for its IP as long as the record lives)."""
        session = self.sessions.registry.sessions.get(session_id) if self.sessions is not None else None
        return session is not None and session.version > 0

    def on_beat(self, beat: Beat) -> None:
        self.cluster.on_beat(beat)

    def console_bus(
        self,
        on_event: OnEvent,
        on_command: OnCommand,
        on_resubscribed: Callable[[], None],
        holder_of: HolderOf,
    ) -> ConsoleBus:
        self.bus = ConsoleBus(self.cluster, on_event, on_command, on_resubscribed)
        return self.bus

    async def alive_nodes(self) -> set[str]:
        return await self.nodes.alive() if self.nodes is not None else set()

    def console_agents(self, here: int) -> int:
        """The other nodes' agents as of the last heartbeat, and this node's now."""
        view = self.nodes.last_view if self.nodes is not None else NO_VIEW
        nodes = [n for n in view["nodes"] if n.get("node_id") != self.node_id]
        others = sum(int(n.get("console_agents", 0)) for n in nodes)
        return others + here

    async def leave(self) -> None:
        if self.nodes is not None:
            with contextlib.suppress(ClusterUnavailable):
                await self.nodes.leave()

    def down_reason(self) -> str | None:
        return None if self.cluster.available else self.cluster.reason

    async def add_health(self, body: dict[str, Any]) -> None:
        cluster = self.cluster.health()
        if self.cluster.available and self.nodes is not None:
            with contextlib.suppress(ClusterUnavailable):
                cluster = {**cluster, **await self.nodes.view()}
        body["cluster"] = cluster

    def figures(self) -> ClusterFigures | None:
        view = self.nodes.last_view if self.nodes is not None else NO_VIEW
        return {
            "redis_up": self.cluster.available,
            "nodes_alive": view["nodes_alive"],
            "sessions": view["sessions"],
            "console_agents": view["console_agents"],
            "session_writes": self.records.writes,
            "resumed_from_store": self.sessions.resumed_elsewhere if self.sessions is not None else 0,
            "redis_failures": self.cluster.failures,
        }

    def start(self) -> None:
        self.cluster.start()  # pings Redis from now on: /ready says why not while it is down
        if self.bus is not None:
            self.bus.start()

    async def stop(self) -> None:
        if self.bus is not None:
            await self.bus.stop()
        await self.cluster.stop()
