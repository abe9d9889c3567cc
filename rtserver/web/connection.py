"""What the hub's and the console's WebSocket connections share: the table of close codes, accepting a
connection (origin check), its client address, a bounded send queue drained by a writer task, a stop
signal carrying the close code to send, refusing a connection with an error event, and ending a
connection that has a reader and a writer task."""

from __future__ import annotations

import asyncio
import enum
import urllib.parse
from typing import Any

from starlette.requests import HTTPConnection
from starlette.websockets import WebSocket

from ..config import SecuritySettings
from . import events
from .headers import split_host
from .metrics import Metrics

DEFAULT_PORTS = {"http": 80, "https": 443}  # of a page's origin: a WebSocket comes from a page
MAX_ORIGIN_CHARS = 200  # of a refused Origin in the error message


class Close(enum.IntEnum):
    """Every WebSocket close code the server sends (docs/protocol.md lists them for clients)."""

    GOING_AWAY = 1001  # server shutting down
    POLICY = 1008  # origin not allowed
    NOT_READY = 1013  # the model is still loading
    FULL = 1013  # the node holds server.max_websockets widgets: retry, here or on another node
    SLOW_CLIENT = 4008  # the client did not read its events
    HELLO_TIMEOUT = 4408  # no session started within the deadline
    LOGIN_TIMEOUT = 4408  # a console socket that did not log in in time
    UNAUTHORIZED = 4401
    DISABLED = 4403  # the console is off (no console token)
    TAKEN_OVER = 4409  # the session was resumed by another connection
    TOO_MANY_SESSIONS = 4429  # also: too many open connections from one client


def client_ip(conn: HTTPConnection) -> str:
    """The peer address of a WebSocket or HTTP request (uvicorn rewrites it from X-Forwarded-For when
    the request comes through a proxy listed in `server.forwarded_allow_ips`)."""
    client = conn.scope.get("client")
    return client[0] if client else ""


def origin_allowed(ws: WebSocket, security: SecuritySettings) -> bool:
    """/ws: any page unless `security.allowed_origins` lists them (the widget is embedded anywhere)."""
    allowed = security.allowed_origins
    if not allowed or "*" in allowed:
        return True
    origin = ws.headers.get("origin")
    return origin is None or origin in allowed


def same_origin(origin: str, host: str | None) -> bool:
    """Whether a page's Origin names the host and port the request was sent to (its Host header)."""
    try:
        page = urllib.parse.urlsplit(origin)
        page_port = page.port or DEFAULT_PORTS.get(page.scheme)
    except ValueError:  # a port that is no number
        return False
    if page.scheme not in DEFAULT_PORTS or not page.hostname or host is None:
        return False
    name, port = split_host(host)
    return page.hostname == name and page_port == (port or DEFAULT_PORTS[page.scheme])


def console_origin_allowed(ws: WebSocket, security: SecuritySettings) -> bool:
    """/ws/console: its own page (same origin), the pages of `security.console_origins`, and clients
    that are no page (no Origin header)."""
    origin = ws.headers.get("origin")
    allowed = [o.rstrip("/").lower() for o in security.console_origins]
    if origin is None or "*" in allowed or origin.rstrip("/").lower() in allowed:
        return True
    return same_origin(origin, ws.headers.get("host"))


async def accept(ws: WebSocket, security: SecuritySettings, metrics: Metrics, console: bool = False) -> bool:
    """Accept a WebSocket (/ws, or /ws/console when `console`); a foreign browser origin is then
    refused with `forbidden_origin` and close 1008 (the client gets a reason, not a bare HTTP 403)."""
    await ws.accept()
    if (console_origin_allowed if console else origin_allowed)(ws, security):
        return True
    origin = repr(ws.headers.get("origin", "")[:MAX_ORIGIN_CHARS])
    setting = "the console's own page, security.console_origins" if console else "security.allowed_origins"
    message = f"origin {origin} is not allowed ({setting})"
    await refuse(ws, metrics, "forbidden_origin", message, Close.POLICY, "origin not allowed")
    return False


class QueuedConnection:
    """A WebSocket whose events go out through `queue`, written by `writer()`; `stop()` ends it."""

    def __init__(self, ws: WebSocket, queue_size: int):
        self.ws = ws
        self.queue: asyncio.Queue[str] = asyncio.Queue(maxsize=queue_size)
        self.stopping = asyncio.Event()
        self.close_code: int | None = None
        self.close_reason = ""

    def stop(self, code: int | None = None, reason: str = "") -> None:
        if not self.stopping.is_set():
            self.close_code, self.close_reason = code, reason
            self.stopping.set()

    async def writer(self) -> None:
        try:
            while True:
                await self.ws.send_text(await self.queue.get())
        except asyncio.CancelledError:
            raise
        except Exception:  # client gone
            self.stop()

    async def finish(
        self, reader: asyncio.Task[None], writer: asyncio.Task[None], drain: bool = True
    ) -> None:
        """Let queued events out for a moment (unless `drain` is off: a slow client's send would block),
        close with the stop's code when the server decided to close, and wait for both tasks to end."""
        if self.close_code is not None:
            if drain:
                for _ in range(50):
                    if self.queue.empty():
                        break
                    await asyncio.sleep(0.01)
            writer.cancel()
            try:
                await asyncio.wait_for(self.ws.close(code=self.close_code, reason=self.close_reason), 1.0)
            except Exception:  # the peer may already be gone; closing is best effort
                pass
        else:
            writer.cancel()
        await asyncio.gather(reader, writer, return_exceptions=True)


async def refuse(
    ws: WebSocket, metrics: Metrics, code: str, message: str, close_code: int, reason: str, **extra: Any
) -> None:
    """Tell an accepted connection why it is refused (`extra`: more fields of the error event), then
    close it."""
    metrics.error(code)
    try:
        await ws.send_text(events.dumps(events.error_event(code, message, None, **extra)))
        await ws.close(code=close_code, reason=reason)
    except Exception:  # the peer may already be gone
        pass
