"""The console's door: `/ws/console`, its login (token, deadline, failed logins) and its frames.

A console page must be this server's own (same origin) or in `security.console_origins`. A console
socket must log in within `security.console_login_timeout_s` (else 4408); a wrong token closes it
(4401); past the limit of wrong ones from a client IP, its logins wait before they are checked
(login.py), the right token's too, and are never refused for it.
The frames of a logged-in agent are checked here once: below, a session id is a `str`.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
from collections.abc import Callable

from starlette.websockets import WebSocket, WebSocketDisconnect

from .. import events
from .. import protocol as P
from ..admission import client_key
from ..connection import Close, accept, client_ip, refuse
from ..seams import Limits
from ..state import AppState
from .actions import Actions
from .agents import Agent, Agents
from .assist import Assist
from .frames import (
    AGENT_FRAME,
    AGENT_MESSAGE_TYPES,
    AgentReply,
    AssistCall,
    ConsolePing,
    HandBack,
    Login,
    Open,
    TakeOver,
)
from .guard import spawn
from .login import FIRST_LOGIN_DELAY_S, LOGIN_WINDOW_S, LoginFailures, RejoinTokens, agent_name, digest
from .snapshot import Snapshots
from .timer import Timer


class Door:
    """Lets agents in and hands their actions on."""

    def __init__(
        self,
        state: AppState,
        agents: Agents,
        actions: Actions,
        assist: Assist,
        snapshots: Snapshots,
        rejoin: RejoinTokens,
        limits: Limits,
        timer: Timer,
        agents_changed: Callable[[], None] = lambda: None,
    ):
        self.state = state
        self.settings = state.settings
        self.agents = agents
        self.actions = actions
        self.assist = assist
        self.snapshots = snapshots
        self.rejoin = rejoin
        self.limits = limits  # cluster-wide failed logins when clustered
        self.timer = timer
        self.agents_changed = agents_changed  # an agent came or went: waiting customers' view (queue.py)
        self.login_failures = LoginFailures(self.settings.security.console_login_failures_per_min)
        self.waiting: set[Agent] = set()  # logins held before their token is checked

    # -- the endpoint ---------------------------------------------------------------------------
    async def endpoint(self, ws: WebSocket) -> None:
        sec, metrics = self.settings.security, self.state.metrics
        if not await accept(ws, sec, metrics, console=True):
            return
        if not sec.console_token:
            message = "the console is disabled (security.console_token is empty)"
            await refuse(ws, metrics, "console_disabled", message, Close.DISABLED, "console disabled")
            return
        agent = Agent(ws, max(64, 4 * self.settings.server.send_queue_size))
        self.agents.add(agent)
        writer = asyncio.create_task(agent.writer())
        deadline = self.timer.call_later(sec.console_login_timeout_s, lambda: self._login_late(agent))
        read = asyncio.create_task(self._read(agent))
        try:
            await agent.stopping.wait()
        finally:
            deadline.cancel()
            self.agents.discard(agent)
            self.assist.agent_left(agent)
            read.cancel()
            if agent.logged_in:
                agent.logged_in = False
                self.actions.agent_left(agent)
                self.agents_changed()
            await agent.finish(read, writer)

    async def _read(self, agent: Agent) -> None:
        try:
            while not agent.stopping.is_set():
                message = await agent.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                raw = message.get("text")
                await self.handle(agent, raw if raw is not None else (message.get("bytes") or b""))
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            agent.stop()

    def _login_late(self, agent: Agent) -> None:
        if not agent.logged_in and not agent.stopping.is_set() and agent not in self.waiting:
            timeout = self.settings.security.console_login_timeout_s
            agent.put(events.error_event("login_timeout", f"no login within {timeout:g} s"))
            agent.stop(Close.LOGIN_TIMEOUT, "login timeout")

    # -- frames ---------------------------------------------------------------------------------
    async def handle(self, agent: Agent, raw: str | bytes) -> None:
        try:
            obj = P.load_object(raw, self.settings.server.max_frame_bytes)
        except P.ProtocolError as exc:
            agent.put(events.error_event(exc.code, exc.message))
            return
        kind = obj.get("type")
        if kind not in AGENT_MESSAGE_TYPES:
            known = ", ".join(AGENT_MESSAGE_TYPES)
            agent.put(events.error_event("unknown_type", f"unknown message type {kind!r} (known: {known})"))
            return
        frame = AGENT_FRAME.validate_python(obj)
        if isinstance(frame, ConsolePing):
            agent.put(events.pong_event(frame.data))
        elif isinstance(frame, Login):
            if agent.logged_in:
                agent.put(events.error_event("already_started", "already logged in"))
            elif await self.login(agent, frame):
                await self.snapshots.send(agent)
        elif not agent.logged_in:
            agent.put(events.error_event("unauthorized", "send login with the console token first"))
            agent.stop(Close.UNAUTHORIZED, "unauthorized")
        else:
            await self._act(agent, frame)

    async def _act(self, agent: Agent, frame: TakeOver | HandBack | AgentReply | AssistCall | Open) -> None:
        sid = frame.session_id
        if not isinstance(sid, str):  # no conversation has it
            message = f"no live conversation {sid!r}"
            agent.put(events.error_event("unknown_session", message, session_id=sid))
        elif isinstance(frame, TakeOver):
            await self.actions.take_over(agent, sid)
        elif isinstance(frame, HandBack):
            await self.actions.hand_back(agent, sid)
        elif isinstance(frame, AssistCall):
            self.assist.request(agent, frame)
        elif isinstance(frame, Open):  # a conversation's messages, asked for once (events carry only changes)
            await self.snapshots.open(agent, sid, frame.before)
        else:
            await self.actions.agent_message(agent, sid, frame.text)

    # -- login ----------------------------------------------------------------------------------
    async def _login_delay(self, ip: str) -> float:
        """Seconds a login from this IP waits before its token is checked: by this node's count of its
        wrong tokens; clustered, at least the first delay once the cluster's count is at the limit
        (this node's own while Redis is down)."""
        limit = self.settings.security.console_login_failures_per_min
        if not limit:
            return 0.0
        local = self.login_failures.delay(ip)
        over = await self.limits.failed_logins(ip, limit, LOGIN_WINDOW_S, False, local)
        return max(local, FIRST_LOGIN_DELAY_S) if over > 0 else 0.0

    async def _count_failure(self, ip: str, given: object) -> None:
        """A wrong token from this IP, counted here and cluster-wide unless it was already counted."""
        limit = self.settings.security.console_login_failures_per_min
        attempt = digest(given) if isinstance(given, str) else b""
        if limit and self.login_failures.failed(ip, attempt):
            await self.limits.failed_logins(ip, limit, LOGIN_WINDOW_S, True, 0.0)

    async def login(self, agent: Agent, frame: Login) -> bool:
        ip = client_key(client_ip(agent.ws))  # an IPv6 guesser counts by its /64
        key = await self.rejoin.key()
        known = self.rejoin.agent_id(frame.rejoin, key)  # an agent who logged in before
        wait = 0.0 if known else await self._login_delay(ip)
        if wait > 0:  # the server holds the socket: its login deadline does not run meanwhile
            self.waiting.add(agent)
            try:
                await asyncio.sleep(wait)
            finally:
                self.waiting.discard(agent)
        if agent.stopping.is_set():  # closed meanwhile (the client left, the server stopping)
            return False
        given = frame.token
        token = self.settings.security.console_token
        # digests of equal length: the comparison tells nothing about the token, not even its length
        if not (isinstance(given, str) and hmac.compare_digest(digest(given), digest(token))):
            await self._count_failure(ip, given)
            agent.put(events.error_event("unauthorized", "wrong console token"))
            agent.stop(Close.UNAUTHORIZED, "unauthorized")
            return False
        self._log_in(agent, frame, key, known)
        return True

    def _log_in(self, agent: Agent, frame: Login, key: bytes | None, known: str | None) -> None:
        agent.name = agent_name(frame.agent)
        # the server names agents: an id is only ever given back to who holds its rejoin token
        agent.id = known or secrets.token_urlsafe(12)
        agent.rejoin = self.rejoin.token(agent.id, key) if key is not None else None
        # Snapshot and registration in one synchronous step: every later event follows the snapshot.
        # (Clustered, the snapshot is read from Redis: events are held until it is sent.)
        agent.logged_in = True
        agent.held = []
        self.actions.agent_back(agent.id)
        self.agents_changed()

    def resync(self) -> None:
        """The bus resubscribed after losing Redis: events may be missing, agents get a new snapshot."""
        for agent in self.agents:
            if agent.logged_in and agent.held is None:
                agent.held = []
                spawn(self.snapshots.send(agent))

    def close(self) -> None:
        for agent in self.agents:
            agent.stop(Close.GOING_AWAY, "server shutting down")
