"""Many rtserver nodes as one, through Redis (`[cluster] redis_url`; empty = one process, nothing here
runs).

`Cluster` owns the connection to Redis and its health: a background loop pings it every
`cluster.heartbeat_s` and writes this node's heartbeat (`nodes.py`); a call that cannot reach Redis
(connection lost, timed out) marks it down at once, the next good ping marks it up again, so a node
recovers by itself. A command Redis answers with an error (out of memory, a key of the wrong type) is
that operation's failure (`StoreError`): Redis stays up for everything else. What is kept there:
session records (`store.py`), the cluster-wide per-IP limits (`limits.py`), the node registry
(`nodes.py`) and the console's shared state and events (`bus.py`). Every key starts with
`cluster.key_prefix`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NotRequired, TypedDict, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ...config import Settings
from ..seams import StoreUnavailable

log = logging.getLogger("rtserver.cluster")

T = TypeVar("T")


async def stop_task(task: asyncio.Task[Any], timeout_s: float = 5.0) -> None:
    """Cancel a background task and wait for it to end; cancel again while it goes on, for at most
    `timeout_s`. A cancellation that lands inside a Redis call can come out of it as a connection error,
    which a loop that outlives Redis outages catches and carries on from: one cancel is not enough."""
    deadline = time.monotonic() + timeout_s
    while not task.done() and time.monotonic() < deadline:
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    if not task.done():
        log.warning("a cluster task did not stop within %.0f s", timeout_s)


class ClusterHealth(TypedDict):
    """The cluster in /health: this node and Redis, and while Redis answers the nodes' view."""

    node_id: str
    redis: str  # up | down
    reason: NotRequired[str]  # why Redis is down
    nodes_alive: NotRequired[int]
    connections: NotRequired[int]
    sessions: NotRequired[int]
    console_agents: NotRequired[int]
    nodes: NotRequired[list[dict[str, Any]]]


class ClusterUnavailable(StoreUnavailable):
    """Redis cannot be reached (or answered an error): the request gets `unavailable`."""

    def __init__(self, reason: str):
        self.reason = reason  # for logs and /health's detail: it may name the Redis host
        super().__init__()


class StoreError(ClusterUnavailable):
    """Redis answered one operation with an error (OOM, WRONGTYPE, a script error): that operation
    failed, nothing says Redis is down."""

    code = "store_error"

    def __init__(self, reason: str):
        super().__init__(reason)
        self.message = "the session store refused this operation; retry in a moment"
        self.args = (self.message,)


# what says Redis cannot be reached: the node is then down until a ping answers
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)


def node_id_for(settings: Settings) -> str:
    return settings.cluster.node_id or f"{settings.server.host}:{settings.server.port}"


class Cluster:
    """The Redis connection, its health, and the key names."""

    def __init__(
        self,
        settings: Settings,
        client: aioredis.Redis | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        c = settings.cluster
        self.clock = clock
        self.settings = settings
        self.url = c.redis_url
        self.prefix = c.key_prefix
        self.node_id = node_id_for(settings)
        self.heartbeat_s = c.heartbeat_s
        # one quick retry per call (on a fresh connection: a pooled one may have died with a Redis
        # restart), then the caller gets `unavailable`; the health loop is what brings the node back.
        # A bounded pool that waits for a free connection: a burst of 1,000 hellos shares a few dozen
        # connections instead of opening one each.
        pool = aioredis.BlockingConnectionPool.from_url(
            c.redis_url,
            max_connections=c.max_connections,
            timeout=c.op_timeout_s,
            socket_timeout=c.op_timeout_s,
            socket_connect_timeout=c.op_timeout_s,
            retry=Retry(NoBackoff(), 1),
            decode_responses=True,
        )
        self.redis: aioredis.Redis = client or aioredis.Redis(connection_pool=pool)
        self.available = False
        self.reason = "connecting to Redis"
        self.down_since: float | None = clock()
        self.failures = 0  # calls that failed since start (unreachable, or refused by Redis)
        self.command_errors = 0  # of those, commands Redis answered with an error
        self._loop_task: asyncio.Task[None] | None = None
        self._beats: list[Callable[[], Awaitable[None]]] = []  # run after each good ping

    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    # -- health ---------------------------------------------------------------------------------
    def mark_down(self, exc: BaseException) -> None:
        reason = f"Redis at {self.safe_url} unreachable: {type(exc).__name__}: {exc}"
        self.failures += 1
        if self.available:
            log.warning("cluster: %s", reason)
            self.down_since = self.clock()
        self.available, self.reason = False, reason

    def mark_up(self) -> None:
        if not self.available:
            log.info("cluster: Redis at %s reachable (node %s)", self.safe_url, self.node_id)
        self.available, self.reason, self.down_since = True, "", None

    @property
    def safe_url(self) -> str:
        """The URL without a password, for messages."""
        head, sep, tail = self.url.rpartition("@")
        return f"{self.url.split('://')[0]}://…@{tail}" if sep else self.url

    def require(self) -> None:
        if not self.available:
            raise ClusterUnavailable(self.reason)

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run one Redis operation: unreachable → ClusterUnavailable (and Redis marked down); an error
        Redis answered → StoreError for this operation alone."""
        try:
            result = await fn()
        except UNREACHABLE as exc:
            self.mark_down(exc)
            raise ClusterUnavailable(self.reason) from exc
        except RedisError as exc:
            self.failures += 1
            self.command_errors += 1
            log.warning("cluster: Redis refused an operation: %s: %s", type(exc).__name__, exc)
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc
        return result

    def on_beat(self, fn: Callable[[], Awaitable[None]]) -> None:
        self._beats.append(fn)

    async def check(self) -> bool:
        was_down = not self.available
        try:
            if was_down:  # connections from before an outage are dead: start afresh
                await self.redis.connection_pool.disconnect(inuse_connections=False)
            await self.redis.ping()
        except (RedisError, OSError) as exc:
            self.mark_down(exc)
            return False
        self.mark_up()
        return True

    async def beat(self) -> None:
        """One heartbeat: ping Redis and, when it answers, run the beats in order. The health loop
        calls it every `heartbeat_s`; tests call it directly rather than wait for the loop."""
        if not await self.check():
            return
        for beat in self._beats:
            try:
                await beat()
            except StoreError:
                continue  # that beat's own failure, logged by `call`
            except ClusterUnavailable:
                break
            except Exception:
                log.exception("cluster heartbeat failed")

    async def _health_loop(self) -> None:
        while True:
            await self.beat()
            await asyncio.sleep(self.heartbeat_s if self.available else min(0.5, self.heartbeat_s))

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def stop(self) -> None:
        if self._loop_task is not None:
            await stop_task(self._loop_task)
            self._loop_task = None
        try:
            await self.redis.aclose()
        except Exception:  # closing a broken connection: nothing to do
            pass

    def health(self) -> ClusterHealth:
        out: ClusterHealth = {"node_id": self.node_id, "redis": "up" if self.available else "down"}
        if not self.available:
            out["reason"] = self.reason
        return out
