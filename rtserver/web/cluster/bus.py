"""The agent console across nodes: conversation records, live events, take-over, commands to a node.

- Conversation records: one hash `<prefix>:console:convs`, field = session id, value = the
  conversation as the console shows it (`Conversation.to_json` + the node serving it), written when a
  conversation changes (not per token; a turn is written once, at its end). Each entry expires
  (`<prefix>:console:convs:expiry`, a zset of deadlines) `sessions.idle_timeout_s` after its last
  write or the last heartbeat of the node serving it; every node's heartbeat removes expired entries.
  An agent's snapshot on connect is read from it. A node writes only the records of conversations it
  serves (a Lua check on the stored `node`), except when a customer attaches — the node it attached to
  takes the record over.
- Live events go through Redis **pub/sub** (channel `<prefix>:console:events`), not streams: they are
  worth something only while they happen (tokens above all), every node wants all of them, and what an
  agent must not miss is in the records — a node that lost Redis and resubscribes sends its agents a
  fresh snapshot. Streams would add replay we do not need at the price of trimming and consumer state.
- Take-over: `SET <prefix>:console:holder:<session> NX` in a Lua script — of two agents racing, exactly
  one wins; hand-back deletes it only for its holder. The key expires after three missed heartbeats of
  the holding agent's node, which renews it: when that node dies, the node serving the conversation
  sees the key gone at its next heartbeat and hands the conversation back to the bot. Actions on a
  conversation served by another node are sent to that node on its own channel
  `<prefix>:console:node:<id>` and applied there (the customer's connection lives there).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

from ..commands import BusCommand, Holder, parse_command
from ..seams import ConsoleEvent, ConsoleRecord, OnCommand, OnEvent
from . import Cluster, ClusterUnavailable, stop_task

log = logging.getLogger("rtserver.cluster")

# KEYS[1] holder key; ARGV agent json, TTL ms → the holder json after the call
CLAIM = """
local cur = redis.call('GET', KEYS[1])
if not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return ARGV[1]
end
return cur
"""

# KEYS holder keys; ARGV TTL ms, then the agent id of each key in KEYS' order → keys renewed
RENEW_HOLDS = """
local n = 0
for i, key in ipairs(KEYS) do
  local cur = redis.call('GET', key)
  if cur and cjson.decode(cur)['id'] == ARGV[i + 1] then
    redis.call('PEXPIRE', key, ARGV[1])
    n = n + 1
  end
end
return n
"""

# KEYS[1] holder key; ARGV agent id ('' = any) → 1 released, 0 not the holder
RELEASE = """
local cur = redis.call('GET', KEYS[1])
if not cur then return 0 end
if ARGV[1] ~= '' and cjson.decode(cur)['id'] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""

# KEYS[1] conversations hash, KEYS[2] their expiry (zset); ARGV session id, record json, node, force
# ('1': take the record over), TTL s
SAVE_CONV = """
if ARGV[4] ~= '1' then
  local cur = redis.call('HGET', KEYS[1], ARGV[1])
  if cur and cjson.decode(cur)['node'] ~= ARGV[3] then return 0 end
end
local t = redis.call('TIME')
local ttl = tonumber(ARGV[5])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], tonumber(t[1]) + ttl, ARGV[1])
redis.call('EXPIRE', KEYS[1], ttl + 60)
redis.call('EXPIRE', KEYS[2], ttl + 60)
return 1
"""

# KEYS[1] conversations hash, KEYS[2] their expiry; ARGV session id, node → 1 removed (only this node's)
REMOVE_CONV = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur and cjson.decode(cur)['node'] == ARGV[2] then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 1
end
return 0
"""

# KEYS[1] conversations hash, KEYS[2] their expiry; ARGV TTL s, then the ids of the conversations this
# node serves (heartbeat) → their expiry pushed back, and up to 200 expired ones removed: their ids
RENEW_SWEEP_CONVS = """
local t = redis.call('TIME')
local now = tonumber(t[1])
local ttl = tonumber(ARGV[1])
for i = 2, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then redis.call('ZADD', KEYS[2], now + ttl, ARGV[i]) end
end
if #ARGV > 1 then
  redis.call('EXPIRE', KEYS[1], ttl + 60)
  redis.call('EXPIRE', KEYS[2], ttl + 60)
end
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 200)
for _, sid in ipairs(gone) do
  redis.call('HDEL', KEYS[1], sid)
  redis.call('ZREM', KEYS[2], sid)
end
return gone
"""


class ConsoleBus:
    def __init__(
        self,
        cluster: Cluster,
        on_event: OnEvent,
        on_command: OnCommand,
        on_resubscribed: Callable[[], None],
    ):
        self.cluster = cluster
        self.on_event = on_event  # an event from another node, for this node's agents
        self.on_command = on_command  # an action for a conversation this node serves
        self.on_resubscribed = on_resubscribed  # events may have been missed: resync the agents
        self.events_channel = cluster.key("console", "events")
        self.convs_key = cluster.key("console", "convs")
        self.expiry_key = cluster.key("console", "convs", "expiry")
        self.queue_key = cluster.key("console", "queue")  # zset: waiting for a person, by since
        # a conversation lives as long as its session record: renewed while its node serves it
        self.conv_ttl_s = max(1, int(cluster.settings.sessions.idle_timeout_s + 0.999))
        self.conversation_writes = 0
        r = cluster.redis
        self._claim = r.register_script(CLAIM)
        self._renew_holds = r.register_script(RENEW_HOLDS)
        self.hold_ttl_ms = int((cluster.heartbeat_s * 3 + 1) * 1000)
        self._release = r.register_script(RELEASE)
        self._save = r.register_script(SAVE_CONV)
        self._remove = r.register_script(REMOVE_CONV)
        self._renew_sweep = r.register_script(RENEW_SWEEP_CONVS)
        self._task: asyncio.Task[None] | None = None
        self._writes: set[asyncio.Task[None]] = set()
        self.subscribed = asyncio.Event()
        # events and record writes leave in the order they happened, in batches, from one task: the
        # hooks are synchronous, and separate tasks on a connection pool would reorder tokens
        self._outbox: asyncio.Queue[tuple[str, list[Any]]] = asyncio.Queue(maxsize=100_000)
        self._publisher: asyncio.Task[None] | None = None
        self.dropped = 0  # events not sent: Redis down, or the outbox full

    def node_channel(self, node: str) -> str:
        return self.cluster.key("console", "node", node)

    def holder_key(self, session_id: str) -> str:
        return self.cluster.key("console", "holder", session_id)

    # -- background writes (the hooks are synchronous) ------------------------------------------
    def _spawn(self, coro: Awaitable[Any]) -> None:
        async def run() -> None:
            with contextlib.suppress(ClusterUnavailable):
                await coro

        task = asyncio.get_running_loop().create_task(run())
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    def _post(self, kind: str, args: list[Any]) -> None:
        if not self.cluster.available:
            self.dropped += 1
            return
        try:
            self._outbox.put_nowait((kind, args))
        except asyncio.QueueFull:
            self.dropped += 1

    def publish(self, event: ConsoleEvent) -> None:
        self._post(
            "publish", [json.dumps({"node": self.cluster.node_id, "event": event}, ensure_ascii=False)]
        )

    def save_conversation(self, record: ConsoleRecord, force: bool = False) -> None:
        raw = json.dumps(record, ensure_ascii=False)
        self.conversation_writes += 1
        args = [record["session_id"], raw, self.cluster.node_id, "1" if force else "0", self.conv_ttl_s]
        self._post("save", args)

    async def _publish_forever(self) -> None:
        while True:
            batch = [await self._outbox.get()]
            while not self._outbox.empty() and len(batch) < 512:
                batch.append(self._outbox.get_nowait())

            async def send(batch: list[tuple[str, list[Any]]] = batch) -> Any:
                async with self.cluster.redis.pipeline(transaction=False) as pipe:
                    for kind, args in batch:
                        if kind == "publish":
                            pipe.publish(self.events_channel, args[0])
                        else:
                            await self._save(keys=[self.convs_key, self.expiry_key], args=args, client=pipe)
                    return await pipe.execute()

            try:
                await self.cluster.call(send)
            except ClusterUnavailable:
                self.dropped += len(batch)

    def remove_conversation(self, session_id: str) -> None:
        if not self.cluster.available:
            return
        args = [session_id, self.cluster.node_id]
        keys = [self.convs_key, self.expiry_key]
        self._spawn(self.cluster.call(lambda: self._remove(keys=keys, args=args)))

    async def renew_and_sweep(self, session_ids: list[str]) -> list[str]:
        """Heartbeat: the conversations this node serves stay; expired ones (their node died, or never
        removed them) go. The ids removed, for the agents."""
        keys = [self.convs_key, self.expiry_key]
        args: list[str | int] = [self.conv_ttl_s, *session_ids]
        gone: Any = await self.cluster.call(lambda: self._renew_sweep(keys=keys, args=args))
        removed = [sid for sid in gone if isinstance(sid, str)]
        if removed:  # an expired conversation waits for nobody
            await self.cluster.call(lambda: self.cluster.redis.zrem(self.queue_key, *removed))
        return removed

    # -- reads and atomic actions ---------------------------------------------------------------
    async def conversations(self) -> list[ConsoleRecord]:
        raw: Any = await self.cluster.call(lambda: self.cluster.redis.hgetall(self.convs_key))
        out: list[ConsoleRecord] = []
        for value in raw.values():
            try:
                record = json.loads(value)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("session_id"), str):
                out.append(record)
        return out

    async def conversation(self, session_id: str) -> ConsoleRecord | None:
        raw: Any = await self.cluster.call(lambda: self.cluster.redis.hget(self.convs_key, session_id))
        try:
            record = json.loads(raw) if raw else None
        except ValueError:
            return None
        return record if isinstance(record, dict) else None

    async def claim(self, session_id: str, agent: Holder) -> Holder:
        """Take the conversation for `agent` unless someone holds it: the holder afterwards."""
        raw: Any = await self.cluster.call(
            lambda: self._claim(
                keys=[self.holder_key(session_id)], args=[json.dumps(agent.to_json()), self.hold_ttl_ms]
            )
        )
        # an unreadable key is someone else's: the claim did not replace it
        return _holder(raw) or Holder("", "another agent")

    async def renew_holds(self, holds: dict[str, str]) -> None:
        """Heartbeat: session id -> agent id of the take-overs this node's agents hold stay alive."""
        if holds:
            keys = [self.holder_key(sid) for sid in holds]
            args: list[str | int] = [self.hold_ttl_ms, *holds.values()]
            await self.cluster.call(lambda: self._renew_holds(keys=keys, args=args))

    async def holders(self, session_ids: list[str]) -> list[Holder | None]:
        """The holder of each conversation (None: nobody holds it, or its holder's node died)."""
        keys = [self.holder_key(sid) for sid in session_ids]
        raws: Any = await self.cluster.call(lambda: self.cluster.redis.mget(keys))
        return [_holder(raw) for raw in raws]

    async def release(self, session_id: str, agent_id: str = "") -> bool:
        done: Any = await self.cluster.call(
            lambda: self._release(keys=[self.holder_key(session_id)], args=[agent_id])
        )
        return bool(int(done))

    async def holder(self, session_id: str) -> Holder | None:
        raw: Any = await self.cluster.call(lambda: self.cluster.redis.get(self.holder_key(session_id)))
        return _holder(raw)

    async def shared_secret(self, name: str) -> str:
        """A random secret all nodes share (created by the first node that asks)."""
        key = self.cluster.key("console", "secret", name)

        async def run() -> Any:
            await self.cluster.redis.set(key, secrets.token_hex(32), nx=True)
            return await self.cluster.redis.get(key)

        value: Any = await self.cluster.call(run)
        if not isinstance(value, str) or not value:
            raise ClusterUnavailable("no shared console secret in Redis")
        return value

    async def command(self, node: str, command: BusCommand) -> int:
        """Send an action to the node serving a conversation: how many nodes received it (0: none)."""
        raw = json.dumps(command.to_json(), ensure_ascii=False)
        n: Any = await self.cluster.call(lambda: self.cluster.redis.publish(self.node_channel(node), raw))
        return int(n)

    # -- the hand-off queue ---------------------------------------------------------------------
    async def queue_add(self, session_id: str, since: float) -> None:
        """The conversation waits for a person from `since` on (kept if it waits already)."""
        ttl = self.conv_ttl_s + 60

        async def run() -> Any:
            async with self.cluster.redis.pipeline(transaction=True) as pipe:
                pipe.zadd(self.queue_key, {session_id: since}, nx=True)
                pipe.expire(self.queue_key, ttl)
                return await pipe.execute()

        await self.cluster.call(run)

    async def queue_remove(self, session_id: str) -> None:
        await self.cluster.call(lambda: self.cluster.redis.zrem(self.queue_key, session_id))

    async def queue_ranks(self, session_ids: list[str]) -> list[int | None]:
        async def run() -> Any:
            async with self.cluster.redis.pipeline(transaction=False) as pipe:
                for sid in session_ids:
                    pipe.zrank(self.queue_key, sid)
                return await pipe.execute()

        ranks: Any = await self.cluster.call(run)
        return [int(r) if isinstance(r, int) else None for r in ranks]

    # -- the subscription -----------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._listen_forever())
            self._publisher = loop.create_task(self._publish_forever())

    async def stop(self) -> None:
        for task in [self._task, self._publisher, *self._writes]:
            if task is not None:
                await stop_task(task)
        self._task = self._publisher = None

    async def _listen_forever(self) -> None:
        first = True
        while True:
            try:
                await self._listen(first)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                self.subscribed.clear()
                self.cluster.mark_down(exc)
            except Exception:
                self.subscribed.clear()
                log.exception("console subscription failed")
            first = False
            await asyncio.sleep(0.5)

    async def _listen(self, first: bool) -> None:
        pubsub = self.cluster.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self.events_channel, self.node_channel(self.cluster.node_id))
            self.subscribed.set()
            if not first:
                self.on_resubscribed()
            while True:
                message = await pubsub.get_message(timeout=1.0)
                if message is None:
                    continue
                await self._dispatch(message)
        finally:
            close: Callable[[], Awaitable[object]] = pubsub.aclose  # (redis leaves it untyped)
            with contextlib.suppress(Exception):
                await close()

    async def _dispatch(self, message: dict[str, Any]) -> None:
        channel = message.get("channel")
        try:
            data = json.loads(message["data"])
        except (ValueError, TypeError):
            log.warning("console bus: unreadable message on %s", channel)
            return
        try:
            if channel == self.events_channel:
                self._event(data)
            else:
                await self._command(data, channel)
        except Exception:  # one bad message never stops the subscription
            log.exception("console bus: handling a message failed")

    def _event(self, data: object) -> None:
        """Another node's event, for this node's agents."""
        if isinstance(data, dict) and data.get("node") != self.cluster.node_id:
            event = data.get("event")
            if isinstance(event, dict):
                self.on_event(event)

    async def _command(self, data: object, channel: object) -> None:
        """An action for this node, read once: a malformed one is dropped."""
        command = parse_command(data)
        if command is None:
            log.warning("console bus: malformed command on %s dropped", channel)
            return
        await self.on_command(command)


def _holder(raw: object) -> Holder | None:
    """The holder a key's JSON names; None when there is none or it cannot be read."""
    if not isinstance(raw, str | bytes) or not raw:
        return None
    try:
        return Holder.from_json(json.loads(raw))
    except ValueError:
        return None
