"""The hub's sessions when clustered: this node's `SessionRegistry` as a cache in front of the records in
Redis (`store.py`), which are the truth.

- create: a local session and its slot among the sessions its IP holds (`limits.py`); no record yet:
  a session gets one with the first thing worth keeping (a turn, a message for an agent), so a flood
  of empty sessions writes nothing to Redis;
- resume: the record decides (token hash, expiry by TTL); the node's cached copy is kept when its
  version is the record's (its KV and last-turn tokens stay warm), else rebuilt from the record — the
  next turn's prompt is rendered from the history and the KV recomputed. A session never stored
  resumes only on the node that made it (there is nothing of it elsewhere). Each resume gives the
  session a new token, written in the record before the client gets it;
- save: one atomic write of the whole record; `done` is sent only after it succeeded. A resume writes
  it too: its `node` says where the session is served (a connection to it elsewhere is told to close).
  A write that failed may still have landed: its write id is kept, and the session's next write may
  replace that record (it is this node's own), so the version moves on instead of conflicting; a
  resume with the token that write replaced is still taken (the client never saw the new one).
"""

from __future__ import annotations

import secrets
import time

from ..session import Session, SessionExpired, SessionRegistry, TooManySessions, new_token
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

    def record(self, session: Session, client: str | None, version: int, token: str = "") -> SessionRecord:
        return SessionRecord(
            id=session.id,
            token_sha256=token_hash(token or session.resume_token),
            version=version,
            history=list(session.history),
            turns=session.turns,
            cuts=session.cuts,
            client=client,
            client_ip=session.client_ip,
            created_at=session.created_wall,
            node=self.cluster.node_id,
        )

    async def save(self, session: Session, client: str | None, token: str = "") -> None:
        """Write the session's record (ClusterUnavailable when Redis fails; the version is kept then).
        A session that was never stored and holds nothing yet is not written. `token`: the new resume
        token the record names (the session's own by default)."""
        if session.version == 0 and not session.history:
            return
        record = self.record(session, client, session.version + 1, token)
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
        try:
            await self._claim(session, client_ip)
        except BaseException:
            self.registry.drop(session)  # its slot, if the reply was lost, runs out with its lease
            raise
        return session

    async def _claim(self, session: Session, client_ip: str) -> None:
        """The session's slot among those its IP holds; TooManySessions at the cap. A session with a
        record is already held: it always gets its slot back."""
        if not self.limits.max_sessions_per_ip:
            return
        stored = session.version > 0
        wait = await self.limits.claim_session(client_ip, session.id, capped=not stored, stored=stored)
        if wait:
            raise TooManySessions(client_ip, self.limits.max_sessions_per_ip, wait)

    async def resume(
        self, session_id: str, resume_token: str, client_ip: str
    ) -> tuple[Session, SessionRecord | None]:
        """(the session, its record: None for a session of this node never stored); SessionExpired the
        same way for every cause."""
        self.cluster.require()
        record = await self.store.load(session_id) if session_id else None
        local = self.registry.sessions.get(session_id) if session_id else None
        if record is None:
            return await self._resume_unstored(local, session_id, resume_token, client_ip), None
        if not (record.token_matches(resume_token) or self._replaced_token(record, local, resume_token)):
            raise SessionExpired(session_id)
        session = local
        if session is None:
            session = self.registry.adopt(record.id, resume_token, record.client_ip)
        if session.version != record.version:
            self.resumed_elsewhere += 1
            session.history = list(record.history)
            session.turns, session.cuts = record.turns, record.cuts
            session.last_turn = None  # the KV is rebuilt from the history
            session.version = record.version
            session.created_wall = record.created_at
        await self._claim(session, client_ip)
        session.touch(self.registry.clock())
        token = new_token()
        await self.save(session, record.client, token)  # the record names the node and the new token
        session.resume_token = token
        return session, record

    async def _resume_unstored(
        self, local: Session | None, session_id: str, resume_token: str, client_ip: str
    ) -> Session:
        """A session this node made that holds nothing yet (no record anywhere): resumed here alone."""
        now = self.registry.clock()
        if local is None or local.version != 0 or not _same(local.resume_token, resume_token):
            raise SessionExpired(session_id)
        if self.registry.expired(local, now):
            self.registry.drop(local)
            raise SessionExpired(session_id)
        await self._claim(local, client_ip)
        local.touch(now)
        local.resume_token = new_token()
        return local

    def _replaced_token(self, record: SessionRecord, local: Session | None, token: str) -> bool:
        """The record is this node's own write whose outcome was unknown (it may hold a new token the
        client never got): the token it replaced still resumes."""
        return (
            local is not None
            and record.write_id in self._unknown.get(record.id, ())
            and _same(local.resume_token, token)
        )

    async def release(self, session: Session, client_ip: str) -> None:
        if self.limits.max_sessions_per_ip:
            await self.limits.release_session(client_ip, session.id, stored=session.version > 0)


def _same(a: str, b: str) -> bool:
    return secrets.compare_digest(a.encode(), b.encode())
