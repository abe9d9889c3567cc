"""The node registry: which nodes are alive and which live connections each one holds.

Every `cluster.heartbeat_s` a node writes, in one MULTI: its score in `<prefix>:nodes` (a sorted set by
last heartbeat), its figures in `<prefix>:node:<id>` (connections, sessions, console agents, start
time) and the ids of the sessions connected to it in `<prefix>:live:<id>`, both expiring after three
missed heartbeats. A node that misses them is dead: it drops out of the view, and its sessions —
records already in Redis — are resumable on any node at once (their resume never waited for it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypedDict

from ..seams import NodeFigures
from . import Cluster


class ClusterView(TypedDict):
    """The live nodes' records (as each wrote it) and the cluster's totals."""

    nodes_alive: int
    connections: int
    sessions: int
    console_agents: int
    nodes: list[dict[str, Any]]


NO_VIEW = ClusterView(nodes_alive=0, connections=0, sessions=0, console_agents=0, nodes=[])


class NodeRegistry:
    def __init__(
        self,
        cluster: Cluster,
        figures: Callable[[], NodeFigures],
        live: Callable[[], list[str]],
        clock: Callable[[], float] = time.time,
    ):
        self.cluster = cluster
        self.clock = clock  # wall time: heartbeats are compared across nodes
        self.figures = figures  # this node's counts: connections, sessions, agents
        self.live = live  # ids of the sessions connected here
        self.started_at = self.clock()
        self.ttl_s = max(1, int(cluster.heartbeat_s * 3 + 0.999))
        self.last_view = NO_VIEW  # the cluster as of the last heartbeat (for /metrics)
        self.left = False  # draining: no more heartbeats

    async def beat(self) -> None:
        if self.left:
            return
        c = self.cluster
        record = json.dumps(
            {
                "node_id": c.node_id,
                "started_at": self.started_at,
                "heartbeat_at": self.clock(),
                **self.figures(),
            }
        )
        live = self.live()

        async def run() -> Any:
            async with c.redis.pipeline(transaction=True) as pipe:
                pipe.zadd(c.key("nodes"), {c.node_id: self.clock()})
                pipe.set(c.key("node", c.node_id), record, ex=self.ttl_s)
                pipe.delete(c.key("live", c.node_id))
                if live:
                    pipe.sadd(c.key("live", c.node_id), *live)
                    pipe.expire(c.key("live", c.node_id), self.ttl_s)
                return await pipe.execute()

        await c.call(run)
        self.last_view = await self.view()

    async def leave(self) -> None:
        """A draining node takes itself out of the view."""
        self.left = True
        c = self.cluster

        async def run() -> Any:
            async with c.redis.pipeline(transaction=True) as pipe:
                pipe.zrem(c.key("nodes"), c.node_id)
                pipe.delete(c.key("node", c.node_id), c.key("live", c.node_id))
                return await pipe.execute()

        await c.call(run)

    async def view(self) -> ClusterView:
        """The live nodes with their figures, and the cluster's totals."""
        c = self.cluster
        dead_before = self.clock() - self.ttl_s
        await c.call(lambda: c.redis.zremrangebyscore(c.key("nodes"), "-inf", dead_before))
        ids: Any = await c.call(lambda: c.redis.zrange(c.key("nodes"), 0, -1))
        raws: Any = await c.call(lambda: c.redis.mget([c.key("node", i) for i in ids])) if ids else []
        nodes: list[dict[str, Any]] = []
        for raw in raws:
            if raw is None:
                continue
            try:
                nodes.append(json.loads(raw))
            except ValueError:
                continue

        def total(key: str) -> int:
            return sum(int(n.get(key, 0)) for n in nodes)

        return {
            "nodes_alive": len(nodes),
            "connections": total("connections"),
            "sessions": total("sessions"),
            "console_agents": total("console_agents"),
            "nodes": nodes,
        }

    async def alive(self) -> set[str]:
        """Ids of the nodes whose heartbeat is recent."""
        c = self.cluster
        ids: Any = await c.call(
            lambda: c.redis.zrangebyscore(c.key("nodes"), self.clock() - self.ttl_s, "+inf")
        )
        return set(ids)

    async def holder(self, session_id: str) -> str | None:
        """The node whose live set holds this session, if any."""
        c = self.cluster
        ids: Any = await c.call(lambda: c.redis.zrange(c.key("nodes"), 0, -1))
        for node in ids:
            key = c.key("live", node)
            member: Any = await c.call(lambda key=key: c.redis.sismember(key, session_id))  # type: ignore[misc]
            if member:
                return str(node)
        return None
