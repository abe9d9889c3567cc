"""The /ws endpoint: one reader and one writer per connection, the session registry, request routing.

Per connection:
- a reader loop takes frames, validates them with `protocol` (a bad frame gets an `error` event and
  the connection stays up) and starts one asyncio task per request, keyed by the request id;
- a writer task drains a bounded send queue (`server.send_queue_size` events). Producers that find it
  full wait up to `server.slow_client_timeout_s` for room; after that the client is considered not to
  be reading: the connection is closed with code 4008 ("slow client") and its generations cancelled.
  Server memory per connection is bounded by the queue, and a slow reader never delays the engine or
  other clients (the engine never waits for a stream's consumer);
- every frame but `cancel` takes a token from the connection's and the client IP's token buckets
  (`security.rate_limit_*`); an empty bucket gets `rate_limited` with `retry_after_s`;
- chat turns of a session are serialised: a `chat` while one is in progress is refused with
  `chat_busy` (nothing is queued server-side);
- on disconnect every generation of the connection is cancelled (the engine drops it at its next
  step) and the session is detached, to be resumed or to expire.

Shutdown (`Hub.drain`, called by the server on SIGTERM before uvicorn closes sockets): every connection
gets a `shutting_down` event, new requests are refused with `shutting_down`, in-flight ones have
`server.shutdown_grace_s` to finish; those still running then end with error `shutting_down`, and the
sockets close with 1001.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from ..engine.backend import FinishReason, Generation, NextTurnPrefetcher
from ..tasks.chat import LastTurn
from . import events
from . import protocol as P
from .admission import Admission, NoReservation, Refused, Reservation, Surface, client_key
from .cluster import ClusterUnavailable
from .connection import Close, QueuedConnection, accept, client_ip, refuse
from .console import ConsoleHub
from .errors import GenerationFailed, error_code
from .ratelimit import TokenBucket
from .seams import NodeView
from .session import Session, SessionExpired, SessionRegistry, TooManySessions
from .state import AppState

log = logging.getLogger("rtserver.hub")


@dataclass
class Request:
    id: str
    kind: str  # chat | task
    task: asyncio.Task | None = None
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


def _kept_prefix(prompt: list[int], last: LastTurn | None) -> int:
    """How many of the prompt's first tokens are the session's own last turn (its KV, kept)."""
    if last is None or prompt[: len(last.ids)] != last.ids:
        return 0
    return len(last.ids)


def _remove(history: list[dict], entry: dict) -> None:
    """Take this very entry out (by identity: equal text may be another message)."""
    for i in range(len(history) - 1, -1, -1):
        if history[i] is entry:
            del history[i]
            return


def _insert_after(history: list[dict], entry: dict, new: dict) -> None:
    """Put `new` right after `entry` (at the end when the window cut `entry` off)."""
    for i in range(len(history) - 1, -1, -1):
        if history[i] is entry:
            history.insert(i + 1, new)
            return
    history.append(new)


class Connection(QueuedConnection):
    def __init__(self, hub: Hub, ws: WebSocket):
        ss = hub.settings.server
        super().__init__(ws, ss.send_queue_size)
        self.hub = hub
        self.slow_timeout = ss.slow_client_timeout_s
        self.requests: dict[str, Request] = {}
        self.session: Session | None = None
        self.client_name: str | None = None
        self.background: set[asyncio.Task] = set()
        self.client_ip = client_key(client_ip(ws))  # what per-client limits count (IPv6: its /64)
        self.started = asyncio.Event()  # set once a session is attached (the hello deadline ends)
        sec = hub.settings.security
        self.bucket = (
            TokenBucket(sec.rate_limit_per_s, sec.rate_limit_burst) if sec.rate_limit_per_s > 0 else None
        )

    # -- sending --------------------------------------------------------------------------------
    async def send(self, event: dict) -> None:
        if self.stopping.is_set():
            return
        if event.get("type") == "error":
            self.hub.metrics.error(event["code"])
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

    async def error(self, code: str, message: str, request_id: str | None = None, **extra: Any) -> None:
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
        """(seconds to wait, which limit) — (0, "") when this message may go through."""
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
            msg, error = None, exc
        if not isinstance(msg, P.Cancel):  # cancelling lowers load: never refused
            wait, why = await self.rate_limit_wait()
            if wait > 0:
                rid = getattr(msg, "id", None) if msg is not None else error.request_id
                await self.error("rate_limited", why, rid, retry_after_s=round(wait, 3))
                return
        if msg is None:
            await self.error(error.code, error.message, error.request_id)
            return
        if isinstance(msg, P.Ping):
            await self.send(events.pong_event(msg.data))
            return
        if isinstance(msg, P.Hello):
            if self.session is not None:
                await self.error(
                    "already_started",
                    "this connection already has a session; open a new connection to resume another",
                )
                return
            await self.start_session(msg)
            return
        if self.session is None:
            # No hello first: a fresh session, as if an empty hello had been sent (not when auth is on).
            if not await self.start_session(P.Hello()):
                return
        session = self.session
        assert session is not None  # start_session attached one
        if isinstance(msg, P.Cancel):
            req = self.requests.get(msg.id)
            if req is None:
                await self.error("unknown_request", f"no request {msg.id!r} in flight", msg.id)
            else:
                req.cancel()
            return
        if isinstance(msg, P.Reset):
            await self.reset()
            return
        if self.hub.state.shutting_down:
            await self.error("shutting_down", "the server is shutting down; reconnect in a moment", msg.id)
            return
        if msg.id in self.requests:
            await self.error("duplicate_id", f"request {msg.id!r} is already in flight", msg.id)
            return
        max_in_flight = self.hub.settings.server.max_in_flight
        if len(self.requests) >= max_in_flight:
            await self.error(
                "too_many_requests",
                f"at most {max_in_flight} requests may be in flight on one connection",
                msg.id,
            )
            return
        if isinstance(msg, P.Chat):
            if self.hub.console.holder(session) is not None:  # a human agent answers, not the bot
                await self.hub.console.forward_chat(self, session, msg)
                return
            if session.chat_request is not None:
                await self.error(
                    "chat_busy",
                    f"chat turn {session.chat_request!r} is still in progress; "
                    "wait for its done (or cancel it)",
                    msg.id,
                    busy_id=session.chat_request,
                )
                return
            try:
                self.hub.store.require()  # a turn that could not be acknowledged is not started
            except ClusterUnavailable as down:
                await self.error(down.code, down.message, msg.id)
                return
            req = Request(msg.id, "chat")
            session.chat_request = msg.id
            self.requests[msg.id] = req
            req.task = asyncio.create_task(self.run_chat(req, msg, session))
        else:
            req = Request(msg.id, "task")
            self.requests[msg.id] = req
            req.task = asyncio.create_task(self.run_task(req, msg))
            req.task.add_done_callback(functools.partial(self._task_ended, msg.id))

    # -- session --------------------------------------------------------------------------------
    async def start_session(self, hello: P.Hello) -> bool:
        hub = self.hub
        try:
            hub.admission.authorize(Surface.PUBLIC, hello.auth_token or "", self.client_ip)
        except Refused as refused:
            await self.error(refused.code, refused.message)
            self.stop(refused.close, refused.code)
            return False
        self.client_name = hello.client
        session: Session | None = None
        resumed = False
        try:
            if hello.session_id is not None or hello.resume_token is not None:
                try:
                    found = await hub.store.resume(
                        hello.session_id or "", hello.resume_token or "", self.client_ip
                    )
                    session, resumed = found.session, True
                    self.client_name = self.client_name or found.client
                    await hub.console.resumed(found)
                except SessionExpired:
                    await self.error(
                        "session_expired", "that session is unknown or has expired; a new session was started"
                    )
            if session is None:
                session = await hub.store.create(self.client_ip, self.client_name)
        except TooManySessions:
            cap = hub.settings.security.max_sessions_per_ip
            await self.error(
                "too_many_sessions",
                f"this address already has {cap} connected sessions (the limit); close one first",
            )
            self.stop(Close.TOO_MANY_SESSIONS, "too many sessions")
            return False
        except ClusterUnavailable as exc:
            await self.error(exc.code, exc.message)
            self.stop(Close.NOT_READY, "session store unavailable")
            return False
        if session.connection is not None and session.connection is not self:
            old = session.connection
            await old.error("session_taken_over", "this session was resumed by another connection")
            old.cancel_all()
            old.stop(Close.TAKEN_OVER, "session taken over")
        session.connection = self
        self.session = session
        self.started.set()
        await self.send(hub.ready_event(session, resumed))
        hub.console.attached(session, self.client_name, resumed)
        return True

    async def reset(self) -> None:
        session = self.session
        assert session is not None
        req = self.requests.get(session.chat_request) if session.chat_request else None
        if req is not None:
            req.cancel()
            if req.task is not None:
                await asyncio.wait({req.task})
        kept = (session.history, session.last_turn, session.turns)
        session.history, session.last_turn, session.turns = [], None, 0
        try:
            await self.hub.store.save(session, self.client_name)
        except ClusterUnavailable as exc:  # not stored: not done either
            session.history, session.last_turn, session.turns = kept
            await self.error(exc.code, exc.message)
            return
        self.hub.drop_backend_session(session)
        self.hub.console.reset(session)
        await self.send({"type": "reset", "session_id": session.id})

    def cancel_all(self) -> None:
        for req in list(self.requests.values()):
            req.cancel()

    # -- requests -------------------------------------------------------------------------------
    async def run_chat(self, req: Request, msg: P.Chat, session: Session) -> None:
        hub = self.hub
        added = False
        reply, reason = None, "error"
        held: Reservation = NoReservation()
        try:
            chat = hub.state.tasks.chat
            turn = chat.prepare_turn(session.history, msg.text, session.last_turn)
            params = chat.task.sampling(msg.options or None)
            rendered, prompt = turn.rendered, turn.prompt_ids
            new_tokens = len(prompt) - _kept_prefix(prompt, session.last_turn)
            held = hub.admission.reserve(Surface.PUBLIC, self.client_ip, new_tokens + params.max_new_tokens)
            stream = hub.state.backend_for("chat").generate(
                prompt, params, session_key=session.id, public_tokens=turn.public_tokens
            )
            req.stream = stream
            if req.cancelled:
                stream.cancel()
            if turn.cut:
                session.cuts += 1
            session.history = turn.history
            user = turn.history[-1]  # this turn's message: messages forwarded to an agent may follow it
            added = True
            hub.console.user_message(session, msg.id, turn.text)
            self.run_auto_tasks(msg.id, turn.text)
            async for event in stream:
                if event.text:
                    await self.send(events.token_event(msg.id, event.text))
                    hub.console.bot_token(session, msg.id, event.text)
            result = await stream.result()
            held.release(new_tokens + result.usage.generated_tokens)
            if result.finish_reason is FinishReason.ERROR:
                raise GenerationFailed(result)
            if result.text or result.finish_reason is not FinishReason.CANCELLED:
                kept = (session.last_turn, session.turns)
                answer = {"role": "assistant", "content": result.text}
                _insert_after(session.history, user, answer)
                last = session.history[-1] is answer  # else the KV of this turn is not the prompt's start
                session.last_turn = (
                    chat.finished_turn(rendered, prompt, result.text, result.token_ids) if last else None
                )
                session.turns += 1
                try:  # the turn is acknowledged only once it is stored
                    await hub.store.save(session, self.client_name)
                except ClusterUnavailable:
                    _remove(session.history, answer)  # neither stored nor acknowledged: never ran
                    session.last_turn, session.turns = kept
                    raise
                added = False
            reply, reason = result.text, result.finish_reason.value
            hub.metrics.observe_generation("ws_chat", result)
            hub.metrics.requests.labels("ws", "chat").inc()
            await self.send(events.done_event(msg.id, result, chat.parse(result.text)))
            self.prefetch_next_turn(session)
        except asyncio.CancelledError:
            raise
        except Refused as refused:
            await self.error(
                refused.code, refused.message, msg.id, retry_after_s=round(refused.retry_after_s, 3)
            )
        except Exception as exc:
            code, message = error_code(exc)
            if isinstance(exc, GenerationFailed):  # the backend logged its cause
                log.warning("chat turn %s failed: %s", msg.id, message)
            elif code == "internal":
                log.exception("chat turn %s failed", msg.id)
            await self.error(code, message, msg.id)
        finally:
            held.release()
            if added:  # a failed or empty cancelled turn leaves no trace (only its own message goes)
                _remove(session.history, user)
            session.touch(hub.sessions.clock())
            if session.chat_request == msg.id:
                session.chat_request = None
            self.requests.pop(msg.id, None)
            hub.console.bot_done(session, msg.id, reply, reason)

    def prefetch_next_turn(self, session: Session) -> None:
        """The reply has ended: let the chat backend compute the next prompt's start (history, end of the
        reply, next user header) before the next message comes, where it can (a remote backend) and the
        chat template splits safely there. Best effort: it never raises into the turn, which has ended."""
        wanted = self.hub.settings.backend.prefetch_next_turn and session.last_turn is not None
        if not wanted or self.stopping.is_set():
            return
        try:
            backend = self.hub.state.backend_for("chat")  # raises while the server stops
            if isinstance(backend, NextTurnPrefetcher):
                # computed by the backend when it sends the prefetch, not here: a client that answers
                # at once would otherwise wait for it (its next turn comes right after this `done`)
                chat, history, last = self.hub.state.tasks.chat, list(session.history), session.last_turn
                backend.prefetch(lambda: chat.next_turn_prefix(history, last), session_key=session.id)
        except Exception as exc:
            log.debug("no next-turn prefetch for session %s (%s)", session.id, exc)

    async def run_task(self, req: Request, msg: P.TaskCall) -> None:
        hub = self.hub
        held: Reservation = NoReservation()
        try:
            tasks = hub.state.tasks
            held = hub.admission.reserve(
                Surface.PUBLIC, self.client_ip, tasks.cost(msg.task, msg.options or None)
            )
            out = await tasks.run(
                hub.state.backend_for(msg.task), msg.task, msg.input, msg.options or None, scope=self.scope
            )
            held.release(out.usage.get("prompt_tokens", 0) + out.usage.get("generated_tokens", 0))
            hub.metrics.requests.labels("ws", "task").inc()
            await self.send(events.result_event(msg.id, out))
        except asyncio.CancelledError:
            await self.error("cancelled", "the task was cancelled", msg.id)
        except Refused as refused:
            await self.error(
                refused.code, refused.message, msg.id, retry_after_s=round(refused.retry_after_s, 3)
            )
        except Exception as exc:
            code, message = error_code(exc)
            if code == "internal" and not hasattr(exc, "code"):  # a TaskError was logged where it arose
                log.exception("task %s (request %s) failed", msg.task, msg.id)
            await self.error(code, message, msg.id)
        finally:
            held.release()
            self.requests.pop(msg.id, None)

    def _task_ended(self, request_id: str, task: asyncio.Task) -> None:
        if task.cancelled():  # cancelled before it started: run_task's own clean-up never ran
            self.requests.pop(request_id, None)
            self.spawn(self.error("cancelled", "the task was cancelled", request_id))

    def run_auto_tasks(self, request_id: str, text: str) -> None:
        """Run the configured auto-tasks on a user message, beside the reply (results go to the client
        and the console)."""
        for name in self.hub.state.tasks.auto_tasks:
            self.spawn(self.run_auto_task(request_id, name, text))

    async def run_auto_task(self, request_id: str, name: str, text: str) -> None:
        try:
            out = await self.hub.state.tasks.run(
                self.hub.state.backend_for(name), name, text, scope=self.scope
            )
            await self.send(events.result_event(request_id, out, auto=True))
            if self.session is not None:
                self.hub.console.auto_result(self.session, request_id, out.task, out.output)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            code, message = error_code(exc)
            await self.error(code, message, request_id, task=name, auto=True)

    @property
    def scope(self) -> str | None:
        """Whose cached task results this connection may see: its session's only."""
        return None if self.session is None else f"session:{self.session.id}"

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)


class Hub:
    """The /ws endpoint: live connections, the session registry, and the console it feeds."""

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
        # the agent console's registry (/ws/console)
        self.console = ConsoleHub(state, self.sessions, self.store, topology)
        state.counts = lambda: {"connections": len(self.connections), "sessions": len(self.sessions)}

    def node_figures(self) -> dict[str, Any]:
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
        self.console.dropped(session)
        self.store.forget(session)

    def drop_backend_session(self, session: Session) -> None:
        for backend in self.state.backends.values():
            backend.drop_session(session.id)

    def limits(self) -> dict:
        s = self.settings
        limits: dict[str, Any] = {
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

    def ready_event(self, session: Session, resumed: bool) -> dict:
        registry = self.state.tasks
        holder = self.console.holder(session)
        return events.ready_event(
            session.id,
            session.resume_token,
            resumed,
            session.history_turns,
            self.limits(),
            registry.describe(),
            list(registry.auto_tasks),
            history=session.history,
            agent=holder["name"] if holder else None,
        )

    async def endpoint(self, ws: WebSocket) -> None:
        if not await accept(ws, self.settings.security, self.metrics):
            return
        try:
            self.admission.check_serving()  # Redis down aside: the hello then gets `unavailable`
        except Refused as refused:
            await refuse(ws, self.metrics, refused.code, refused.message, refused.close, refused.code)
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
                self.console.detached(conn.session)
                await self.store.release(conn.session, conn.client_ip)
            await conn.finish(reader, writer, drain=conn.close_code != Close.SLOW_CLIENT)

    async def _hello_deadline(self, conn: Connection) -> None:
        """A socket that starts no session in time is closed: idle sockets hold no server room."""
        timeout = self.settings.server.hello_timeout_s
        try:
            await asyncio.wait_for(conn.started.wait(), timeout)
        except TimeoutError:
            await conn.error("hello_timeout", f"no hello within {timeout:g} s of connecting")
            conn.stop(Close.HELLO_TIMEOUT, "hello timeout")

    async def drain(self, grace_s: float) -> None:
        """Graceful shutdown: refuse new work, give in-flight requests `grace_s` to finish, end the rest
        with `shutting_down`, close every connection with 1001 and wait (briefly) for them to go."""
        self.state.shutting_down = True
        await self.state.topology.leave()  # out of the cluster's view: its clients reconnect elsewhere
        self.console.close_all()
        for conn in list(self.connections):
            await conn.send({"type": "shutting_down", "deadline_s": grace_s})
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
