"""Two real `rtserver serve` nodes (the embedded model) and a real redis-server: a node SIGKILLed in the
middle of work loses no acknowledged turn — its clients resume on the other node with their session id
and token, history intact, and the next reply is computed from it; a SIGTERMed node drains and its
clients' reconnects land on the other node with their sessions. Slow (real processes, real model)."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import websockets

from rtbench.serverproc import RedisProcess, ServerProcess

from ..clusterutil import redis_binary

pytestmark = pytest.mark.slow

SESSIONS = 50
OPTIONS = {"max_new_tokens": 6, "temperature": 0}


def node(redis_url: str, name: str, log: Path) -> ServerProcess:
    return ServerProcess(
        {
            "RTSERVER_CLUSTER_REDIS_URL": redis_url,
            "RTSERVER_CLUSTER_NODE_ID": name,
            "RTSERVER_CLUSTER_HEARTBEAT_S": "0.5",
            "RTSERVER_SERVER_LOG_LEVEL": "warning",
            "RTSERVER_SERVER_SHUTDOWN_GRACE_S": "3",
            "RTSERVER_SECURITY_IP_RATE_LIMIT_PER_S": "0",
            "RTSERVER_SECURITY_RATE_LIMIT_PER_S": "0",
            "RTSERVER_SECURITY_MAX_SESSIONS_PER_IP": "0",
            "RTSERVER_TASKS_AUTO_TASKS": "",
            "RTSERVER_MODEL_THREADS": "1",
        },
        log,
    )


async def recv(ws, timeout: float = 120.0) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def turn(ws, rid: str, text: str) -> dict:
    await ws.send(json.dumps({"type": "chat", "id": rid, "text": text, "options": OPTIONS}))
    while True:
        ev = await recv(ws)
        if ev.get("id") == rid and ev["type"] in ("done", "error"):
            return ev


class Client:
    """One customer: what the server acknowledged to it (user text, reply) per turn."""

    def __init__(self, i: int):
        self.i = i
        self.session_id = self.token = ""
        self.acked: list[tuple[str, str]] = []
        self.first_prompt_tokens = 0
        self.streaming = asyncio.Event()  # its turns acknowledged and the unfinished one under way

    async def chat_on(self, url: str, turns: int, then_unfinished: bool = False) -> None:
        async with websockets.connect(url, open_timeout=60, max_size=None) as ws:
            await ws.send(json.dumps({"type": "hello", "client": f"customer {self.i}"}))
            ready = await recv(ws)
            self.session_id, self.token = ready["session_id"], ready["resume_token"]
            for t in range(turns):
                text = f"Customer {self.i} says message {t}: my code is {self.i * 7 + t}."
                ev = await turn(ws, f"t{t}", text)
                assert ev["type"] == "done", ev
                self.acked.append((text, ev["text"]))
                self.first_prompt_tokens = self.first_prompt_tokens or ev["usage"]["prompt_tokens"]
            if then_unfinished:  # a turn still running when the node dies, as a rule
                await ws.send(
                    json.dumps({"type": "chat", "id": "late", "text": "Count to 200.", "options": {}})
                )

                def note(ev: dict) -> None:
                    if ev.get("id") == "late" and ev["type"] == "done":
                        # a reply free to end early can end before the kill: acknowledged
                        self.acked.append(("Count to 200.", ev["text"]))

                note(await recv(ws))  # its first event: it is running (or, short, has ended)
                self.streaming.set()
                try:  # held open until the node dies under it
                    async for raw in ws:
                        note(json.loads(raw))
                except websockets.ConnectionClosed:
                    pass


async def _all_set(events: list[asyncio.Event], tasks: list[asyncio.Task[None]]) -> None:
    """Wait until every event is set; a task that fails first raises its error here."""
    waiting = asyncio.ensure_future(asyncio.gather(*(e.wait() for e in events)))
    pending: set[asyncio.Future[Any]] = {waiting, *tasks}
    try:
        while not waiting.done():
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failed = [t for t in done if t is not waiting and t.exception() is not None]
            if failed:
                raise failed[0].exception()  # type: ignore[misc]
    finally:
        waiting.cancel()


async def test_sigkill_node_every_acknowledged_turn_resumes_on_the_other(tmp_path):
    redis = RedisProcess(tmp_path / "redis", binary=redis_binary())
    redis.start()
    a = node(redis.url, "a", tmp_path / "a.log")
    b = node(redis.url, "b", tmp_path / "b.log")
    try:
        await asyncio.gather(asyncio.to_thread(a.start, 300), asyncio.to_thread(b.start, 300))
        clients = [Client(i) for i in range(SESSIONS)]
        tasks = [asyncio.create_task(c.chat_on(a.ws_url, 2, then_unfinished=True)) for c in clients]

        await asyncio.wait_for(_all_set([c.streaming for c in clients], tasks), 600)
        assert all(len(c.acked) >= 2 for c in clients)
        a.proc.kill()  # SIGKILL: no drain, no goodbye
        a.proc.wait()
        await asyncio.gather(*tasks, return_exceptions=True)

        present = acked = 0
        async with asyncio.timeout(600):
            for c in clients:
                async with websockets.connect(b.ws_url, open_timeout=60, max_size=None) as ws:
                    await ws.send(
                        json.dumps({"type": "hello", "session_id": c.session_id, "resume_token": c.token})
                    )
                    ready = await recv(ws)
                    assert ready["type"] == "ready" and ready["resumed"] is True, ready
                    history = [(m["role"], m["content"]) for m in ready["history"]]
                    stored = list(zip(history[0::2], history[1::2]))
                    for text, reply in c.acked:
                        acked += 1
                        present += (("user", text), ("assistant", reply)) in stored
                    # nothing else: the turn still running at the kill left no trace, unless it was
                    # stored whole and the node died before its `done` went out
                    extra = stored[len(c.acked) :]
                    assert len(extra) <= 1 and all(u == ("user", "Count to 200.") for u, _ in extra), history
                    if c.i < 10:  # the next reply, on B, is computed from that history
                        ev = await turn(ws, "next", "What was my code?")
                        assert ev["type"] == "done", ev
                        # the two stored turns are in its prompt
                        assert ev["usage"]["prompt_tokens"] > c.first_prompt_tokens + 30, ev
        print(f"\nSIGKILL resume: {present}/{acked} acknowledged turns present over {SESSIONS} sessions")
        assert present == acked >= 2 * SESSIONS
        assert not b.log_errors(), b.log_errors()
    finally:
        for p in (a, b):
            if p.proc is not None and p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
        redis.stop()


async def test_sigterm_drains_and_clients_resume_on_the_other_node(tmp_path):
    redis = RedisProcess(tmp_path / "redis", binary=redis_binary())
    redis.start()
    a = node(redis.url, "a", tmp_path / "a.log")
    b = node(redis.url, "b", tmp_path / "b.log")
    try:
        await asyncio.gather(asyncio.to_thread(a.start, 300), asyncio.to_thread(b.start, 300))
        clients = [Client(i) for i in range(4)]
        await asyncio.gather(*(c.chat_on(a.ws_url, 1) for c in clients))
        async with websockets.connect(a.ws_url, open_timeout=60) as ws:
            await ws.send(
                json.dumps(
                    {"type": "hello", "session_id": clients[0].session_id, "resume_token": clients[0].token}
                )
            )
            again = await recv(ws)
            assert again["resumed"] is True
            clients[0].token = again["resume_token"]  # each resume rotates the token
            a.proc.send_signal(signal.SIGTERM)
            notice = await recv(ws)
            assert notice["type"] == "shutting_down", notice
        assert await asyncio.to_thread(a.proc.wait, 60) == 0
        # the drained node left the registry: B's /health sees only itself
        with urllib.request.urlopen(b.base + "/health", timeout=30) as resp:
            cluster = json.loads(resp.read())["cluster"]
        assert cluster["nodes_alive"] == 1 and [n["node_id"] for n in cluster["nodes"]] == ["b"], cluster
        for c in clients:  # the reconnect lands on B, with the session
            async with websockets.connect(b.ws_url, open_timeout=60) as ws:
                await ws.send(
                    json.dumps({"type": "hello", "session_id": c.session_id, "resume_token": c.token})
                )
                ready = await recv(ws)
                assert ready["resumed"] is True and len(ready["history"]) == 2, ready
                assert ready["history"][1]["content"] == c.acked[0][1]
    finally:
        for p in (a, b):
            if p.proc is not None and p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
        redis.stop()


def _ready_status(node: ServerProcess) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(node.base + "/ready", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def _wait_ready(node: ServerProcess, want: int, timeout_s: float = 60.0) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        code, body = await asyncio.to_thread(_ready_status, node)
        if code == want:
            return body
        assert asyncio.get_running_loop().time() < deadline, (code, body)
        await asyncio.sleep(0.2)


async def test_redis_stopped_and_restarted_under_real_nodes(tmp_path):
    """Redis (append-only file, fsync always) stops while two nodes serve: typed `unavailable`
    meanwhile, no crash, /ready says why; Redis back on the same port and folder: both nodes recover by
    themselves and every acknowledged turn is there."""
    redis = RedisProcess(tmp_path / "redis", binary=redis_binary())
    redis.start()
    a = node(redis.url, "a", tmp_path / "a.log")
    b = node(redis.url, "b", tmp_path / "b.log")
    try:
        await asyncio.gather(asyncio.to_thread(a.start, 300), asyncio.to_thread(b.start, 300))
        clients = [Client(i) for i in range(8)]
        await asyncio.gather(*(c.chat_on(a.ws_url, 1) for c in clients))
        async with websockets.connect(a.ws_url, open_timeout=60) as ws:
            await ws.send(
                json.dumps(
                    {"type": "hello", "session_id": clients[0].session_id, "resume_token": clients[0].token}
                )
            )
            again = await recv(ws)
            assert again["resumed"] is True
            clients[0].token = again["resume_token"]  # each resume rotates the token
            redis.stop()
            body = await _wait_ready(a, 503)
            assert "Redis" in body["reason"], body
            ev = await turn(ws, "down", "Are you there?")
            assert ev["type"] == "error" and ev["code"] == "unavailable", ev
            async with websockets.connect(b.ws_url, open_timeout=60) as ws2:
                await ws2.send(json.dumps({"type": "hello"}))
                err = await recv(ws2)
                assert err["type"] == "error" and err["code"] == "unavailable", err
            redis.start()
            await _wait_ready(a, 200)
            await _wait_ready(b, 200)
            ev = await turn(ws, "back", "Are you back?")
            assert ev["type"] == "done", ev
            clients[0].acked.append(("Are you back?", ev["text"]))
        assert a.proc.poll() is None and b.proc.poll() is None
        for c in clients:
            async with websockets.connect(b.ws_url, open_timeout=60) as ws:
                await ws.send(
                    json.dumps({"type": "hello", "session_id": c.session_id, "resume_token": c.token})
                )
                ready = await recv(ws)
                assert ready["type"] == "ready" and ready["resumed"] is True, ready
                history = [(m["role"], m["content"]) for m in ready["history"]]
                assert history == [
                    x for text, reply in c.acked for x in (("user", text), ("assistant", reply))
                ]
        for p in (a, b):
            assert not [ln for ln in p.log_errors() if "Traceback" in ln or " ERROR " in ln], p.log_errors()
    finally:
        for p in (a, b):
            if p.proc is not None and p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
        redis.stop()
