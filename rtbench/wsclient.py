"""The tools' WebSocket client steps on `/ws` and `/console`: connect, read one event, say hello."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection


async def connect(url: str, **kwargs: Any) -> ClientConnection:
    return await websockets.connect(url, open_timeout=60, max_size=None, **kwargs)


async def recv(ws: ClientConnection, timeout_s: float = 120.0) -> dict[str, Any]:
    event: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), timeout_s))
    return event


async def hello(ws: ClientConnection, client: str = "loadtest") -> dict[str, Any]:
    """The session's `ready`, or the `error` that refused it."""
    await ws.send(json.dumps({"type": "hello", "client": client}))
    while True:
        ev = await recv(ws)
        if ev["type"] in ("ready", "error"):
            return ev
