"""The HTTP protocol's request deadline and socket budget (rtserver/web/transport.py), on a bare app under
uvicorn: sockets that send nothing, half a head, a trickle or half a body are closed at the deadline;
requests, keep-alive and WebSockets that behave are not; at the budget the oldest silent socket goes."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import uvicorn
import websockets
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from rtserver.web.transport import protocol_class

DEADLINE_S = 0.5
SLACK_S = 1.5  # a busy two-core machine


async def _echo(request: Request) -> PlainTextResponse:
    return PlainTextResponse((await request.body()).decode() or "ok")


async def _ws(ws: WebSocket) -> None:
    await ws.accept()
    async for text in ws.iter_text():
        await ws.send_text(text)


APP = Starlette(routes=[Route("/", _echo, methods=["GET", "POST"]), WebSocketRoute("/ws", _ws)])


@contextlib.asynccontextmanager
async def _server(max_sockets: int | None = None):
    http = protocol_class(DEADLINE_S)
    if max_sockets is not None:
        http.max_sockets = max_sockets
    config = uvicorn.Config(APP, host="127.0.0.1", port=0, http=http, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "server did not start"
        await asyncio.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)


async def _held(port: int, sent: bytes = b"", trickle: bytes = b"") -> tuple[float, bytes]:
    """Open a socket, send `sent` (then `trickle` a byte every 0.1 s): (seconds until the server closed
    it, what it answered)."""
    opened = time.monotonic()  # before the connect: the server's clock for it cannot start earlier
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def dribble() -> None:
        writer.write(sent)
        for byte in trickle:
            await asyncio.sleep(0.1)
            writer.write(bytes([byte]))

    dribbling = asyncio.create_task(dribble())
    got = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(4096), DEADLINE_S + SLACK_S):
            got += chunk
    except ConnectionError:
        pass
    finally:
        dribbling.cancel()
        writer.close()
    return time.monotonic() - opened, got


async def test_a_silent_socket_is_closed_quietly_at_the_deadline():
    async with _server() as port:
        seconds, got = await _held(port)
    assert DEADLINE_S - 0.1 <= seconds <= DEADLINE_S + SLACK_S and got == b"", (seconds, got)


async def test_half_a_head_or_a_trickle_gets_408_at_the_deadline():
    async with _server() as port:
        half = await _held(port, b"GET / HTTP/1.1\r\nHost: x\r\n")
        trickled = await _held(port, b"GET / HTTP/1.1\r\n", trickle=b"X-Slow: " + b"a" * 100)
    for seconds, got in (half, trickled):
        assert DEADLINE_S - 0.1 <= seconds <= DEADLINE_S + SLACK_S, seconds
        assert got.startswith(b"HTTP/1.1 408 ") and b"connection: close" in got, got


async def test_half_a_body_is_closed_at_the_deadline():
    async with _server() as port:
        seconds, got = await _held(port, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabcde")
    assert DEADLINE_S - 0.1 <= seconds <= DEADLINE_S + SLACK_S and got == b"", (seconds, got)


async def test_requests_keep_alive_and_websockets_that_behave_are_served():
    async with _server() as port:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            for _ in range(3):  # one kept-alive connection, each request inside its own deadline
                assert (await http.post("/", content=b"hi")).text == "hi"
                await asyncio.sleep(DEADLINE_S * 0.6)
        # an idle kept-alive socket is closed at the deadline, quietly
        seconds, got = await _held(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 200 ") and seconds <= DEADLINE_S + SLACK_S, (seconds, got)
        async with websockets.connect(f"ws://127.0.0.1:{port}/ws") as ws:
            await asyncio.sleep(DEADLINE_S * 3)  # long past the deadline: a WebSocket is not an HTTP request
            await ws.send("still here")
            assert await asyncio.wait_for(ws.recv(), 5) == "still here"


async def test_at_the_socket_budget_the_oldest_silent_socket_makes_room():
    async with _server(max_sockets=5) as port:
        silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
        await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            assert (await http.get("/")).status_code == 200
        first = await asyncio.wait_for(silent[0][0].read(), 1)  # closed at once, long before the deadline
        assert first == b""
        for _, writer in silent:
            writer.close()
