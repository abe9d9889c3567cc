"""Sessions: id, resume token, chat history, the handle on the backend's KV, and expiry.

A session belongs to one connection at a time. When the connection closes, the session stays in the registry
for `sessions.idle_timeout_s`. A client that reconnects in time with the session id and its resume token
gets it back. It gets the history, and the engine's cached KV for it. The KV budget may have evicted that KV
meanwhile; then the next turn simply recomputes the prompt. After the timeout the session expires. Its
history is dropped and `engine.drop_session(session.id)` frees its KV. Ids and resume tokens come from the
`secrets` module. Tokens are compared in constant time. A token only ever resumes its own session. Each
resume gives the session a new token, and the old one stops working.

Some sessions hold something of the customer's (`Session.kept`). That is an acknowledged turn, or a message
for an agent. Such a session is never dropped before its timeout to make room. Two limits may be full: the
table (`sessions.max_sessions`) or an address's share (`security.max_sessions_per_ip`). The share counts
sessions held, connected or not. Then the newest detached empty session makes room. When there is none, the
new session is refused (`SessionsFull`, `TooManySessions`). The refusal says when the first held session
could expire. How a history becomes a prompt is in rtserver/tasks/chat.py.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..tasks.chat import LastTurn, Message
from .events import Event

log = logging.getLogger("rtserver.session")


class SessionExpired(Exception):
    """Unknown id, wrong token, or the session idled past its timeout."""


class SessionRefused(Exception):
    """A new session would need dropping one worth keeping. `retry_after_s` says when the first held session
    could expire at the soonest.
    """

    code = ""

    def __init__(self, message: str, retry_after_s: float):
        self.message = message
        self.retry_after_s = max(1.0, round(retry_after_s, 1))
        super().__init__(message)


class TooManySessions(SessionRefused):
    """The client IP holds its cap of sessions. They count if connected, or detached and worth keeping."""

    code = "too_many_sessions"

    def __init__(self, client_ip: str, cap: int = 0, retry_after_s: float = 0.0):
        super().__init__(
            f"this address already holds {cap} sessions (the limit), connected or with a conversation "
            "that can still be resumed; resume one of them, or retry later",
            retry_after_s,
        )


class SessionsFull(SessionRefused):
    """The node's table is full of sessions worth keeping. A new one is refused; no customer's conversation
    is evicted for it.
    """

    code = "sessions_full"

    def __init__(self, cap: int, retry_after_s: float):
        super().__init__(
            f"this server holds its limit of {cap} sessions; retry later or on another server", retry_after_s
        )


class Customer(Protocol):
    """The connection a session is attached to (the hub's `Connection`). It is how the rest of the web layer
    talks to it. The console reaches a customer through it without importing the hub.
    """

    session: Session | None

    async def send(self, event: Event) -> None: ...

    async def error(
        self, code: str, message: str, request_id: str | None = None, **extra: object
    ) -> None: ...

    def cancel_all(self) -> None: ...

    def stop(self, code: int | None = None, reason: str = "") -> None: ...


@dataclass
class Session:
    id: str
    resume_token: str
    created_at: float
    last_active: float
    history: list[Message] = field(default_factory=list)
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

    @property
    def kept(self) -> bool:
        """Whether it holds something of the customer's. It is then never dropped to make room."""
        return bool(self.history) or self.turns > 0 or self.chat_request is not None

    def touch(self, now: float) -> None:
        self.last_active = now

    # -- a bot turn: one `with session.turn(...)` block ---------------------------------------------
    def turn(self, request_id: str, clock: Callable[[], float]) -> SessionTurn:
        """A bot turn starts. The session is busy until its `with` block ends."""
        self.chat_request = request_id
        return SessionTurn(self, request_id, clock)

    # -- edits outside a bot turn ------------------------------------------------------------------
    def forward(self, history: list[Message], cut: bool) -> Snapshot:
        """A customer message for the agent holding the session. It is its history's last entry."""
        kept = self.snapshot()
        self.history = history
        self.cuts += cut
        return kept

    def add_agent_reply(self, text: str, agent_name: str) -> None:
        self.history.append({"role": "assistant", "content": text, "agent": agent_name})

    def clear(self) -> Snapshot:
        """Empty the history (a reset)."""
        kept = self.snapshot()
        self.history, self.last_turn, self.turns = [], None, 0
        return kept

    def snapshot(self) -> Snapshot:
        return Snapshot(self.history, self.last_turn, self.turns, self.cuts)

    def restore(self, kept: Snapshot) -> None:
        """Undo an edit that could not be stored."""
        self.history, self.last_turn, self.turns, self.cuts = (
            kept.history,
            kept.last_turn,
            kept.turns,
            kept.cuts,
        )


class SessionTurn:
    """One bot turn, from its message to its reply. Leaving the `with` block ends it. A turn not committed
    is undone: a failed or unstored turn never ran. The session is then free again.
    """

    def __init__(self, session: Session, request_id: str, clock: Callable[[], float]):
        self.session = session
        self.request_id = request_id
        self.clock = clock
        self.message: Message | None = None
        self.reply: Message | None = None
        self.kept: tuple[LastTurn | None, int] = (None, 0)  # last_turn and turns before the reply
        self.committed = False

    def __enter__(self) -> SessionTurn:
        return self

    def __exit__(self, *exc: object) -> None:
        session = self.session
        if session.chat_request == self.request_id:
            if not self.committed:
                self._rollback()
            session.chat_request = None
        session.touch(self.clock())

    def add_message(self, history: list[Message], cut: bool) -> None:
        """The turn's prepared history: the customer's message is its last entry."""
        self.session.history = history
        self.session.cuts += cut
        self.message = history[-1]

    def add_reply(self, text: str, last: LastTurn | None) -> None:
        """The bot's reply, right after its message. Messages forwarded meanwhile follow it. `last` holds
        its reusable tokens. It is kept only where the reply ends the history.
        """
        session = self.session
        assert self.message is not None
        self.kept = (session.last_turn, session.turns)
        self.reply = {"role": "assistant", "content": text}
        _insert_after(session.history, self.message, self.reply)
        session.last_turn = last if session.history[-1] is self.reply else None
        session.turns += 1

    def commit(self) -> None:
        """The turn is stored: leaving the block keeps it."""
        self.committed = True

    def _rollback(self) -> None:
        session = self.session
        if self.reply is not None:
            _remove(session.history, self.reply)
            session.last_turn, session.turns = self.kept
        if self.message is not None:
            _remove(session.history, self.message)


@dataclass(frozen=True)
class Snapshot:
    """A session's turn state before an edit."""

    history: list[Message]
    last_turn: LastTurn | None
    turns: int
    cuts: int


def _remove(history: list[Message], entry: Message) -> None:
    """Take this very entry out. It goes by identity: equal text may be another message."""
    for i in range(len(history) - 1, -1, -1):
        if history[i] is entry:
            del history[i]
            return


def _insert_after(history: list[Message], entry: Message, new: Message) -> None:
    """Put `new` right after `entry`. It goes at the end when the window cut `entry` off."""
    for i in range(len(history) - 1, -1, -1):
        if history[i] is entry:
            history.insert(i + 1, new)
            return
    history.append(new)


def new_id() -> str:
    return secrets.token_urlsafe(18)


def new_token() -> str:
    return secrets.token_urlsafe(32)


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
        self.shed_total = 0  # detached empty sessions dropped to make room
        self.refused_total = 0  # new sessions refused: only sessions worth keeping were left
        self._no_room: dict[str | None, float] = {}  # IP (None: the table) -> when a refusal may end
        self._sweeper: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self.sessions)

    def create(self, client_ip: str = "") -> Session:
        """A new session. Room may be short: `max_per_ip` sessions held by this IP, or `max_sessions` in
        all. Then the newest detached empty one makes room (of that IP, or of anyone). When there is none,
        it raises TooManySessions or SessionsFull. A conversation is never dropped for a newcomer.
        """
        self.make_room(client_ip)
        now = self.clock()
        return self._add(
            Session(
                id=new_id(), resume_token=new_token(), created_at=now, last_active=now, client_ip=client_ip
            )
        )

    def adopt(self, session_id: str, resume_token: str, client_ip: str = "") -> Session:
        """A session another node created, cached here. Clustered, its record is in Redis. The IP's cap is
        the cluster's (counted in Redis). The table's cap holds here too.
        """
        self._make_table_room()
        now = self.clock()
        return self._add(
            Session(
                id=session_id, resume_token=resume_token, created_at=now, last_active=now, client_ip=client_ip
            )
        )

    def _add(self, session: Session) -> Session:
        self.sessions[session.id] = session
        self.per_ip[session.client_ip] += 1
        return session

    def make_room(self, client_ip: str) -> None:
        """Room for one more session of this IP. Else the refusal that says why there is none."""
        if self.max_per_ip and self.per_ip[client_ip] >= self.max_per_ip:
            wait = self._room(client_ip)
            if wait:
                raise TooManySessions(client_ip, self.max_per_ip, wait)
        self._make_table_room()

    def _make_table_room(self) -> None:
        if len(self.sessions) >= self.max_sessions:
            wait = self._room(None)
            if wait:
                raise SessionsFull(self.max_sessions, wait)

    def _room(self, client_ip: str | None) -> float:
        """Make room among the IP's sessions (None: all). Returns 0.0 when made, else seconds to wait. A
        refusal is remembered until a session of theirs detaches or goes. So a flood costs one scan.
        """
        now = self.clock()
        until = self._no_room.get(client_ip)
        if until is None or now >= until:
            self.sweep()
            full = (
                self.per_ip[client_ip] >= self.max_per_ip
                if client_ip is not None
                else (len(self.sessions) >= self.max_sessions)
            )
            if not full or self._shed(client_ip):
                return 0.0
            until = self._no_room[client_ip] = now + self._first_expiry(client_ip)
        self.refused_total += 1
        return until - now

    def _shed(self, client_ip: str | None = None) -> bool:
        """Drop the newest detached session with nothing in it (of `client_ip`, or of anyone). A flood's own
        sessions go first; an earlier visitor's stay. False when there is none.
        """
        empty = [
            s
            for s in self.sessions.values()
            if s.connection is None and not s.kept and (client_ip is None or s.client_ip == client_ip)
        ]
        if not empty:
            return False
        self.drop(max(empty, key=lambda s: (s.created_at, s.last_active)))
        self.shed_total += 1
        return True

    def _first_expiry(self, client_ip: str | None = None) -> float:
        """Seconds until the first of these sessions could expire. A connected one counts once it detaches."""
        now = self.clock()
        left = [
            self.idle_timeout_s - (now - s.last_active) if s.connection is None else self.idle_timeout_s
            for s in self.sessions.values()
            if client_ip is None or s.client_ip == client_ip
        ]
        return min(left, default=self.idle_timeout_s)

    def resume(self, session_id: str, resume_token: str) -> Session:
        """The session for this id and token. Raises SessionExpired, the same way for every cause."""
        session = self.sessions.get(session_id)
        if session is None or not secrets.compare_digest(
            session.resume_token.encode(), resume_token.encode()
        ):
            raise SessionExpired(session_id)
        if self.expired(session, self.clock()):
            self.drop(session)
            raise SessionExpired(session_id)
        session.touch(self.clock())
        session.resume_token = new_token()  # the one just used stops working
        return session

    def expired(self, session: Session, now: float) -> bool:
        return session.connection is None and now - session.last_active > self.idle_timeout_s

    def detach(self, session: Session, connection: Customer) -> None:
        if session.connection is connection:
            session.connection = None
            session.touch(self.clock())
            self._room_changed(session)

    def _room_changed(self, session: Session) -> None:
        self._no_room.pop(None, None)
        self._no_room.pop(session.client_ip, None)

    def drop(self, session: Session) -> None:
        if self.sessions.pop(session.id, None) is not None:
            self._room_changed(session)
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
        doomed = [s for s in self.sessions.values() if self.expired(s, now)]
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
