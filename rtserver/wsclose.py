"""Ending a WebSocket connection that has a reader and a writer task (the hub's and the console's)."""

from __future__ import annotations

import asyncio

from starlette.websockets import WebSocket


async def finish_connection(ws: WebSocket, queue: asyncio.Queue, reader: asyncio.Task, writer: asyncio.Task,
                            close_code: int | None, close_reason: str, drain: bool = True) -> None:
    """Let queued events out for a moment (unless `drain` is off: a slow client's send would block),
    close with `close_code` when the server decided to close, and wait for both tasks to end."""
    if close_code is not None:
        if drain:
            for _ in range(50):
                if queue.empty():
                    break
                await asyncio.sleep(0.01)
        writer.cancel()
        try:
            await asyncio.wait_for(ws.close(code=close_code, reason=close_reason), 1.0)
        except Exception:  # the peer may already be gone; closing is best effort
            pass
    else:
        writer.cancel()
    await asyncio.gather(reader, writer, return_exceptions=True)
