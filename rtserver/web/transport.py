"""The HTTP/1.1 protocol uvicorn runs for rtserver, and the process's file-descriptor budget.

uvicorn times out only idle keep-alive sockets: one that sends nothing, or half a request, is held until
the client leaves (uvicorn issue 157 asks for a request-start timeout). `protocol_class` is uvicorn's
httptools protocol with a deadline: a request must arrive whole, head and body, within
`server.request_timeout_s` of the socket opening or of the previous reply; else the socket is closed,
with 408 when it had sent part of a head. A WebSocket leaves the deadline once its upgrade head is read
(the hub's hello deadline takes over). When open sockets reach the descriptor budget (`ulimit -n` less a
reserve), the oldest socket still waiting for its request is closed to make room: health checks and
pages, which send their request at once, keep getting through.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("rtserver.transport")

RESERVED_FDS = 512  # model and kernel files, Redis and upstream pools, logs: never sockets of clients
HTTP_ROOM = 256  # sockets kept for HTTP (health checks, pages, the API) when WebSockets are capped by fds
SUMMARY_EVERY_S = 60.0  # closed sockets are logged as one count per this long, not one line each


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit where allowed; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # a hard limit of "unlimited" may exceed the kernel's nr_open
            pass
    return soft


def socket_budget() -> int:
    """How many client sockets this process may hold: its open-file limit less `RESERVED_FDS`."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(64, soft - RESERVED_FDS)


def websocket_capacity(max_websockets: int) -> int:
    """`server.max_websockets`, lowered where the descriptor budget would not leave room for HTTP."""
    return max(1, min(max_websockets, socket_budget() - HTTP_ROOM))


class _Shed:
    """Sockets waiting for a request, oldest first, and a count of those closed (logged once a while)."""

    def __init__(self) -> None:
        self.waiting: dict[DeadlineProtocol, None] = {}  # insertion-ordered set
        self.closing = 0  # closed to make room, not yet gone from uvicorn's connections
        self.closed = 0
        self.logged_at = time.monotonic()

    def count(self, timeout_s: float) -> None:
        self.closed += 1
        now = time.monotonic()
        if now - self.logged_at >= SUMMARY_EVERY_S:
            log.warning(
                "closed %d sockets that sent no whole request within %g s (or made room for new ones)",
                self.closed,
                timeout_s,
            )
            self.closed, self.logged_at = 0, now


class DeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on reading each request (`protocol_class` sets the
    class attributes per server)."""

    timeout_s: float = 10.0
    max_sockets: int = 1 << 20
    shed: _Shed = _Shed()

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._in_head = False  # part of a request head has come, not all of it
        self._shed = False  # closed to make room for a new socket

    # -- the deadline ---------------------------------------------------------------------------------
    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.timeout_s, self._expired)
        self.shed.waiting[self] = None

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.shed.waiting.pop(self, None)

    def _expired(self) -> None:
        self._deadline = None
        self.shed.waiting.pop(self, None)
        self._close_waiting()

    def _close_waiting(self) -> None:
        """Close a socket that has not sent its request in time (408 if it sent part of a head)."""
        self.shed.count(self.timeout_s)
        if self.transport.is_closing():
            return
        if self._in_head:
            self._send_408()
        self.transport.close()

    def _send_408(self) -> None:
        body = b"request not received in time"
        head = [b"HTTP/1.1 408 Request Timeout\r\n"]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: text/plain; charset=utf-8\r\n",
            b"x-content-type-options: nosniff\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)

    def _make_room(self) -> None:
        """At the socket budget: the oldest sockets still waiting for their request go first."""
        excess = len(self.connections) - self.shed.closing - self.max_sockets
        while excess > 0 and self.shed.waiting:
            oldest = next(iter(self.shed.waiting))
            if oldest is self:
                break
            oldest._disarm()
            oldest._shed = True  # counted as open until its connection_lost
            self.shed.closing += 1
            oldest._close_waiting()
            excess -= 1

    # -- uvicorn's protocol ----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._shed:
            self._shed = False
            self.shed.closing -= 1
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()
        if self.parser.should_upgrade() and self._should_upgrade():
            self._disarm()  # a WebSocket: read by its own protocol from now on

    def on_message_complete(self) -> None:
        super().on_message_complete()
        upgrade = self.parser.should_upgrade() and self._should_upgrade()
        if not upgrade and self.cycle.response_complete and not self.pipeline:
            self._arm()  # answered before its body was all read: now the next request's deadline
        else:
            self._disarm()

    def on_response_complete(self) -> None:
        idle = not self.pipeline  # else the next request has come already and starts now
        super().on_response_complete()
        if idle and not self.transport.is_closing():
            self._arm()


def protocol_class(request_timeout_s: float) -> type[DeadlineProtocol]:
    """The HTTP protocol class for one server: its deadline, its socket budget, its own waiting list."""
    return type(
        "DeadlineProtocol",
        (DeadlineProtocol,),
        {"timeout_s": request_timeout_s, "max_sockets": socket_budget(), "shed": _Shed()},
    )
