"""The outgoing side of a WebSocket connection, shared by the hub's and the console's: a bounded send
queue drained by a writer task, a stop signal carrying the close code to send, refusing a connection
with an error event, and ending a connection that has a reader and a writer task."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.websockets import WebSocket

from . import protocol as P

CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008
CLOSE_SLOW_CLIENT = 4008
CLOSE_UNAUTHORIZED = 4401


class QueuedConnection:
    """A WebSocket whose events go out through `queue`, written by `writer()`; `stop()` ends it."""

    def __init__(self, ws: WebSocket, queue_size: int):
        self.ws = ws
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=queue_size)
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

    async def finish(self, reader: asyncio.Task, writer: asyncio.Task, drain: bool = True) -> None:
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


async def refuse(ws: WebSocket, metrics: Any, code: str, message: str, close_code: int, reason: str) -> None:
    """Tell an accepted connection why it is refused, then close it."""
    metrics.error(code)
    try:
        await ws.send_text(P.dumps(P.error_event(code, message)))
        await ws.close(code=close_code, reason=reason)
    except Exception:  # the peer may already be gone
        pass
