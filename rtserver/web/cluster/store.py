"""Session records in Redis: what a node needs to resume a session that another node served.

One record per session, one JSON string under `<prefix>:session:<id>`, written whole with one `SET … EX`
(atomic: a reader sees the previous record or the new one, never a mix) and expiring after
`sessions.idle_timeout_s` (the node holding a connected session renews it with its heartbeat). It
holds the history window, a SHA-256 of the resume token (never the token), the client name and
address, counters, and the console's conversation record. The hub writes it when a session starts,
after every turn before `done`, on reset and after an agent's message: what a client was told is stored.
A record that does not parse is treated as absent (logged): a bad record never crashes a node.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from . import Cluster

log = logging.getLogger("rtserver.cluster")

VERSION = 1


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass
class SessionRecord:
    id: str
    token_sha256: str
    version: int  # bumped by every write: a node's cached copy is current when the versions agree
    history: list[dict] = field(default_factory=list)
    turns: int = 0
    cuts: int = 0
    client: str | None = None
    client_ip: str = ""
    created_at: float = 0.0  # wall clock
    node: str = ""  # the node that wrote it last
    console: dict | None = None  # the console's conversation record (rtserver/web/console.py)

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

    def key(self, session_id: str) -> str:
        return self.cluster.key("session", session_id)

    async def save(self, record: SessionRecord) -> None:
        """One atomic write (SET with PX); ClusterUnavailable when Redis fails."""
        raw = record.dumps()
        await self.cluster.call(lambda: self.cluster.redis.set(self.key(record.id), raw, px=self.ttl_ms))
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
