"""Test helpers for the cluster (rtserver/web/cluster/): a real `redis-server` per test on a free port in
a temp folder, and in-process nodes on the scripted engine that share it."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import httpx
import redis.asyncio as aioredis

from rtbench.serverproc import RedisProcess

from .components import missing
from .serverutil import ScriptedEngine, make_settings, recv_json, scripted_app, serve, wait_for


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        missing("redis-server", "apt-get install -y redis-server (./run test does it)")
    return found


@contextlib.contextmanager
def redis_server(tmp: Path):
    server = RedisProcess(tmp / "redis", binary=redis_binary())
    server.start()
    try:
        yield server
    finally:
        server.stop()


def cluster_settings(redis_url: str, node: str, **sections: dict):
    settings = make_settings(**sections)
    settings.cluster.redis_url = redis_url
    settings.cluster.node_id = node
    settings.cluster.heartbeat_s = 0.2
    settings.cluster.op_timeout_s = 1.0
    return settings


@contextlib.asynccontextmanager
async def scripted_node(loaded, redis_url: str, node: str, wait_redis: bool = True, **sections: dict):
    """An in-process node on the scripted engine, ready (and, with `wait_redis`, connected to Redis):
    yields (http base, ws url, engine, app)."""
    settings = cluster_settings(redis_url, node, **sections)
    engine = ScriptedEngine(loaded)
    app = scripted_app(loaded, settings, engine)
    async with serve(app, settings) as (base, url):
        if wait_redis:
            await wait_for(lambda: _ready(base))
        yield base, url, engine, app


async def heartbeat(app) -> None:
    """One heartbeat of an in-process node now, as its health loop runs every `heartbeat_s`."""
    await app.state.rt.topology.cluster.beat()


async def stored_conversation(redis_url: str, session_id: str, messages: int = 0) -> dict:
    """The console's record of a session once Redis holds it with at least `messages` messages (a node
    writes it in the background)."""
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)

    async def record() -> dict | None:
        raw = await client.hget("rtserver:console:convs", session_id)
        found = json.loads(raw) if raw else None
        return found if found is not None and len(found["messages"]) >= messages else None

    try:
        return await wait_for(record)
    finally:
        await client.aclose()


async def _ready(base: str) -> bool:
    async with httpx.AsyncClient() as client:
        return (await client.get(base + "/ready")).status_code == 200


async def chat(ws, rid: str, text: str) -> list[dict]:
    """Send a chat and collect events to its end (done or error)."""
    await ws.send(json.dumps({"type": "chat", "id": rid, "text": text}))
    out = []
    while True:
        ev = await recv_json(ws)
        out.append(ev)
        if ev.get("id") == rid and ev["type"] in ("done", "error") and not ev.get("auto"):
            return out
