"""The connection table (issue 48, item 2) against a real `rtserver serve` process.

A crowd of sockets that send nothing, or half a request head, and a crowd of real widgets: `/ready`,
`/health` and `/widget.js` still answer 200 to everyone at once, the raw sockets are closed after
`server.request_timeout_s`, and a node at `server.max_websockets` refuses one more widget with close 1013
and a retry hint while `/ready` says `full` (not broken). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx
import pytest
import websockets

from rtbench.serverproc import ServerProcess, raise_nofile_limit

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 180.0
CROWD = 2000  # sockets (then widgets) held at once: a busy shop, or an attacker's evening
ADDRESSES = 40  # the widgets' client addresses (named by X-Forwarded-For: 127.0.0.1 is a trusted proxy)
REQUEST_TIMEOUT_S = 5.0  # the server's `server.request_timeout_s` here
ANSWER_WITHIN_S = 3.0  # a probe through the crowd on a busy two-core machine
CLOSED_WITHIN_S = REQUEST_TIMEOUT_S + 3.0
PROBES = ("/ready", "/health", "/widget.js")
HALF_HEAD = b"GET /ready HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Never-Ends: "
ENV = {
    "RTSERVER_TASKS_LEARNED_HEADS": "false",
    "RTSERVER_TASKS_AUTO_TASKS": "",
    "RTSERVER_SERVER_LOG_LEVEL": "warning",
    "RTSERVER_MODEL_DTYPE": "float32",
    "RTSERVER_ENGINE_KV_BUDGET_MB": "64",
    "RTSERVER_SERVER_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S),
    "RTSERVER_SERVER_MAX_WEBSOCKETS": str(CROWD),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    raise_nofile_limit()  # the crowd's client ends live in this process
    proc = ServerProcess(ENV, tmp_path_factory.mktemp("connections") / "server.log")
    try:
        proc.start(START_TIMEOUT_S)
        yield proc
    finally:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.stop(30)


async def _probe(base: str, path: str) -> tuple[int, float, str]:
    """GET `path` on a fresh connection: (status, seconds, body) — a balancer's health check."""
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        r = await http.get(path)
    return r.status_code, time.monotonic() - started, r.text


def _answered_at_once(probes: dict[str, tuple[int, float, str]]) -> None:
    for path, (status, seconds, body) in probes.items():
        assert status == 200, f"{path}: {status} ({body[:80]})"
        assert seconds <= ANSWER_WITHIN_S, f"{path}: answered after {seconds:.2f} s"


@dataclass
class Raw:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    opened: float


async def _raw(port: int, head: bytes) -> Raw:
    opened = time.monotonic()  # before the connect: the server's clock for it cannot start earlier
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if head:
        writer.write(head)
        await writer.drain()
    return Raw(reader, writer, opened)


async def _closed(raw: Raw) -> tuple[float | None, bytes]:
    """(seconds from opening until the server closed it, what it sent); None: still open."""
    got = b""
    deadline = raw.opened + CLOSED_WITHIN_S
    try:
        while chunk := await asyncio.wait_for(raw.reader.read(4096), max(0.01, deadline - time.monotonic())):
            got += chunk
        return time.monotonic() - raw.opened, got
    except TimeoutError:
        return None, got
    except ConnectionError:
        return time.monotonic() - raw.opened, got
    finally:
        raw.writer.close()


async def test_idle_and_half_sent_sockets_leave_the_node_in_service(server):
    """Attack: hold 1,000 silent sockets and 1,000 half-sent request heads; a balancer's `/ready` and a
    page's `/widget.js` must still answer at once, and the crowd must be closed at the deadline."""
    half = CROWD // 2
    silent = await asyncio.gather(*(_raw(server.port, b"") for _ in range(half)))
    heads = await asyncio.gather(*(_raw(server.port, HALF_HEAD) for _ in range(CROWD - half)))
    probes = {path: await _probe(server.base, path) for path in PROBES}
    held_until = min(r.opened for r in silent + heads) + REQUEST_TIMEOUT_S
    assert time.monotonic() < held_until, "the crowd was not all open while the probes ran: too slow a run"
    closes = await asyncio.gather(*(_closed(r) for r in silent + heads))

    _answered_at_once(probes)
    still_open = sum(1 for seconds, _ in closes if seconds is None)
    assert still_open == 0, f"{still_open} of {CROWD} sockets still open {CLOSED_WITHIN_S:g} s after opening"
    early = [s for s, _ in closes if s is not None and s < REQUEST_TIMEOUT_S - 0.5]
    assert not early, f"{len(early)} sockets closed before the deadline, e.g. after {early[0]:.2f} s"
    answered = [got for _, got in closes[half:]]
    assert all(got.startswith(b"HTTP/1.1 408 ") for got in answered), answered[0][:80]
    assert all(got == b"" for _, got in closes[:half])  # nothing to answer: closed quietly


def _address(i: int) -> dict[str, str]:
    return {"X-Forwarded-For": f"10.48.0.{i % ADDRESSES + 1}"}


async def _widget(url: str, i: int) -> websockets.ClientConnection:
    ws = await websockets.connect(
        url, open_timeout=60, ping_interval=None, close_timeout=2, additional_headers=_address(i)
    )
    await ws.send(json.dumps({"type": "hello", "client": "crowd"}))
    ready = json.loads(await asyncio.wait_for(ws.recv(), 60))
    assert ready["type"] == "ready", ready
    return ws


async def _crowd(url: str, n: int, at_once: int = 100) -> list[websockets.ClientConnection]:
    gate = asyncio.Semaphore(at_once)

    async def one(i: int) -> websockets.ClientConnection:
        async with gate:
            return await _widget(url, i)

    return await asyncio.gather(*(one(i) for i in range(n)))


async def _refused(url: str) -> tuple[list[dict], int | None, str]:
    """A widget past the node's capacity: the events it got, the close code and reason."""
    events = []
    headers = _address(ADDRESSES)  # an address of its own: refused for the node, not for the address
    async with websockets.connect(
        url, open_timeout=60, ping_interval=None, close_timeout=2, additional_headers=headers
    ) as ws:
        try:
            while True:
                events.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
        except websockets.ConnectionClosed as exc:
            return events, exc.rcvd.code if exc.rcvd else None, exc.rcvd.reason if exc.rcvd else ""
    return events, None, ""


async def test_a_full_node_refuses_new_widgets_cleanly_and_says_full(server):
    """2,000 real widgets from 40 addresses (the default per-address limits) are a busy shop: the node
    stays in service (`/ready` 200, `full`), the next widget is told to retry (1013, `server_full`,
    `retry_after_s`), and a freed place is taken again."""
    crowd = await _crowd(server.ws_url, CROWD)
    try:
        probes = {path: await _probe(server.base, path) for path in PROBES}
        async with httpx.AsyncClient(base_url=server.base, timeout=30) as http:
            for_widgets = await http.get("/ready", params={"for": "widgets"})  # a balancer's view
        events, code, reason = await _refused(server.ws_url)
        await crowd.pop().close()
        await asyncio.sleep(0.5)
        after = await _probe(server.base, "/ready")
        crowd.append(await _widget(server.ws_url, CROWD - 1))  # the freed place
    finally:
        await asyncio.gather(*(ws.close() for ws in crowd), return_exceptions=True)

    _answered_at_once(probes)
    full = json.loads(probes["/ready"][2])
    assert full["ready"] is True and full["full"] is True, full
    assert for_widgets.status_code == 503 and for_widgets.headers["retry-after"], for_widgets
    assert for_widgets.json()["ready"] is True, for_widgets.text  # full, not broken
    assert code == 1013, (code, reason, events)
    assert [e.get("code") for e in events] == ["server_full"], events
    assert events[0]["retry_after_s"] > 0, events
    assert json.loads(after[2])["full"] is False, after
