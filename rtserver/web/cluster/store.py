"""Session records in Redis: what a node needs to resume a session that another node served.

One record per session, one JSON string under `<prefix>:session:<id>`, written whole with one `SET … EX`
(atomic: a reader sees the previous record or the new one, never a mix) and expiring after
`sessions.idle_timeout_s` (the node holding a connected session renews it with its heartbeat). It
holds the history window, a SHA-256 of the resume token (never the token), the client name and
address and counters (the console's conversation is stored once, in its own hash: bus.py). The hub
writes it after every turn before `done`, on reset, after an agent's message and on resume (the
rotated token's hash): what a client was told is stored. A session gets its first record with its
first turn: an empty session is not stored (sessions.py).
A record that does not parse is treated as absent (logged): a bad record never crashes a node.

Each write carries the next version of the record and is refused (`SessionConflict`) when the stored one
is already that new or newer: a node whose copy is stale — the session was resumed on another node
meanwhile — cannot overwrite what that node stored (and acknowledged). Each write also carries a random
write id, so a write is idempotent: a retry whose first try landed (its reply timed out) finds its own
write id and succeeds, and a write whose outcome was unknown (reported as failed) may be replaced by
the same node's next write of that session, which names it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from . import Cluster, ClusterUnavailable

log = logging.getLogger("rtserver.cluster")

VERSION = 1

# KEYS[1] record; ARGV record json, its version, TTL ms, its write id, ',id,id,' of this node's earlier
# writes of unknown outcome → 1 written (or already), 0 the stored version is as new and not ours.
# (JSON escapes the quotes inside strings: the patterns only match the record's own fields.)
SAVE = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local v = tonumber(string.match(cur, '"version":(%d+)'))
  if v and v >= tonumber(ARGV[2]) then
    local w = string.match(cur, '"write_id":"([%w_-]+)"')
    if w == ARGV[4] then return 1 end
    if not w or not string.find(ARGV[5], ',' .. w .. ',', 1, true) then return 0 end
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
"""


class SessionConflict(ClusterUnavailable):
    """The session was resumed (and written) elsewhere since this node's copy: nothing was stored."""

    code = "session_taken_over"

    def __init__(self, session_id: str):
        self.message = "this session continued on another connection; this change was not stored"
        Exception.__init__(self, self.message)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass
class SessionRecord:
    id: str
    token_sha256: str
    version: int  # bumped by every write: a node's cached copy is current when the versions agree
    write_id: str = ""  # random per write (set by `save`): a retried write recognises itself
    history: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    cuts: int = 0
    client: str | None = None
    client_ip: str = ""
    created_at: float = 0.0  # wall clock
    node: str = ""  # the node that wrote it last
    console: dict[str, Any] | None = None  # no longer written (records of older versions may have it)

    def token_matches(self, token: str) -> bool:
        return secrets.compare_digest(self.token_sha256.encode(), token_hash(token).encode())

    def dumps(self) -> str:
        return json.dumps({"v": VERSION, **self.__dict__}, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def loads(cls, raw: str) -> SessionRecord:
        data = json.loads(raw)
        if not isinstance(data, dict) or data.pop("v", None) != VERSION:
            raise ValueError("not a version-1 session record")
        history = data.get("history")
        if not isinstance(history, list) or not all(
            isinstance(m, dict)
            and m.get("role") in ("user", "assistant")
            and isinstance(m.get("content"), str)
            for m in history
        ):
            raise ValueError("bad history")
        record = cls(**data)
        if not isinstance(record.id, str) or not isinstance(record.token_sha256, str):
            raise ValueError("bad id or token hash")
        return record


def _is_message(m: Any) -> bool:
    return (
        isinstance(m, dict) and m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)
    )


class SessionStore:
    def __init__(self, cluster: Cluster, ttl_s: float):
        self.cluster = cluster
        self.ttl_ms = max(1000, int(ttl_s * 1000))
        self.writes = 0
        self._save = cluster.redis.register_script(SAVE)

    def key(self, session_id: str) -> str:
        return self.cluster.key("session", session_id)

    async def save(self, record: SessionRecord, replaces: tuple[str, ...] = ()) -> None:
        """One atomic write (SET with PX, if the stored version is older or one of `replaces`, write ids
        of this node's writes whose outcome was unknown); ClusterUnavailable when Redis fails (the
        write may have landed), SessionConflict when another node wrote this version first."""
        record.write_id = record.write_id or secrets.token_urlsafe(9)
        raw = record.dumps()
        args: list[str | int] = [raw, record.version, self.ttl_ms, record.write_id, f",{','.join(replaces)},"]
        written: Any = await self.cluster.call(lambda: self._save(keys=[self.key(record.id)], args=args))
        if not int(written):
            raise SessionConflict(record.id)
        self.writes += 1

    async def load(self, session_id: str) -> SessionRecord | None:
        raw: Any = await self.cluster.call(lambda: self.cluster.redis.get(self.key(session_id)))
        if raw is None:
            return None
        try:
            return SessionRecord.loads(raw)
        except (ValueError, TypeError) as exc:
            log.warning("session record %s unreadable (%s): treated as expired", session_id, exc)
            return None

    async def delete(self, session_id: str) -> None:
        await self.cluster.call(lambda: self.cluster.redis.delete(self.key(session_id)))

    async def renew(self, session_ids: list[str]) -> None:
        """Keep connected sessions' records alive (the heartbeat): one pipeline."""
        if not session_ids:
            return

        async def run() -> Any:
            async with self.cluster.redis.pipeline(transaction=False) as pipe:
                for sid in session_ids:
                    pipe.pexpire(self.key(sid), self.ttl_ms)
                return await pipe.execute()

        await self.cluster.call(run)
