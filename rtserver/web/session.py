"""Sessions: id, resume token, the chat history, the handle on the backend's KV, and expiry.

A session belongs to one connection at a time. When the connection closes, the session stays in the
registry for `sessions.idle_timeout_s`; a client that reconnects in time with the session id and its
resume token gets it back (history, and the engine's cached KV for it unless the KV budget evicted it
meanwhile — then the next turn simply recomputes the prompt). After that the session expires: its
history is dropped and `engine.drop_session(session.id)` frees its KV. Ids and resume tokens come from
the `secrets` module; tokens are compared in constant time and only ever resume their own session.
How a history becomes a prompt (the window, the last turn's own tokens): rtserver/tasks/chat.py.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..tasks.chat import LastTurn

log = logging.getLogger("rtserver.session")


class SessionExpired(Exception):
    """Unknown id, wrong token, or the session idled past its timeout."""


class TooManySessions(Exception):
    """The client IP already holds its cap of sessions, all of them connected."""


class Customer(Protocol):
    """The connection a session is attached to, as the rest of the web layer talks to it (the hub's
    `Connection`): the console reaches a customer through it without importing the hub."""

    session: Session | None

    async def send(self, event: dict) -> None: ...

    async def error(self, code: str, message: str, request_id: str | None = None, **extra: Any) -> None: ...

    def run_auto_tasks(self, request_id: str, text: str) -> None: ...

    def cancel_all(self) -> None: ...

    def stop(self, code: int | None = None, reason: str = "") -> None: ...


@dataclass
class Session:
    id: str
    resume_token: str
    created_at: float
    last_active: float
    history: list[dict] = field(default_factory=list)
    connection: Customer | None = None  # the hub connection that holds it, or None while detached
    chat_request: str | None = None  # id of the chat turn in progress
    turns: int = 0  # chat turns completed in this session
    cuts: int = 0  # window cuts so far
    client_ip: str = ""  # the address that created it (sessions per IP are capped)
    last_turn: LastTurn | None = None  # the latest bot turn's exact tokens (see continue_prompt)
    # clustered (rtserver/web/cluster/): the version of the record in Redis this copy matches, and
    # the wall-clock creation time the record carries
    version: int = 0
    created_wall: float = 0.0

    @property
    def history_turns(self) -> int:
        return sum(1 for m in self.history if m["role"] == "user")

    def touch(self, now: float) -> None:
        self.last_active = now


class SessionRegistry:
    """All live sessions; expiry of detached ones; `on_drop(session)` frees their engine state."""

    def __init__(
        self,
        idle_timeout_s: float,
        max_sessions: int,
        on_drop: Callable[[Session], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_per_ip: int = 0,
    ):
        self.idle_timeout_s = idle_timeout_s
        self.max_sessions = max_sessions
        self.max_per_ip = max_per_ip  # 0 = no cap
        self.per_ip: Counter[str] = Counter()
        self.on_drop = on_drop or (lambda s: None)
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        self.expired_total = 0
        self._sweeper: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self.sessions)

    def create(self, client_ip: str = "") -> Session:
        """A new session. At `max_per_ip` sessions for this IP its oldest detached one makes room; if all
        of them are connected, raises TooManySessions."""
        if self.max_per_ip and self.per_ip[client_ip] >= self.max_per_ip:
            self.sweep()
            if self.per_ip[client_ip] >= self.max_per_ip and not self._drop_oldest_detached(client_ip):
                raise TooManySessions(client_ip)
        if len(self.sessions) >= self.max_sessions:
            self.sweep()
            if len(self.sessions) >= self.max_sessions:
                self._drop_oldest_detached()
        now = self.clock()
        session = Session(
            id=secrets.token_urlsafe(18),
            resume_token=secrets.token_urlsafe(32),
            created_at=now,
            last_active=now,
            client_ip=client_ip,
        )
        self.sessions[session.id] = session
        self.per_ip[client_ip] += 1
        return session

    def adopt(self, session_id: str, resume_token: str, client_ip: str = "") -> Session:
        """A session another node created (clustered: its record is in Redis), cached here."""
        now = self.clock()
        if len(self.sessions) >= self.max_sessions:
            self.sweep()
            if len(self.sessions) >= self.max_sessions:
                self._drop_oldest_detached()
        session = Session(
            id=session_id, resume_token=resume_token, created_at=now, last_active=now, client_ip=client_ip
        )
        self.sessions[session.id] = session
        self.per_ip[client_ip] += 1
        return session

    def _drop_oldest_detached(self, client_ip: str | None = None) -> bool:
        detached = [
            s
            for s in self.sessions.values()
            if s.connection is None and (client_ip is None or s.client_ip == client_ip)
        ]
        if detached:
            self.drop(min(detached, key=lambda s: s.last_active))
        return bool(detached)

    def resume(self, session_id: str, resume_token: str) -> Session:
        """The session for this id and token; raises SessionExpired (the same way for every cause)."""
        session = self.sessions.get(session_id)
        if session is None or not secrets.compare_digest(
            session.resume_token.encode(), resume_token.encode()
        ):
            raise SessionExpired(session_id)
        if self._expired(session, self.clock()):
            self.drop(session)
            raise SessionExpired(session_id)
        session.touch(self.clock())
        return session

    def _expired(self, session: Session, now: float) -> bool:
        return session.connection is None and now - session.last_active > self.idle_timeout_s

    def detach(self, session: Session, connection: Customer) -> None:
        if session.connection is connection:
            session.connection = None
            session.touch(self.clock())

    def drop(self, session: Session) -> None:
        if self.sessions.pop(session.id, None) is not None:
            self.per_ip[session.client_ip] -= 1
            if self.per_ip[session.client_ip] <= 0:
                del self.per_ip[session.client_ip]
            session.history.clear()
            try:
                self.on_drop(session)
            except Exception:  # freeing is best effort; never let it break the caller
                log.exception("dropping session failed")

    def sweep(self) -> int:
        now = self.clock()
        doomed = [s for s in self.sessions.values() if self._expired(s, now)]
        for s in doomed:
            self.drop(s)
        self.expired_total += len(doomed)
        return len(doomed)

    # -- background expiry ----------------------------------------------------------------------
    def start(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        interval = min(30.0, max(0.2, self.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(interval)
            self.sweep()

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except asyncio.CancelledError:
                pass
            self._sweeper = None
        for s in list(self.sessions.values()):
            self.drop(s)
