"""`rtserver loadtest`: reliability phases against real `rtserver serve` processes and WebSocket clients.

Every phase is bounded in count and time. Server A takes idle connections and chatting sessions. It also
takes a slow reader and mid-stream disconnects. Server B has small queues and test fault hooks from
`tests/`. It takes overload, injected faults and SIGTERM. It prints a table, writes JSON and exits 1 when a
check fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection

from .loadclient import run_chat_load
from .loadtest_report import write_report
from .serverproc import ONE_ADDRESS_LIMITS_OFF, ServerProcess, free_port, raise_nofile_limit
from .stats import median, percentile, ratio, rounded
from .wsclient import connect, hello, recv

STEP_FAULT_MARKER = "QXSTEPFAULTQX"
TESTS_DIR = Path(__file__).resolve().parents[1] / "tests"
FAULT_SERVER = TESTS_DIR / "faultserver.py"
FAULT_PLUGINS = TESTS_DIR / "faults"
LONG_PROMPT = "Count from 1 to 500, separated by commas, and say nothing else."


# -- client helpers ------------------------------------------------------------------------------------


async def _chat(url: str, text: str, max_new_tokens: int, timeout_s: float = 300.0) -> dict[str, Any]:
    """One chat on a new connection. Returns its outcome (done | error code), TTFT and total seconds."""
    async with await connect(url) as ws:
        await hello(ws)
        sent = time.perf_counter()
        await ws.send(
            json.dumps(
                {
                    "type": "chat",
                    "id": "c",
                    "text": text,
                    "options": {"max_new_tokens": max_new_tokens, "temperature": 0},
                }
            )
        )
        first = None
        while True:
            ev = await recv(ws, timeout_s)
            if ev.get("id") != "c" or ev.get("auto"):
                continue
            if ev["type"] == "token" and first is None:
                first = time.perf_counter() - sent
            elif ev["type"] in ("done", "error"):
                return {
                    "outcome": "done" if ev["type"] == "done" else ev["code"],
                    "ttft_s": first,
                    "total_s": time.perf_counter() - sent,
                    "message": ev.get("message", ""),
                }


# -- server A phases -----------------------------------------------------------------------------------


def _auto_tasks(server: ServerProcess) -> list[str]:
    """The tasks the server runs on every user chat message (its /v1/tasks)."""
    with urllib.request.urlopen(server.base + "/v1/tasks", timeout=10) as resp:
        return list(json.loads(resp.read())["auto_tasks"])


async def phase_load(server: ServerProcess, idle: int, chatting: int) -> dict[str, Any]:
    rss_before = server.rss_mb()
    idle_conns = []
    failed = 0

    async def open_one() -> None:
        nonlocal failed
        try:
            ws = await connect(server.ws_url)
            ev = await hello(ws)
            if ev["type"] != "ready":
                failed += 1
                await ws.close()
                return
            idle_conns.append(ws)
        except Exception:
            failed += 1

    opened_at = time.perf_counter()
    for start in range(0, idle, 100):  # 100 handshakes at a time
        await asyncio.gather(*[open_one() for _ in range(min(100, idle - start))])
    open_s = time.perf_counter() - opened_at
    await asyncio.sleep(2)
    rss_idle = server.rss_mb()
    auto_tasks = _auto_tasks(server)
    chat = await run_chat_load(server.ws_url, chatting, turns=2, max_new_tokens=24, timeout_s=600)
    rss_after_chat = server.rss_mb()

    async def still_open(ws: ClientConnection) -> bool:
        try:
            await ws.send(json.dumps({"type": "ping", "data": 1}))
            while (await recv(ws, 60))["type"] != "pong":
                pass
            return True
        except Exception:
            return False

    alive = sum(await asyncio.gather(*[still_open(ws) for ws in idle_conns]))
    await asyncio.gather(*[ws.close() for ws in idle_conns], return_exceptions=True)
    expected_turns = chatting * 2
    return {
        "idle_connections": idle,
        "idle_open_failed": failed,
        "idle_open_s": round(open_s, 2),
        "idle_alive_after_chat": alive,
        "chatting_sessions": chatting,
        "turns_per_session": 2,
        "max_new_tokens": 24,
        "completed_turns": chat["completed_turns"],
        "expected_turns": expected_turns,
        "errors": chat["errors"],
        "ttft_p50_ms": chat["ttft_p50_ms"],
        "ttft_p95_ms": chat["ttft_p95_ms"],
        # the first turns all start at once, each with its auto tasks: the burst the TTFT bar is about
        "auto_tasks": auto_tasks,
        "first_turn_ttft_p50_ms": chat["per_turn"][1]["ttft_p50_ms"],
        "first_turn_ttft_p95_ms": chat["per_turn"][1]["ttft_p95_ms"],
        "tokens_per_s": rounded(chat["tokens_per_s"], 1),
        "rss_before_mb": round(rss_before, 1),
        "rss_with_idle_mb": round(rss_idle, 1),
        "rss_idle_extra_mb": round(rss_idle - rss_before, 1),
        "rss_after_chat_mb": round(rss_after_chat, 1),
    }


async def phase_slow_client(server: ServerProcess, others: int = 8) -> dict[str, Any]:
    base = await run_chat_load(server.ws_url, others, turns=1, max_new_tokens=48)
    slow_closes_before = server.metrics().get("rtserver_slow_client_closes_total", 0.0)
    rss_before = server.rss_mb()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader that stops: small window
    sock.connect(("127.0.0.1", server.port))
    sock.setblocking(False)
    # no compression: the server's pongs must really weigh what they say
    ws = await connect(server.ws_url, sock=sock, max_queue=1, compression=None)
    await hello(ws)
    await ws.send(
        json.dumps({"type": "chat", "id": "slow", "text": LONG_PROMPT, "options": {"max_new_tokens": 256}})
    )
    ws.transport.pause_reading()
    close_code: int | None = None
    sent_frames = 0
    flood_started = time.perf_counter()

    # Beside its streaming reply the client sends pings with 60 KB of data and never reads the pongs:
    # megabytes to deliver within seconds, past what the kernel's socket buffers absorb (a token stream
    # alone would take many minutes to fill them). The connection's rate limit applies as usual.
    ping = json.dumps({"type": "ping", "data": "x" * 60_000})

    async def flood() -> None:
        nonlocal sent_frames
        try:
            while time.perf_counter() - flood_started < 40:
                await asyncio.wait_for(ws.send(ping), 5)
                sent_frames += 1
                await asyncio.sleep(0.02)
        except Exception:  # the server closed the connection
            pass

    flood_task = asyncio.create_task(flood())
    during = await run_chat_load(server.ws_url, others, turns=1, max_new_tokens=48)
    await flood_task
    rss_during = server.rss_mb()
    closed_after = None
    ws.transport.resume_reading()
    try:  # now read: whatever was queued, then the close
        while True:
            await asyncio.wait_for(ws.recv(), 30)
    except Exception as exc:
        if isinstance(exc, websockets.ConnectionClosed):  # not a timeout: the server ended it
            # 4008 when the close frame got through; none (1006) when the unread buffers held it back
            close_code = getattr(exc.rcvd, "code", None) or 1006
            closed_after = time.perf_counter() - flood_started
    finally:
        await ws.close()
    slow_closes = server.metrics().get("rtserver_slow_client_closes_total", 0.0) - slow_closes_before
    return {
        "others": others,
        "others_tokens_per_s_before": rounded(base["tokens_per_s"], 1),
        "others_tokens_per_s_during": rounded(during["tokens_per_s"], 1),
        "others_rate_ratio": rounded(ratio(during["tokens_per_s"], base["tokens_per_s"]), 3),
        "others_errors": during["errors"],
        "slow_client_frames_sent": sent_frames,
        "slow_client_close_code": close_code,
        "slow_client_closes": slow_closes,
        "seconds_until_closed_seen": round(closed_after, 1) if closed_after else None,
        "rss_before_mb": round(rss_before, 1),
        "rss_during_mb": round(rss_during, 1),
    }


async def _wait_settled(server: ServerProcess, kv_baseline: float, timeout_s: float) -> dict[str, Any]:
    """Poll /metrics until nothing runs or waits. The KV held by sessions must be back to `kv_baseline`."""
    started = time.perf_counter()
    running_zero_s = None
    while True:
        m = server.metrics()
        running = m.get("rtserver_running_sequences", 0) + m.get("rtserver_waiting_sequences", 0)
        kv = _session_kv(m)
        elapsed = time.perf_counter() - started
        if running == 0 and running_zero_s is None:
            running_zero_s = elapsed
        if running == 0 and kv <= kv_baseline or elapsed > timeout_s:
            return {
                "running_after": running,
                "kv_session_bytes_after": kv,
                "seconds_to_no_running": round(running_zero_s, 2) if running_zero_s is not None else None,
                "seconds_to_kv_baseline": round(elapsed, 2) if kv <= kv_baseline else None,
            }
        await asyncio.sleep(0.25)


def _session_kv(m: dict[str, float]) -> float:
    """KV bytes held by running sequences and kept sessions. That is used minus the shared prefix cache."""
    return m.get("rtserver_kv_used_bytes", 0) - m.get("rtserver_kv_prefix_cache_bytes", 0)


async def phase_disconnects(server: ServerProcess, count: int) -> dict[str, Any]:
    started = time.perf_counter()
    while True:  # earlier phases' sessions expire first
        m = server.metrics()
        if m.get("rtserver_sessions", 0) == 0 and m.get("rtserver_running_sequences", 0) == 0:
            break
        if time.perf_counter() - started > 60:
            raise RuntimeError("earlier phases' sessions did not expire within 60 s")
        await asyncio.sleep(0.25)
    settle = round(time.perf_counter() - started, 2)
    baseline = {
        "running": m.get("rtserver_running_sequences", 0),
        "kv_session_bytes": _session_kv(m),
        "sessions": m.get("rtserver_sessions", 0),
    }

    async def start_chat() -> ClientConnection:
        ws = await connect(server.ws_url)
        await hello(ws)
        await ws.send(
            json.dumps({"type": "chat", "id": "d", "text": LONG_PROMPT, "options": {"max_new_tokens": 128}})
        )
        return ws

    async def until_first_token(ws: ClientConnection, timeout_s: float) -> bool:
        try:
            while True:
                ev = await recv(ws, timeout_s)
                if ev.get("id") == "d" and ev["type"] == "token":
                    return True
        except Exception:
            return False

    streaming = 0
    for _ in range(count):  # one after another: each leaves while its reply streams
        ws = await start_chat()
        streaming += await until_first_token(ws, 60)
        await ws.close()
    peak_seq = server.metrics()
    sequential = {
        "disconnected_while_streaming": streaming,
        "kv_session_bytes_peak": _session_kv(peak_seq),
        **await _wait_settled(server, baseline["kv_session_bytes"], 60),
    }
    conns = await asyncio.gather(*[start_chat() for _ in range(count)])
    got = await asyncio.gather(*[until_first_token(ws, 5) for ws in conns])
    m = server.metrics()
    running_at_cut = m.get("rtserver_running_sequences", 0) + m.get("rtserver_waiting_sequences", 0)
    for ws in conns:
        ws.transport.abort()  # all at once, without a closing handshake
    at_once = {
        "streaming_when_cut": sum(got),
        "running_or_waiting_when_cut": running_at_cut,
        "kv_session_bytes_when_cut": _session_kv(m),
        **await _wait_settled(server, baseline["kv_session_bytes"], 60),
    }
    return {
        "count": count,
        "baseline": baseline,
        "seconds_until_earlier_sessions_expired": settle,
        "one_after_another": sequential,
        "all_at_once": at_once,
    }


# -- server B phases -----------------------------------------------------------------------------------


async def phase_overload(server: ServerProcess, max_running: int) -> dict[str, Any]:
    async def unloaded() -> dict[str, Any]:
        runs = [await _chat(server.ws_url, "Say hello.", 16) for _ in range(3)]
        return {
            "ttft_ms": rounded(median(r["ttft_s"] * 1000 for r in runs if r["ttft_s"]), 1),
            "total_ms": rounded(median(r["total_s"] * 1000 for r in runs), 1),
        }

    before = await unloaded()
    n = 4 * max_running
    started = time.perf_counter()
    results = await asyncio.wait_for(
        asyncio.gather(*[_chat(server.ws_url, f"Say hello to person {i}.", 16) for i in range(n)]), 600
    )
    wall = time.perf_counter() - started
    after = await unloaded()
    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    refused = [r["total_s"] * 1000 for r in results if r["outcome"] == "overloaded"]
    return {
        "submitted": n,
        "max_running": max_running,
        "outcomes": outcomes,
        "wall_s": round(wall, 1),
        "overloaded_answer_p95_ms": rounded(percentile(refused, 0.95), 1),
        "unloaded_before": before,
        "unloaded_after": after,
        "ttft_after_over_before": rounded(ratio(after["ttft_ms"], before["ttft_ms"]), 2),
    }


async def phase_faults(server: ServerProcess) -> dict[str, Any]:
    async def task_call(text: str) -> dict[str, Any]:
        async with await connect(server.ws_url) as ws:
            await hello(ws)
            await ws.send(json.dumps({"type": "task", "id": "t", "task": "faulty", "input": {"text": text}}))
            while True:
                ev = await recv(ws)
                if ev.get("id") == "t" and ev["type"] in ("result", "error"):
                    return {
                        "outcome": "result" if ev["type"] == "result" else ev["code"],
                        "message": ev.get("message", ""),
                    }

    normal = [_chat(server.ws_url, f"Name a colour ({i}).", 12) for i in range(6)]
    faulty = [
        _chat(server.ws_url, f"Repeat {STEP_FAULT_MARKER} please.", 12),
        task_call("Ann"),
        task_call("Bo"),
    ]
    results = await asyncio.wait_for(asyncio.gather(*normal, *faulty), 300)
    after = await asyncio.gather(*[_chat(server.ws_url, f"Name an animal ({i}).", 8) for i in range(4)])
    leaked = [r["message"] for r in results if "Traceback" in r["message"] or ".py" in r["message"]]
    return {
        "normal_done": sum(r["outcome"] == "done" for r in results[:6]),
        "normal": 6,
        "step_fault_outcome": results[6]["outcome"],
        "parser_fault_outcomes": [r["outcome"] for r in results[7:]],
        "after_done": sum(r["outcome"] == "done" for r in after),
        "after": 4,
        "internal_details_leaked": leaked,
    }


async def phase_shutdown(server: ServerProcess) -> dict[str, Any]:
    long_ws, short_ws = await connect(server.ws_url), await connect(server.ws_url)
    await hello(long_ws)
    await hello(short_ws)
    await long_ws.send(
        json.dumps({"type": "chat", "id": "long", "text": LONG_PROMPT, "options": {"max_new_tokens": 400}})
    )
    while (await recv(long_ws))["type"] != "token":
        pass
    await short_ws.send(
        json.dumps({"type": "chat", "id": "short", "text": "Say hi.", "options": {"max_new_tokens": 4}})
    )
    while (await recv(short_ws))["type"] != "token":
        pass
    sigterm_at = time.perf_counter()
    server.running().send_signal(signal.SIGTERM)

    async def events_until_closed(ws: ClientConnection) -> tuple[list[dict[str, Any]], int | None]:
        events = []
        try:
            while True:
                events.append(await recv(ws, 60))
        except Exception as exc:
            return events, getattr(getattr(exc, "rcvd", None), "code", None)

    (long_events, long_code), (short_events, short_code) = await asyncio.gather(
        events_until_closed(long_ws), events_until_closed(short_ws)
    )
    rc = await asyncio.to_thread(server.running().wait, 60)
    exit_s = time.perf_counter() - sigterm_at

    def end(events: list[dict[str, Any]], rid: str) -> str | None:
        for ev in events:
            if ev.get("id") == rid and ev["type"] in ("done", "error"):
                return "done" if ev["type"] == "done" else ev["code"]
        return None

    return {
        "grace_s": float(server.env.get("RTSERVER_SERVER_SHUTDOWN_GRACE_S", "10")),
        "shutting_down_event": all(
            any(e["type"] == "shutting_down" for e in evs) for evs in (long_events, short_events)
        ),
        "short_reply": end(short_events, "short"),
        "long_reply": end(long_events, "long"),
        "close_codes": [long_code, short_code],
        "exit_code": rc,
        "seconds_to_exit": round(exit_s, 2),
    }


def phase_load_failure(workdir: Path) -> dict[str, Any]:
    corrupt = workdir / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + os.urandom(4096))
    out = {}
    for name, path in (
        ("missing file", str(workdir / "missing" / "model.gguf")),
        ("corrupt file", str(corrupt)),
    ):
        env = {
            **os.environ,
            "RTSERVER_MODEL_MODEL": path,
            "RTSERVER_SERVER_PORT": str(free_port()),
            "RTSERVER_SERVER_HOST": "127.0.0.1",
            "RTSERVER_SERVER_LOG_LEVEL": "warning",
        }
        proc = subprocess.run(
            [sys.executable, "-m", "rtserver.cli", "serve"],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        message = next((ln for ln in proc.stderr.splitlines() if ln.startswith("rtserver:")), "")
        out[name] = {
            "exit_code": proc.returncode,
            "message": message,
            "names_file": path in message,
            "traceback": "Traceback" in proc.stderr,
        }
    return out


# -- the command ---------------------------------------------------------------------------------------


def _server_a(
    common: dict[str, str], workdir: Path, config: str | None, idle: int, chatting: int, disconnects: int
) -> dict[str, Any]:
    """Idle connections, chatting sessions, a slow reader and mid-stream disconnects."""
    report: dict[str, Any] = {}
    a = ServerProcess(
        {**common, "RTSERVER_SESSIONS_IDLE_TIMEOUT_S": "5", "RTSERVER_SERVER_SLOW_CLIENT_TIMEOUT_S": "2"},
        workdir / "server-a.log",
        config,
    )
    print(f"server A: starting ({a.log_path})", flush=True)
    report["server_a_ready_s"] = round(a.start(), 1)
    try:
        phases: tuple[tuple[str, Callable[[], Coroutine[Any, Any, dict[str, Any]]]], ...] = (
            ("load", lambda: phase_load(a, idle, chatting)),
            ("slow_client", lambda: phase_slow_client(a)),
            ("disconnects", lambda: phase_disconnects(a, disconnects)),
        )
        for name, phase in phases:
            print(f"server A: {name}", flush=True)
            report[name] = asyncio.run(phase())
            print(f"  {json.dumps(report[name])}", flush=True)
    finally:
        rc, _ = a.stop()
        report["server_a"] = {"exit_code": rc, "errors_logged": a.log_errors()[:20]}
    return report


def _server_b(common: dict[str, str], workdir: Path, config: str | None) -> dict[str, Any]:
    """Small queues and the test fault hooks: overload, injected faults and SIGTERM."""
    report: dict[str, Any] = {}
    b = ServerProcess(
        {
            **common,
            "RTSERVER_ENGINE_MAX_RUNNING": "8",
            "RTSERVER_ENGINE_MAX_WAITING": "8",
            "RTSERVER_TASKS_AUTO_TASKS": "",
            "RTSERVER_SERVER_SHUTDOWN_GRACE_S": "2",
            "RTSERVER_TASKS_PLUGIN_DIRS": f"plugins,{FAULT_PLUGINS}",
        },
        workdir / "server-b.log",
        config,
        launcher=[str(FAULT_SERVER)] + (["--config", config] if config else []),
    )
    print(f"server B: starting ({b.log_path})", flush=True)
    report["server_b_ready_s"] = round(b.start(), 1)
    try:
        phases: tuple[tuple[str, Callable[[], Coroutine[Any, Any, dict[str, Any]]]], ...] = (
            ("overload", lambda: phase_overload(b, 8)),
            ("faults", lambda: phase_faults(b)),
            ("shutdown", lambda: phase_shutdown(b)),
        )
        for name, phase in phases:
            print(f"server B: {name}", flush=True)
            report[name] = asyncio.run(phase())
            print(f"  {json.dumps(report[name])}", flush=True)
    finally:
        if b.running().poll() is None:
            b.stop()
        injected = (
            "step failed for sequences",
            "faulty",
        )  # the faults this phase injects, logged as it should
        report["server_b"] = {
            "exit_code": b.running().returncode,
            "errors_logged": [
                ln for ln in b.log_errors() if " ERROR " in ln and not any(mark in ln for mark in injected)
            ][:20],
        }
    return report


def run_loadtest(
    idle: int = 1000,
    chatting: int = 64,
    disconnects: int = 100,
    config: str | None = None,
    out_dir: str = "bench-results",
    dtype: str | None = None,
) -> dict[str, Any]:
    raise_nofile_limit()
    workdir = Path(tempfile.mkdtemp(prefix="rtserver-loadtest-"))
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": f"rtserver loadtest --idle {idle} --chatting {chatting} --disconnects {disconnects}"
        + (f" --dtype {dtype}" if dtype else ""),
        "workdir": str(workdir),
    }
    common = {
        "RTSERVER_SERVER_LOG_LEVEL": "warning",
        **ONE_ADDRESS_LIMITS_OFF,
    }
    if dtype:
        common["RTSERVER_MODEL_DTYPE"] = dtype
    report.update(_server_a(common, workdir, config, idle, chatting, disconnects))
    if FAULT_SERVER.is_file():
        report.update(_server_b(common, workdir, config))
    else:
        print(
            f"server B: skipped ({FAULT_SERVER} not found: the fault phases need the repository's tests/)",
            flush=True,
        )
    print("model load failure", flush=True)
    report["load_failure"] = phase_load_failure(workdir)
    write_report(report, out_dir)
    return report
