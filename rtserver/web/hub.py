"""The /ws endpoint: per-connection reader and writer, the session registry, request routing.

Per connection:
- a reader loop takes frames and validates them with `protocol`. A bad frame gets an `error` event and
  the connection stays up. Each request starts one asyncio task, keyed by the request id;
- a writer task drains a bounded send queue (`server.send_queue_size` events). A producer that finds it
  full waits up to `server.slow_client_timeout_s` for room. After that the client is deemed not to
  be reading. The connection is closed with code 4008 ("slow client") and its generations cancelled.
  So server memory per connection is bounded by the queue. A slow reader never delays the engine or
  other clients. The engine never waits for a stream's consumer;
- every frame but `cancel` takes a token from two token buckets (`security.rate_limit_*`). One is the
  connection's, one the client IP's. An empty bucket gets `rate_limited` with `retry_after_s`;
- chat turns of a session are serialised. A `chat` while one is in progress gets `chat_busy`.
  Nothing is queued server-side;
- on disconnect every generation of the connection is cancelled. The engine drops it at its next
  step. The session is detached, to be resumed or to expire.

Shutdown is `Hub.drain`. The server calls it on SIGTERM, before uvicorn closes sockets. Every connection
gets a `shutting_down` event. New requests are refused with `shutting_down`. In-flight ones have
`server.shutdown_grace_s` to finish. Those still running then end with error `shutting_down`. The sockets
close with 1001.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass

from starlette.websockets import WebSocket, WebSocketDisconnect

from ..engine.backend import Generation, NextTurnPrefetcher
from ..tasks.declare import CUSTOMERS
from . import events
from . import protocol as P
from . import session_events as se
from .admission import Admission, NoReservation, Refused, Reservation, Surface, client_key
from .commands import Holder
from .connection import Close, QueuedConnection, accept, client_ip, refuse
from .console import ConsoleHub
from .errors import GenerationFailed, error_code
from .ratelimit import TokenBucket
from .seams import NodeFigures, NodeView, StoreUnavailable
from .session import Session, SessionExpired, SessionRefused, SessionRegistry, TooManySessions
from .session_events import SessionEvents
from .state import AppState
from .transport import websocket_capacity
from .turns import ChatTurns, Client, TurnResult

log = logging.getLogger("rtserver.hub")

FULL_RETRY_S = 5  # the retry hint of a widget refused by a full node: places free as widgets leave


@dataclass
class Request:
    id: str
    kind: str  # chat | task
    task: asyncio.Task[None] | None = None
    stream: Generation | None = None
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True
        if self.stream is not None:
            self.stream.cancel()  # the chat task ends by itself with finish_reason "cancelled"
        elif self.kind == "task" and self.task is not None:
            self.task.cancel()
        # a chat whose generation is not submitted yet sees `cancelled` right after submitting it; its
        # task is never cancelled from outside, so its clean-up (the session's turn state) always runs


class Connection(QueuedConnection):
    def __init__(self, hub: Hub, ws: WebSocket):
        ss = hub.settings.server
        super().__init__(ws, ss.send_queue_size)
        self.hub = hub
        self.slow_timeout = ss.slow_client_timeout_s
        self.requests: dict[str, Request] = {}
        self.session: Session | None = None
        self.client_name: str | None = None
        self.background: set[asyncio.Task[None]] = set()
        self.client_ip = client_key(client_ip(ws))  # what per-client limits count (IPv6: its /64)
        self.started = asyncio.Event()  # set once a session is attached (the hello deadline ends)
        sec = hub.settings.security
        self.bucket = (
            TokenBucket(sec.rate_limit_per_s, sec.rate_limit_burst) if sec.rate_limit_per_s > 0 else None
        )

    # -- sending --------------------------------------------------------------------------------
    async def send(self, event: events.Event) -> None:
        if self.stopping.is_set():
            return
        if event.get("type") == "error":
            self.hub.metrics.error(str(event["code"]))
        text = events.dumps(event)
        try:
            self.queue.put_nowait(text)
            return
        except asyncio.QueueFull:
            pass
        try:
            await asyncio.wait_for(self.queue.put(text), timeout=self.slow_timeout)
        except TimeoutError:
            if not self.stopping.is_set():
                log.warning("closing connection: client did not read for %.1f s", self.slow_timeout)
                self.hub.metrics.slow_closes.inc()
                self.hub.metrics.error("slow_client")
                self.stop(Close.SLOW_CLIENT, "slow client")

    async def error(self, code: str, message: str, request_id: str | None = None, **extra: object) -> None:
        await self.send(events.error_event(code, message, request_id, **extra))

    # -- reading --------------------------------------------------------------------------------
    async def reader(self) -> None:
        try:
            while not self.stopping.is_set():
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                self.hub.metrics.ws_messages.inc()
                raw = message.get("text")
                if raw is None:
                    raw = message.get("bytes") or b""
                try:
                    await self.handle_frame(raw)
                except Exception:  # a bug of ours: log it, tell the client, keep the connection
                    log.exception("handling a frame failed")
                    await self.error("internal", "internal error while handling the message")
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            self.stop()

    async def rate_limit_wait(self) -> tuple[float, str]:
        """(seconds to wait, which limit). It is (0, "") when this message may go through."""
        if self.bucket is not None:
            wait = self.bucket.take()
            if wait > 0:
                limit = f"{self.bucket.rate:g} messages/s per connection (burst {self.bucket.burst})"
                return wait, f"too many messages (limit {limit}); retry in {wait:.2f} s"
        try:
            await self.hub.admission.take_request(self.client_ip, "messages")
        except Refused as refused:
            return refused.retry_after_s, refused.message
        return 0.0, ""

    async def handle_frame(self, raw: str | bytes) -> None:
        try:
            msg = P.parse_client_message(raw, self.hub.settings.server.max_frame_bytes)
        except P.ProtocolError as exc:
            if await self.within_rate(exc.request_id):
                await self.error(exc.code, exc.message, exc.request_id)
            return
        if not isinstance(msg, P.Cancel) and not await self.within_rate(getattr(msg, "id", None)):
            return  # cancelling lowers load: never refused
        if isinstance(msg, P.Ping):
            await self.send(events.pong_event(msg.data))
        elif isinstance(msg, P.Hello):
            await self.hello(msg)
        elif self.session is not None or await self.start_session(P.Hello()):
            # no hello first: a fresh session, as if an empty hello had been sent (not when auth is on)
            assert self.session is not None
            await self.route(msg, self.session)

    async def within_rate(self, request_id: str | None) -> bool:
        """Take a token for a message; an empty bucket gets `rate_limited`."""
        wait, why = await self.rate_limit_wait()
        if wait > 0:
            await self.error("rate_limited", why, request_id, retry_after_s=round(wait, 3))
        return wait <= 0

    async def route(self, msg: P.ClientMessage, session: Session) -> None:
        if isinstance(msg, P.Cancel):
            req = self.requests.get(msg.id)
            if req is None:
                await self.error("unknown_request", f"no request {msg.id!r} in flight", msg.id)
            else:
                req.cancel()
        elif isinstance(msg, P.Reset):
            await self.reset(session)
        elif isinstance(msg, P.Chat) and await self.admit(msg.id):
            await self.chat(msg, session)
        elif isinstance(msg, P.HandoffEmail):
            await self.send(await self.hub.console.leave_email(session, msg.email))
        elif isinstance(msg, P.TaskCall) and await self.admit(msg.id):
            req = Request(msg.id, "task")
            self.requests[msg.id] = req
            req.task = asyncio.create_task(self.run_task(req, msg))
            req.task.add_done_callback(functools.partial(self._task_ended, msg.id))

    async def admit(self, request_id: str) -> bool:
        """Whether a new request may start on this connection now. If not, the client is told why."""
        max_in_flight = self.hub.settings.server.max_in_flight
        if self.hub.state.readiness().draining:
            await self.error(
                "shutting_down", "the server is shutting down; reconnect in a moment", request_id
            )
        elif request_id in self.requests:
            await self.error("duplicate_id", f"request {request_id!r} is already in flight", request_id)
        elif len(self.requests) >= max_in_flight:
            await self.error(
                "too_many_requests",
                f"at most {max_in_flight} requests may be in flight on one connection",
                request_id,
            )
        else:
            return True
        return False

    @property
    def client(self) -> Client:
        """This connection as the turn service knows it."""
        return Client(Surface.PUBLIC, self.client_ip, self.client_name)

    async def chat(self, msg: P.Chat, session: Session) -> None:
        holder = self.hub.console.holder(session)
        # a human agent answers, not the bot; or the conversation waits for one (handoff.py)
        if holder is not None or self.hub.console.to_people(session, msg.text):
            await self.forward_chat(msg, session, holder)
            return
        if session.chat_request is not None:
            await self.error(
                "chat_busy",
                f"chat turn {session.chat_request!r} is still in progress; wait for its done (or cancel it)",
                msg.id,
                busy_id=session.chat_request,
            )
            return
        try:
            self.hub.store.require()  # a turn that could not be acknowledged is not started
        except StoreUnavailable as down:
            await self.error(down.code, down.message, msg.id)
            return
        turn = session.turn(msg.id, self.hub.sessions.clock)  # busy from here: a second chat is refused
        req = Request(msg.id, "chat")
        self.requests[msg.id] = req
        req.task = asyncio.create_task(
            self.hub.turns.run(turn, msg.text, msg.options, self.client, _Sink(self, req))
        )
        req.task.add_done_callback(functools.partial(self._chat_ended, req))

    # -- session --------------------------------------------------------------------------------
    async def hello(self, hello: P.Hello) -> None:
        if self.session is not None:
            await self.error(
                "already_started",
                "this connection already has a session; open a new connection to resume another",
            )
        else:
            await self.start_session(hello)

    async def start_session(self, hello: P.Hello) -> bool:
        try:
            self.hub.admission.authorize(Surface.PUBLIC, hello.auth_token or "", self.client_ip)
        except Refused as refused:
            await self.error(refused.code, refused.message)
            self.stop(refused.close, refused.code)
            return False
        self.client_name = hello.client
        try:
            session, resumed = await self.find_session(hello)
        except SessionRefused as refused:  # no conversation is dropped for a newcomer
            await self.error(refused.code, refused.message, retry_after_s=refused.retry_after_s)
            full = isinstance(refused, TooManySessions)
            self.stop(Close.TOO_MANY_SESSIONS if full else Close.NOT_READY, refused.code)
            return False
        except StoreUnavailable as exc:
            await self.error(exc.code, exc.message)
            self.stop(Close.NOT_READY, "session store unavailable")
            return False
        await self.attach(session, resumed)
        return True

    async def find_session(self, hello: P.Hello) -> tuple[Session, bool]:
        """The session the hello resumes, or a new one. Sends `session_expired` when it asked for one."""
        store = self.hub.store
        if hello.session_id is not None or hello.resume_token is not None:
            try:
                found = await store.resume(hello.session_id or "", hello.resume_token or "", self.client_ip)
            except SessionExpired:
                await self.error(
                    "session_expired", "that session is unknown or has expired; a new session was started"
                )
            else:
                self.client_name = self.client_name or found.client
                await self.hub.console.resumed(found)
                return found.session, True
        return await store.create(self.client_ip, self.client_name), False

    async def attach(self, session: Session, resumed: bool) -> None:
        old = session.connection
        if old is not None and old is not self:
            await old.error("session_taken_over", "this session was resumed by another connection")
            old.cancel_all()
            old.stop(Close.TAKEN_OVER, "session taken over")
        session.connection = self
        self.session = session
        self.started.set()
        await self.send(self.hub.ready_event(session, resumed))
        self.hub.events.publish(se.Attached(session, self.client_name, resumed))

    async def reset(self, session: Session) -> None:
        req = self.requests.get(session.chat_request) if session.chat_request else None
        if req is not None:
            req.cancel()
            if req.task is not None:
                await asyncio.wait({req.task})
        kept = session.clear()
        try:
            await self.hub.store.save(session, self.client_name)
        except StoreUnavailable as exc:  # not stored: not done either
            session.restore(kept)
            await self.error(exc.code, exc.message)
            return
        self.hub.drop_backend_session(session)
        self.hub.events.publish(se.Cleared(session))
        await self.send(events.reset_event(session.id))

    def cancel_all(self) -> None:
        for req in list(self.requests.values()):
            req.cancel()

    # -- requests -------------------------------------------------------------------------------
    async def failed(self, request_id: str, exc: Exception, what: str) -> None:
        """Tell the client why a request failed; log what the client cannot act on."""
        if isinstance(exc, Refused):
            retry = round(exc.retry_after_s, 3)
            await self.error(exc.code, exc.message, request_id, retry_after_s=retry)
            return
        code, message = error_code(exc)
        if isinstance(exc, GenerationFailed):  # the backend logged its cause
            log.warning("%s failed: %s", what, message)
        elif code == "internal" and not hasattr(exc, "code"):  # a TaskError was logged where it arose
            log.exception("%s failed", what)
        await self.error(code, message, request_id)

    async def forward_chat(self, msg: P.Chat, session: Session, holder: Holder | None) -> None:
        """A customer `chat` while an agent holds the session (or it waits for one: `holder` None). It
        goes to history and console. The bot does not reply.
        """
        try:
            text = await self.hub.turns.forward(session, msg.id, msg.text, self.client)
        except Exception as exc:
            code, message = error_code(exc)
            await self.error(code, message, msg.id)
            return
        await self.send(events.forwarded_event(msg.id, holder.name if holder is not None else None))
        self.run_auto_tasks(msg.id, text)

    async def run_task(self, req: Request, msg: P.TaskCall) -> None:
        hub = self.hub
        held: Reservation = NoReservation()
        try:
            tasks = hub.state.tasks
            tasks.check_caller(msg.task, CUSTOMERS)  # the agents' copilot tasks are not a customer's
            held = hub.admission.reserve(
                Surface.PUBLIC, self.client_ip, tasks.cost(msg.task, msg.options or None)
            )
            out = await tasks.run(
                hub.state.backend_for(msg.task),
                msg.task,
                msg.input,
                msg.options or None,
                scope=self.scope,
                caller=CUSTOMERS,
            )
            held.release(out.usage.get("prompt_tokens", 0) + out.usage.get("generated_tokens", 0))
            hub.metrics.requests.labels("ws", "task").inc()
            await self.send(events.result_event(msg.id, out))
        except asyncio.CancelledError:
            await self.error("cancelled", "the task was cancelled", msg.id)
        except Exception as exc:
            await self.failed(msg.id, exc, f"task {msg.task} (request {msg.id})")
        finally:
            held.release()
            self.requests.pop(msg.id, None)

    def _chat_ended(self, req: Request, task: asyncio.Task[None]) -> None:
        if self.requests.get(req.id) is req:  # ended without telling its sink (cancelled)
            del self.requests[req.id]

    def _task_ended(self, request_id: str, task: asyncio.Task[None]) -> None:
        if task.cancelled():  # cancelled before it started: run_task's own clean-up never ran
            self.requests.pop(request_id, None)
            self.spawn(self.error("cancelled", "the task was cancelled", request_id))

    def run_auto_tasks(self, request_id: str, text: str) -> None:
        """Run the configured auto-tasks on a user message, beside the reply. Results go to the client and
        the console.
        """
        for name in self.hub.state.tasks.auto_tasks:
            self.spawn(self.run_auto_task(request_id, name, text))

    async def run_auto_task(self, request_id: str, name: str, text: str) -> None:
        try:
            out = await self.hub.state.tasks.run(
                self.hub.state.backend_for(name), name, text, scope=self.scope
            )
            await self.send(events.result_event(request_id, out, auto=True))
            if self.session is not None:
                self.hub.events.publish(se.Tagged(self.session, request_id, out.task, out.output))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            code, message = error_code(exc)
            await self.error(code, message, request_id, task=name, auto=True)

    @property
    def scope(self) -> str | None:
        """Whose cached task results this connection may see: its session's only."""
        return None if self.session is None else f"session:{self.session.id}"

    def spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)


class _Sink:
    """A chat turn as its connection follows it. Holds the cancel handle, auto-tasks and `token` events."""

    def __init__(self, conn: Connection, req: Request):
        self.conn, self.req = conn, req

    def submitted(self, stream: Generation) -> None:
        self.req.stream = stream
        if self.req.cancelled:  # cancelled before its generation was queued
            stream.cancel()

    def started(self, text: str) -> None:
        self.conn.run_auto_tasks(self.req.id, text)

    async def token(self, text: str) -> None:
        await self.conn.send(events.token_event(self.req.id, text))

    async def done(self, done: TurnResult) -> bool:
        cited = done.sources if done.sources or done.unknown else None  # knowledge on: what it cited
        await self.conn.send(events.done_event(self.req.id, done.result, done.output, cited, done.unknown))
        self.conn.requests.pop(self.req.id, None)
        return not self.conn.stopping.is_set()

    async def failed(self, exc: Exception) -> None:
        await self.conn.failed(self.req.id, exc, f"chat turn {self.req.id}")
        self.conn.requests.pop(self.req.id, None)


class Hub:
    """The /ws endpoint. Owns live connections, the session registry, and the console it feeds."""

    def __init__(self, state: AppState, admission: Admission):
        self.state = state
        self.admission = admission
        self.settings = state.settings
        self.metrics = state.metrics
        ss, sec = self.settings.sessions, self.settings.security
        topology = state.topology
        self.sessions = SessionRegistry(
            ss.idle_timeout_s,
            ss.max_sessions,
            on_drop=self._on_drop,
            max_per_ip=topology.registry_cap(sec.max_sessions_per_ip),
        )
        self.store = topology.session_store(self.sessions)
        self.connections: set[Connection] = set()
        topology.join(NodeView(self.node_figures, self.connected))  # heartbeats before the console's
        self.console: ConsoleHub  # the agents' door, built and subscribed by create_app
        self.events = SessionEvents()
        self.turns = ChatTurns(state, admission, self.store, self.events, self.sessions.clock)
        state.counts = lambda: {"connections": len(self.connections), "sessions": len(self.sessions)}
        self.capacity = websocket_capacity(self.settings.server.max_websockets)  # /ws sockets at once

    def full(self) -> bool:
        """Whether a new /ws connection would be refused with `server_full` now."""
        return len(self.connections) >= self.capacity

    def node_figures(self) -> NodeFigures:
        return {
            "connections": len(self.connections),
            "sessions": sum(1 for c in self.connections if c.session is not None),
            "console_agents": self.console.agent_count(),
        }

    def connected(self) -> list[tuple[str, str]]:
        """(client IP, session id) of every connection with a session."""
        return [(c.client_ip, c.session.id) for c in self.connections if c.session is not None]

    def _on_drop(self, session: Session) -> None:
        self.metrics.expired.inc()
        self.drop_backend_session(session)
        self.events.publish(se.Dropped(session))
        self.store.forget(session)

    def drop_backend_session(self, session: Session) -> None:
        for backend in self.state.backends.values():
            backend.drop_session(session.id)

    def limits(self) -> dict[str, object]:
        s = self.settings
        limits: dict[str, object] = {
            "max_frame_bytes": s.server.max_frame_bytes,
            "max_in_flight": s.server.max_in_flight,
            "send_queue_size": s.server.send_queue_size,
            "slow_client_timeout_s": s.server.slow_client_timeout_s,
            "idle_timeout_s": s.sessions.idle_timeout_s,
        }
        try:
            chat = self.state.tasks.chat.task
        except Exception:
            return limits
        limits.update(
            {
                "max_input_chars": chat.max_input_chars,
                "max_input_tokens": chat.max_input_tokens,
                "max_new_tokens": chat.max_new_tokens,
                "max_history_turns": chat.max_history_turns,
                "max_history_tokens": chat.max_history_tokens,
                "overridable": {k: list(v) for k, v in chat.overridable.items()},
            }
        )
        return limits

    def ready_event(self, session: Session, resumed: bool) -> events.Event:
        registry = self.state.tasks
        holder = self.console.holder(session)
        return events.ready_event(
            session.id,
            session.resume_token,
            resumed,
            session.history_turns,
            self.limits(),
            registry.describe(CUSTOMERS),
            list(registry.auto_tasks),
            history=session.history,
            agent=holder.name if holder else None,
        )

    async def endpoint(self, ws: WebSocket) -> None:
        if not await accept(ws, self.settings.security, self.metrics):
            return
        try:
            self.admission.check_serving()  # Redis down aside: the hello then gets `unavailable`
        except Refused as refused:
            await refuse(ws, self.metrics, refused.code, refused.message, refused.close, refused.code)
            return
        if self.full():  # checked and counted with no await between: never more than the capacity
            why = f"this server holds its most chat connections ({self.capacity}); retry shortly"
            retry = {"retry_after_s": FULL_RETRY_S}
            await refuse(ws, self.metrics, "server_full", why, Close.FULL, "server full", **retry)
            return
        conn = Connection(self, ws)
        self.connections.add(conn)
        writer = asyncio.create_task(conn.writer())
        reader = asyncio.create_task(conn.reader())
        deadline = asyncio.create_task(self._hello_deadline(conn))
        try:
            await conn.stopping.wait()
        finally:
            deadline.cancel()
            self.connections.discard(conn)
            reader.cancel()
            conn.cancel_all()
            for task in list(conn.background):
                task.cancel()
            if conn.session is not None:
                for backend in self.state.backends.values():
                    if isinstance(backend, NextTurnPrefetcher):  # nobody is typing a next message
                        backend.cancel_prefetch(conn.session.id)
                self.sessions.detach(conn.session, conn)
                self.events.publish(se.Detached(conn.session))
                await self.store.release(conn.session, conn.client_ip)
            await conn.finish(reader, writer, drain=conn.close_code != Close.SLOW_CLIENT)

    async def _hello_deadline(self, conn: Connection) -> None:
        """Close a socket that starts no session in time. Idle sockets hold no server room."""
        timeout = self.settings.server.hello_timeout_s
        try:
            await asyncio.wait_for(conn.started.wait(), timeout)
        except TimeoutError:
            await conn.error("hello_timeout", f"no hello within {timeout:g} s of connecting")
            conn.stop(Close.HELLO_TIMEOUT, "hello timeout")

    async def drain(self, grace_s: float) -> None:
        """Graceful shutdown. Refuse new work and give in-flight requests `grace_s` to finish. End the rest
        with `shutting_down`. Close every connection with 1001 and wait (briefly) for them to go.
        """
        self.state.shutting_down = True
        await self.state.topology.leave()  # out of the cluster's view: its clients reconnect elsewhere
        self.console.close_all()
        for conn in list(self.connections):
            await conn.send(events.shutting_down_event(grace_s))
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(conn.requests for conn in self.connections):
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            for rid in list(conn.requests):
                await conn.error(
                    "shutting_down",
                    f"the server is shutting down; this request did not finish within {grace_s:g} s",
                    rid,
                )
            conn.cancel_all()
            conn.stop(Close.GOING_AWAY, "server shutting down")
        deadline = time.monotonic() + 2.0
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def close_all(self) -> None:
        self.console.close_all()
        for conn in list(self.connections):
            conn.cancel_all()
            conn.stop(Close.GOING_AWAY, "server shutting down")
