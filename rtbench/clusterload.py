"""`rtserver loadtest --nodes N`: N real `rtserver serve` nodes sharing one real `redis-server`.

Phases: load on every node at once, then cross-node resume. Then the overhead Redis adds to a turn's first
token. For that, nodes with and without `redis_url` alternate. Every phase is bounded in count and time. It
writes JSON and exits 1 when a check fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection

from .loadclient import run_chat_load
from .loadtest_report import write_cluster_report
from .serverproc import ONE_ADDRESS_LIMITS_OFF, RedisProcess, ServerProcess, raise_nofile_limit
from .stats import median, percentile, rounded


async def _connect(url: str) -> ClientConnection:
    return await websockets.connect(url, open_timeout=120, max_size=None)


async def _recv(ws: ClientConnection, timeout_s: float = 300.0) -> dict[str, Any]:
    event: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), timeout_s))
    return event


async def _hello(ws: ClientConnection, **fields: Any) -> dict[str, Any]:
    await ws.send(json.dumps({"type": "hello", "client": "loadtest", **fields}))
    while True:
        ev = await _recv(ws)
        if ev["type"] in ("ready", "error"):
            return ev


async def _turn(
    ws: ClientConnection, rid: str, text: str, max_new_tokens: int
) -> tuple[dict[str, Any], float | None]:
    sent = time.perf_counter()
    options = {"max_new_tokens": max_new_tokens, "temperature": 0}
    await ws.send(json.dumps({"type": "chat", "id": rid, "text": text, "options": options}))
    first = None
    while True:
        ev = await _recv(ws)
        if ev.get("id") != rid or ev.get("auto"):
            continue
        if ev["type"] == "token" and first is None:
            first = (time.perf_counter() - sent) * 1000
        elif ev["type"] in ("done", "error"):
            return ev, first


def _health(node: ServerProcess) -> dict[str, Any]:
    with urllib.request.urlopen(node.base + "/health", timeout=30) as resp:
        health: dict[str, Any] = json.loads(resp.read())
        return health


async def phase_load(nodes: list[ServerProcess], idle: int, chatting: int) -> dict[str, Any]:
    conns: list[Any] = []
    failed = 0

    async def open_one(node: ServerProcess) -> None:
        nonlocal failed
        try:
            ws = await _connect(node.ws_url)
            if (await _hello(ws))["type"] != "ready":
                failed += 1
                await ws.close()
                return
            conns.append(ws)
        except Exception:
            failed += 1

    started = time.perf_counter()
    for node in nodes:
        for start in range(0, idle, 100):
            await asyncio.gather(*[open_one(node) for _ in range(min(100, idle - start))])
    open_s = time.perf_counter() - started
    await asyncio.sleep(max(3.0, 2 * 2.0))  # a heartbeat or two: the registry counts them
    health = await asyncio.to_thread(_health, nodes[0])
    chats = await asyncio.gather(
        *[run_chat_load(n.ws_url, chatting, turns=2, max_new_tokens=24, timeout_s=900) for n in nodes]
    )

    async def still_open(ws: ClientConnection) -> bool:
        try:
            await ws.send(json.dumps({"type": "ping", "data": 1}))
            while (await _recv(ws, 120))["type"] != "pong":
                pass
            return True
        except Exception:
            return False

    alive = sum(await asyncio.gather(*[still_open(ws) for ws in conns]))
    await asyncio.gather(*[ws.close() for ws in conns], return_exceptions=True)
    errors: dict[str, int] = {}
    for c in chats:
        for code, n in c["errors"].items():
            errors[code] = errors.get(code, 0) + n
    ttfts = [c["ttft_p50_ms"] for c in chats]
    cluster = health.get("cluster", {})
    return {
        "nodes": len(nodes),
        "idle_per_node": idle,
        "idle_open_failed": failed,
        "idle_open_s": round(open_s, 2),
        "idle_alive_after_chat": alive,
        "chatting_per_node": chatting,
        "completed_turns": sum(c["completed_turns"] for c in chats),
        "expected_turns": 2 * chatting * len(nodes),
        "errors": errors,
        "ttft_p50_ms_per_node": [rounded(t, 1) for t in ttfts],
        "ttft_p95_ms_per_node": [rounded(c["ttft_p95_ms"], 1) for c in chats],
        "tokens_per_s_per_node": [rounded(c["tokens_per_s"], 1) for c in chats],
        "health_nodes_alive": cluster.get("nodes_alive"),
        "health_sessions": cluster.get("sessions"),
    }


async def phase_resume(nodes: list[ServerProcess], sessions: int) -> dict[str, Any]:
    """Sessions chat on node i, then resume on node i+1. Every acknowledged turn must be there."""

    async def one(i: int) -> tuple[int, int]:
        src, dst = nodes[i % len(nodes)], nodes[(i + 1) % len(nodes)]
        acked = []
        async with await _connect(src.ws_url) as ws:
            ready = await _hello(ws)
            for t in range(2):
                text = f"Session {i}, message {t}: remember {i * 13 + t}."
                ev, _ = await _turn(ws, f"t{t}", text, 8)
                if ev["type"] == "done":
                    acked.append((text, ev["text"]))
        async with await _connect(dst.ws_url) as ws:
            back = await _hello(ws, session_id=ready["session_id"], resume_token=ready["resume_token"])
            history = [m["content"] for m in back.get("history") or []]
        present = sum(1 for text, reply in acked if text in history and reply in history)
        return present, len(acked)

    results = await asyncio.gather(*[one(i) for i in range(sessions)])
    return {
        "sessions": sessions,
        "acknowledged_turns": sum(a for _, a in results),
        "present_on_other_node": sum(p for p, _ in results),
    }


async def phase_overhead(with_redis: ServerProcess, without: ServerProcess, rounds: int) -> dict[str, Any]:
    """The cost of a turn's Redis work. There is one session on each node and one turn at a time. The nodes
    alternate, and the order flips each round, so drift cancels out. A pause follows each turn, as a person
    would take. The previous turn's background writes are done by then (console record, events). The session
    is reset every 8 turns, so prompts stay short.
    """
    ttft: dict[str, list[float]] = {"redis": [], "local": []}
    hub: dict[str, list[float]] = {"redis": [], "local": []}  # client TTFT - the engine's own TTFT
    errors = 0
    conns = {"redis": await _connect(with_redis.ws_url), "local": await _connect(without.ws_url)}
    try:
        for ws in conns.values():
            await _hello(ws)
        for r in range(rounds):
            names = ["redis", "local"] if r % 2 == 0 else ["local", "redis"]
            for name in names:
                ws = conns[name]
                if r % 8 == 0 and r:
                    await ws.send(json.dumps({"type": "reset"}))
                    while (await _recv(ws))["type"] != "reset":
                        pass
                    await asyncio.sleep(0.25)
                ev, first = await _turn(ws, f"c{r}", "Say hello in five words.", 4)
                await asyncio.sleep(0.25)
                if ev["type"] != "done" or first is None:
                    errors += 1
                    continue
                ttft[name].append(first)
                if ev["timing"].get("ttft_ms") is not None:
                    hub[name].append(first - ev["timing"]["ttft_ms"])
    finally:
        for ws in conns.values():
            await ws.close()
    p50 = {k: percentile(v, 0.5) for k, v in ttft.items()}
    diffs = [a - b for a, b in zip(ttft["redis"], ttft["local"])]
    return {
        "rounds": rounds,
        "errors": errors,
        "ttft_p50_ms_redis": rounded(p50["redis"], 2),
        "ttft_p50_ms_local": rounded(p50["local"], 2),
        "ttft_p50_diff_ms": rounded((p50["redis"] or 0) - (p50["local"] or 0), 2),
        "paired_diff_median_ms": rounded(median(diffs), 2) if diffs else None,
        "hub_ms_p50_redis": rounded(percentile(hub["redis"], 0.5), 2),
        "hub_ms_p50_local": rounded(percentile(hub["local"], 0.5), 2),
    }


Node = Callable[[str, dict[str, str]], ServerProcess]  # a node's name and its settings -> its process


def _finish(procs: list[tuple[str, ServerProcess]]) -> list[dict[str, Any]]:
    """Each node stopped, if still running. Returns its exit code and the errors it logged."""
    out = []
    for name, p in procs:
        rc = (
            p.stop()[0]
            if p.proc is not None and p.proc.poll() is None
            else (p.proc.returncode if p.proc else -1)
        )
        out.append({"name": name, "exit_code": rc, "errors_logged": p.log_errors()[:20] if p.proc else []})
    return out


def _cluster_phases(
    report: dict[str, Any], node: Node, redis_url: str, nodes: int, idle: int, chatting: int, resume: int
) -> None:
    """The load and cross-node resume phases on `nodes` nodes sharing one redis-server."""
    cluster = [
        (
            f"node-{i}",
            node(
                f"node-{i}",
                {"RTSERVER_CLUSTER_REDIS_URL": redis_url, "RTSERVER_CLUSTER_NODE_ID": f"node-{i}"},
            ),
        )
        for i in range(nodes)
    ]
    try:
        print(f"starting {nodes} nodes and redis-server ({report['workdir']})", flush=True)
        for _, p in cluster:
            p.start(600)
        procs = [p for _, p in cluster]
        print("load", flush=True)
        report["load"] = asyncio.run(phase_load(procs, idle, chatting))
        print(f"  {json.dumps(report['load'])}", flush=True)
        print("cross-node resume", flush=True)
        report["resume"] = asyncio.run(phase_resume(procs, resume))
        print(f"  {json.dumps(report['resume'])}", flush=True)
    finally:
        report["nodes"] = _finish(cluster)


def _overhead_phase(report: dict[str, Any], node: Node, redis_url: str, rounds: int) -> None:
    """One turn at a time on two nodes, one with redis_url and one without."""
    limits = {
        "RTSERVER_SECURITY_IP_RATE_LIMIT_PER_S": "1000000",
        "RTSERVER_SECURITY_IP_RATE_LIMIT_BURST": "1000000",
    }
    pair = [
        ("overhead-redis", node("overhead-redis", {**limits, "RTSERVER_CLUSTER_REDIS_URL": redis_url})),
        ("overhead-local", node("overhead-local", limits)),
    ]
    try:
        print("cluster overhead (one turn at a time, with and without redis_url)", flush=True)
        for _, p in pair:
            p.start(600)
        report["overhead"] = asyncio.run(phase_overhead(pair[0][1], pair[1][1], rounds))
        print(f"  {json.dumps(report['overhead'])}", flush=True)
    finally:
        report["overhead_nodes"] = _finish(pair)


def run_cluster_loadtest(
    nodes: int = 2,
    idle: int = 1000,
    chatting: int = 64,
    resume_sessions: int = 32,
    overhead_rounds: int = 100,
    config: str | None = None,
    out_dir: str = "bench-results",
    dtype: str | None = None,
) -> dict[str, Any]:
    raise_nofile_limit()
    if shutil.which("redis-server") is None:
        raise SystemExit(
            "rtserver loadtest --nodes: redis-server is not installed (apt-get install -y redis-server)"
        )
    workdir = Path(tempfile.mkdtemp(prefix="rtserver-clusterload-"))
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": f"rtserver loadtest --nodes {nodes} --idle {idle} --chatting {chatting}"
        + (f" --dtype {dtype}" if dtype else ""),
        "workdir": str(workdir),
    }
    redis = RedisProcess(workdir / "redis")  # appendfsync always: what the docs recommend for no loss
    redis.start()
    threads = str(max(1, (os.cpu_count() or 2) // nodes))
    common = {
        "RTSERVER_SERVER_LOG_LEVEL": "warning",
        **ONE_ADDRESS_LIMITS_OFF,
        "RTSERVER_MODEL_THREADS": threads,
    }
    if dtype:
        common["RTSERVER_MODEL_DTYPE"] = dtype

    def node(name: str, env: dict[str, str]) -> ServerProcess:
        return ServerProcess({**common, **env}, workdir / f"{name}.log", config)

    try:
        _cluster_phases(report, node, redis.url, nodes, idle, chatting, resume_sessions)
        _overhead_phase(report, node, redis.url, overhead_rounds)
    finally:
        redis.stop()
    write_cluster_report(report, out_dir)
    return report
