"""The hub's sessions when clustered: this node's `SessionRegistry` as a cache in front of the records in
Redis (`store.py`), which are the truth.

- create: a local session, its connected-session slot for the IP (`limits.py`), its first record;
- resume: the record decides (token hash, expiry by TTL); the node's cached copy is kept when its
  version is the record's (its KV and last-turn tokens stay warm), else rebuilt from the record — the
  next turn's prompt is rendered from the history and the KV recomputed;
- save: one atomic write of the whole record; `done` is sent only after it succeeded. A resume writes
  it too: its `node` says where the session is served (a connection to it elsewhere is told to close).
  A write that failed may still have landed: its write id is kept, and the session's next write may
  replace that record (it is this node's own), so the version moves on instead of conflicting.
"""

from __future__ import annotations

import contextlib
import time

from ..session import Session, SessionExpired, SessionRegistry, TooManySessions
from . import Cluster, ClusterUnavailable
from .limits import ClusterLimits
from .store import SessionConflict, SessionRecord, SessionStore, token_hash

MAX_UNKNOWN_WRITES = 8  # more failed writes in a row than this: the oldest may conflict


class ClusterSessions:
    def __init__(
        self,
        cluster: Cluster,
        store: SessionStore,
        limits: ClusterLimits,
        registry: SessionRegistry,
    ):
        self.cluster = cluster
        self.store = store
        self.limits = limits
        self.registry = registry
        self.resumed_elsewhere = 0  # resumes of a session whose record this node did not hold current
        self._unknown: dict[str, list[str]] = {}  # session id -> write ids whose outcome is unknown

    def record(self, session: Session, client: str | None, version: int) -> SessionRecord:
        return SessionRecord(
            id=session.id,
            token_sha256=token_hash(session.resume_token),
            version=version,
            history=list(session.history),
            turns=session.turns,
            cuts=session.cuts,
            client=client,
            client_ip=session.client_ip,
            created_at=session.created_wall,
            node=self.cluster.node_id,
        )

    async def save(self, session: Session, client: str | None) -> None:
        """Write the session's record (ClusterUnavailable when Redis fails; the version is kept then)."""
        record = self.record(session, client, session.version + 1)
        unknown = self._unknown.get(session.id, [])
        try:
            await self.store.save(record, replaces=tuple(unknown))
        except SessionConflict:
            raise
        except ClusterUnavailable:
            self._unknown[session.id] = [*unknown, record.write_id][-MAX_UNKNOWN_WRITES:]
            raise
        self._unknown.pop(session.id, None)
        session.version += 1

    def forget(self, session: Session) -> None:
        """The session is gone from this node."""
        self._unknown.pop(session.id, None)

    async def create(self, client_ip: str, client: str | None) -> Session:
        self.cluster.require()
        session = self.registry.create(client_ip)
        session.created_wall = time.time()
        claimed = False
        try:
            if self.limits.max_sessions_per_ip:
                claimed = await self.limits.claim_session(client_ip, session.id)
                if not claimed:
                    raise TooManySessions(client_ip)
            await self.save(session, client)
        except BaseException:
            self.registry.drop(session)
            if claimed:  # else its lease runs out by itself
                with contextlib.suppress(ClusterUnavailable):
                    await self.limits.release_session(client_ip, session.id)
            raise
        return session

    async def resume(
        self, session_id: str, resume_token: str, client_ip: str
    ) -> tuple[Session, SessionRecord]:
        """(the session, its record); SessionExpired the same way for every cause."""
        self.cluster.require()
        record = await self.store.load(session_id) if session_id else None
        if record is None or not record.token_matches(resume_token):
            raise SessionExpired(session_id)
        if self.limits.max_sessions_per_ip and not await self.limits.claim_session(client_ip, record.id):
            raise TooManySessions(client_ip)
        session = self.registry.sessions.get(record.id)
        if session is None:
            session = self.registry.adopt(record.id, resume_token, record.client_ip)
        if session.version != record.version:
            self.resumed_elsewhere += 1
            session.history = list(record.history)
            session.turns, session.cuts = record.turns, record.cuts
            session.last_turn = None  # the KV is rebuilt from the history
            session.version = record.version
            session.created_wall = record.created_at
        session.touch(self.registry.clock())
        await self.save(session, record.client)  # the record names the node serving it now
        return session, record

    async def release(self, session: Session, client_ip: str) -> None:
        if self.limits.max_sessions_per_ip:
            await self.limits.release_session(client_ip, session.id)
