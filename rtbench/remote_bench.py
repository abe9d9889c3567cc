"""`rtserver bench --workloads remote`: the hub in front of llama-server, beside it driven directly.

Multi-turn sessions and a 32-stream burst run through the hub and directly. Sessions run with and without
the next-turn prefetch, and with pauses between turns. Each figure is the median of REPS interleaved runs
(`RTSERVER_BENCH_REMOTE_REPS`). Each run starts from the same server cache. Placements come from
`RTSERVER_BENCH_REMOTE_PLACEMENTS`. They are "shared" cores, or "split" with llama-server pinned apart.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from rtserver.config import Settings
from rtserver.engine.model import embedded_model_path, load_tokenizer
from rtserver.tasks.chat import ChatTask
from rtserver.tasks.registry import load_registry

from .llama_build import build
from .loadclient import DEFAULT_PROMPTS, run_chat_load
from .serverproc import ONE_ADDRESS_LIMITS_OFF, LlamaServerProcess, ServerProcess
from .stats import mean, median, percentile, ratio

BURST_TEXTS = [f"Tell me a short fact about the number {i}." for i in range(32)]
NEW_TOKENS = 64
MULTI_TURN = (16, 6, 48)  # sessions, turns, new tokens per reply: the multi-turn workload
WARM_UP_CHAT = ["Hello!"]
REPS = 3
SLOTS = 32
THINK_S = 2.0  # the multi-turn variant with a pause between turns (a user reading and typing)
# the multi-turn runs: through the hub with the next-turn prefetch on and off, llama-server driven
# directly, and through the hub with THINK_S between turns, prefetch on and off
MULTI_TURN_RUNS = ("turns", "turns_no_prefetch", "direct_turns", "think_turns", "think_turns_no_prefetch")


async def _stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed request (chat completion or completion). Returns time to its first text, and tokens
    made.
    """
    body = {
        **body,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first: float | None = None
    pieces = 0
    usage: dict[str, Any] = {}
    async with http.post(url, json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:  # line by line
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content") or choice.get("text"):
                    first = first or time.perf_counter()
                    pieces += 1
    return {
        "ttft_ms": None if first is None else (first - started) * 1000,
        "tokens": usage.get("completion_tokens", pieces),
    }


def _burst_requests(base: str, prompts: list[list[int]] | None) -> tuple[str, list[dict[str, Any]]]:
    """The 32 burst requests: chat messages, or (`prompts`) token ids to /v1/completions."""
    if prompts is None:
        return base + "/v1/chat/completions", [
            {"messages": [{"role": "user", "content": t}]} for t in BURST_TEXTS
        ]
    return base + "/v1/completions", [{"prompt": p} for p in prompts]


async def burst(base: str, prompts: list[list[int]] | None = None, warm: bool = True) -> dict[str, Any]:
    """The 32 burst requests at once. `warm` runs one untimed burst first. Then every slot, connection and
    cache of the path is warm for the timed one.
    """
    # aiohttp: a client whose own per-request CPU (a fraction of httpx's) does not spread the burst's
    # arrival, so the figures are the servers', for the direct and the hub runs alike
    timeout = aiohttp.ClientTimeout(total=600)
    url, bodies = _burst_requests(base, prompts)
    # connections idle for 4 s are dropped here before the servers drop them (at 5 s)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        if warm:
            await asyncio.gather(*(_stream(http, url, b) for b in bodies))
        started = time.perf_counter()
        rows = await asyncio.gather(*(_stream(http, url, b) for b in bodies))
        wall = time.perf_counter() - started
    ttfts = [r["ttft_ms"] for r in rows if r["ttft_ms"] is not None]
    tokens = sum(r["tokens"] for r in rows)
    return {
        "requests": len(rows),
        "tokens": tokens,
        "exact_token_counts": all(r["tokens"] == NEW_TOKENS for r in rows),
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": percentile(ttfts, 0.5),
        "ttft_p95_ms": percentile(ttfts, 0.95),
    }


def _median_run(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The run whose `key` is the median, with every run's figure beside it. Of an even count, the lower
    middle one.
    """
    ordered = sorted(runs, key=lambda r: r[key] if r[key] is not None else float("inf"))
    return {**ordered[(len(ordered) - 1) // 2], "runs_" + key: [r[key] for r in runs]}


async def _erase_slots(base: str) -> None:
    """Empty every slot's cache (llama-server `POST /slots/<id>?action=erase`)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        for slot in range(SLOTS):
            async with http.post(f"{base}/slots/{slot}?action=erase") as r:
                r.raise_for_status()


async def _streamed_completion(
    http: aiohttp.ClientSession, base: str, prompt: list[int], new_tokens: int
) -> tuple[str, float | None, dict[str, Any], dict[str, Any]]:
    """One greedy streamed /v1/completions request. Returns its text, ms to the first text, usage, timings."""
    body = {
        "prompt": prompt,
        "max_tokens": new_tokens,
        "temperature": 0.0,
        "top_k": 1,
        "top_p": 1.0,
        "min_p": 0.0,
        "stream": True,
        "cache_prompt": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first: float | None = None
    text = ""
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    async with http.post(base + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            timings = event.get("timings") or timings
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    first = first or time.perf_counter()
                    text += choice["text"]
    return text, None if first is None else (first - started) * 1000, usage, timings


def _direct_per_turn(record: list[dict[str, Any]], turns: int) -> dict[int, dict[str, Any]]:
    """Per turn number: first-text times, llama-server's prompt times, prompt and cached tokens."""
    per_turn: dict[int, dict[str, Any]] = {}
    for turn in range(1, turns + 1):
        rows = [r for r in record if r["turn"] == turn]
        per_turn[turn] = {
            "n": len(rows),
            "ttft_p50_ms": percentile([r["ttft_ms"] for r in rows if r["ttft_ms"] is not None], 0.5),
            "server_prompt_ms_p50": percentile(
                [r["server_prompt_ms"] for r in rows if r["server_prompt_ms"] is not None], 0.5
            ),
            "server_prompt_n_mean": mean(
                r["server_prompt_n"] for r in rows if r["server_prompt_n"] is not None
            ),
            "prompt_tokens_mean": mean(r["prompt_tokens"] for r in rows if r["prompt_tokens"] is not None),
            "cached_tokens_mean": mean(r["cached_tokens"] for r in rows if r["cached_tokens"] is not None),
        }
    return per_turn


async def direct_multi_turn(
    base: str, chat: ChatTask, sessions: int, turns: int, new_tokens: int
) -> dict[str, Any]:
    """The multi-turn workload driven on llama-server directly. Each session's prompt is its history
    rendered by the chat template, as the hub renders it. It is sent as token ids to /v1/completions with
    the hub's decoding (greedy). Per turn it records the time to the first text. It also records
    llama-server's own `timings`.
    """
    record: list[dict[str, Any]] = []

    async def session(http: aiohttp.ClientSession) -> None:
        history: list[dict[str, Any]] = []
        for turn in range(1, turns + 1):
            history.append({"role": "user", "content": DEFAULT_PROMPTS[(turn - 1) % len(DEFAULT_PROMPTS)]})
            text, ttft_ms, usage, timings = await _streamed_completion(
                http, base, chat.render(history), new_tokens
            )
            history.append({"role": "assistant", "content": text})
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            record.append(
                {
                    "turn": turn,
                    "ttft_ms": ttft_ms,
                    "prompt_tokens": usage.get("prompt_tokens"),
                    "cached_tokens": cached,
                    "server_prompt_ms": timings.get("prompt_ms"),
                    "server_prompt_n": timings.get("prompt_n"),
                }
            )

    # a connection per request: llama-server drops one idle for 5 s, and a turn can take that long
    # (a local connect costs well under a millisecond)
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=600), connector=aiohttp.TCPConnector(limit=0, force_close=True)
    ) as http:
        await asyncio.gather(*(session(http) for _ in range(sessions)))
    per_turn = _direct_per_turn(record, turns)
    return {"sessions": sessions, "turns": turns, "max_new_tokens": new_tokens, "per_turn": per_turn}


def _turn_ratio(run: dict[str, Any]) -> float | None:
    return ratio(run["per_turn"][5]["ttft_p50_ms"], run["per_turn"][1]["ttft_p50_ms"])


def _hub(
    llama: LlamaServerProcess, log_path: Path, cpus: set[int] | None, extra: dict[str, str] | None = None
) -> ServerProcess:
    hub = ServerProcess(
        {
            "RTSERVER_MODEL_BACKEND": "openai",
            "RTSERVER_BACKEND_URLS": llama.base,
            "RTSERVER_TASKS_AUTO_TASKS": "",
            "RTSERVER_SERVER_LOG_LEVEL": "warning",
            **ONE_ADDRESS_LIMITS_OFF,
            **(extra or {}),
        },
        log_path,
    )
    hub.cpus = cpus
    return hub


def _flow(hub: ServerProcess) -> dict[str, Any]:
    """A hub's send-gate requests and groups, and its prefetches by outcome. Read from its /metrics."""
    m = hub.metrics()
    prefix = 'rtserver_backend_prefetches_total{outcome="'
    return {
        "gated_requests": m.get("rtserver_backend_gated_requests_total"),
        "send_groups": m.get("rtserver_backend_send_groups_total"),
        "prefetches": {k[len(prefix) : -2]: v for k, v in m.items() if k.startswith(prefix)},
    }


def placement_cpus(placement: str, threads: int) -> tuple[set[int] | None, set[int] | None, int, str]:
    """(llama-server's CPUs, the hub's and the clients' CPUs, llama-server's threads, a description).
    "shared": everything on every core, llama-server with `threads`. "split": llama-server on the first half
    of this process's cores (one of two), with a thread per core. The hub and the clients run on the rest.
    This is a hub on cores of its own in front of an inference server. ValueError where a split is not
    possible (no sched_setaffinity, fewer than 2 cores).
    """
    if placement == "shared":
        return None, None, threads, f"shared: llama-server -t {threads}, hub and clients on every core"
    if placement != "split":
        raise ValueError(f"unknown placement {placement!r} (shared, split)")
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("this platform cannot pin processes to cores (no os.sched_setaffinity)")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ValueError(f"pinning needs at least 2 cores, this process may use {len(cores)}")
    half = len(cores) // 2
    llama, rest = set(cores[:half]), set(cores[half:])
    return (
        llama,
        rest,
        len(llama),
        f"split: llama-server -t {len(llama)} on cores {sorted(llama)}, hub and clients on {sorted(rest)}",
    )


def run_remote_bench(threads: int, workdir: Path | None = None) -> dict[str, Any]:
    """Every placement in RTSERVER_BENCH_REMOTE_PLACEMENTS (comma-separated; default "shared,split"). Each
    runs every figure RTSERVER_BENCH_REMOTE_REPS times (default REPS). The first placement's figures are the
    report's own keys. The bench table shows them. Every placement's figures are under "placements".
    """
    workdir = workdir or Path(tempfile.mkdtemp(prefix="rtserver-remote-bench-"))
    names = [p.strip() for p in os.environ.get("RTSERVER_BENCH_REMOTE_PLACEMENTS", "shared,split").split(",")]
    reps = int(os.environ.get("RTSERVER_BENCH_REMOTE_REPS") or REPS)
    placements: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            cpus = placement_cpus(name, threads)
        except ValueError as exc:
            print(f"  [remote] placement {name}: skipped: {exc}", flush=True)
            placements[name] = {"skipped": str(exc)}
            continue
        (workdir / name).mkdir(parents=True, exist_ok=True)
        # split: the burst (the hub's overhead) and the multi-turn bar's runs; the prefetch's
        # comparisons once, on the shared cores
        kinds = MULTI_TURN_RUNS if name == "shared" else ("turns", "direct_turns")
        placements[name] = run_placement(name, cpus, reps, workdir / name, kinds)
    ran = [r for r in placements.values() if "skipped" not in r]
    if not ran:
        raise RuntimeError("no placement of the remote bench could run: " + json.dumps(placements))
    return {**ran[0], "placements": placements}


def _warm(llama: LlamaServerProcess, plain: ServerProcess) -> None:
    """llama-server's slots erased, then the warm-up chats through the hub without prefetch."""
    asyncio.run(_erase_slots(llama.base))
    asyncio.run(run_chat_load(plain.ws_url, MULTI_TURN[0], 1, 8, prompts=WARM_UP_CHAT))


def _multi_turn_rep(
    runs: dict[str, list[dict[str, Any]]],
    kinds: tuple[str, ...],
    llama: LlamaServerProcess,
    hub: ServerProcess,
    plain: ServerProcess,
    chat: ChatTask,
) -> None:
    """One run of each multi-turn kind asked for, each from the same warmed cache."""
    for key, url, think in (
        ("turns", hub.ws_url, 0.0),
        ("turns_no_prefetch", plain.ws_url, 0.0),
        ("direct_turns", None, 0.0),
        ("think_turns", hub.ws_url, THINK_S),
        ("think_turns_no_prefetch", plain.ws_url, THINK_S),
    ):
        if key not in kinds:
            continue
        _warm(llama, plain)
        if url is None:
            runs[key].append(asyncio.run(direct_multi_turn(llama.base, chat, *MULTI_TURN)))
        else:
            runs[key].append(asyncio.run(run_chat_load(url, *MULTI_TURN, think_s=think)))


def _burst_rep(
    runs: dict[str, list[dict[str, Any]]], targets: dict[str, tuple[str, list[list[int]] | None]], rep: int
) -> None:
    """One burst against each target. First llama-server direct (chat, token ids), then the hub."""
    for key, (base, ids) in targets.items():
        try:
            runs[key].append(asyncio.run(burst(base, ids, warm=rep == 0)))
        except aiohttp.ClientError as exc:
            raise RuntimeError(f"burst {rep + 1} ({key}, {base}) failed: {exc!r}") from exc


def run_placement(
    name: str,
    cpus: tuple[set[int] | None, set[int] | None, int, str],
    reps: int,
    workdir: Path,
    kinds: tuple[str, ...] = MULTI_TURN_RUNS,
) -> dict[str, Any]:
    llama_cpus, hub_cpus, threads, described = cpus
    binary = build()
    _, tokenizer = load_tokenizer("embedded")
    chat = load_registry(Settings(), tokenizer)[0].chat
    prompts = [chat.render([{"role": "user", "content": t}]) for t in BURST_TEXTS]  # what the hub sends
    llama = LlamaServerProcess(
        binary,
        embedded_model_path(),
        workdir / "llama-server.log",
        slots=SLOTS,
        ctx=16384,
        threads=threads,
        slot_save_path=workdir,
    )
    llama.cpus = llama_cpus
    print(f"  [remote] {described}; llama-server: starting ({llama.log_path})", flush=True)
    own_cpus = os.sched_getaffinity(0) if hub_cpus else None
    llama.start()
    hub = _hub(llama, workdir / "hub.log", hub_cpus)
    # the same hub without the next-turn prefetch (it also replays the warm-up chats, so every
    # multi-turn run starts from the same cache)
    plain = _hub(
        llama, workdir / "hub-no-prefetch.log", hub_cpus, {"RTSERVER_BACKEND_PREFETCH_NEXT_TURN": "0"}
    )
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ("chat", "ids", "hub", *kinds)}
    try:
        if hub_cpus:
            os.sched_setaffinity(0, hub_cpus)  # the clients: this process
        hub.start(timeout_s=180)
        plain.start(timeout_s=180)
        # multi-turn first, on a server that has served other chats (the warm-up's): its cache holds the
        # system prompt, and no burst prompt shares the first turn's opening words
        for rep in range(reps):
            print(f"  [remote] multi-turn {rep + 1}/{reps}: {', '.join(kinds)}", flush=True)
            _multi_turn_rep(runs, kinds, llama, hub, plain, chat)
        targets = {
            "chat": (llama.base, None),  # llama-server's /v1/chat/completions
            "ids": (llama.base, prompts),  # its /v1/completions with the hub's token ids
            "hub": (hub.base, None),
        }
        for rep in range(reps):
            print(f"  [remote] burst {rep + 1}/{reps}: direct (chat, token ids), hub", flush=True)
            _burst_rep(runs, targets, rep)
        # how the hubs' requests left (the send gate's groups) and what became of their prefetches
        flow = {name: _flow(h) for name, h in (("hub", hub), ("hub_no_prefetch", plain))}
    finally:
        hub.stop()
        plain.stop()
        llama.stop()
        if own_cpus:
            os.sched_setaffinity(0, own_cpus)
    placed = {
        "placement": name,
        "placement_description": described,
        "llama_server": {"binary": str(binary), "args": llama.cmd[1:], "cpus": sorted(llama_cpus or [])},
        "hub_and_client_cpus": sorted(hub_cpus or []),
        "reps": reps,
    }
    return {**placed, **_figures(runs, kinds, flow)}


def _figures(
    runs: dict[str, list[dict[str, Any]]], kinds: tuple[str, ...], flow: dict[str, Any]
) -> dict[str, Any]:
    """A placement's figures. The median runs, their ratios, and the hub's added first-token time."""
    direct_chat, direct_ids = (
        _median_run(runs["chat"], "ttft_p50_ms"),
        _median_run(runs["ids"], "ttft_p50_ms"),
    )
    through = _median_run(runs["hub"], "ttft_p50_ms")
    direct = max(direct_chat, direct_ids, key=lambda r: r["tokens_per_s"])
    best_direct_ttft = min(
        r["ttft_p50_ms"] for r in (direct_chat, direct_ids) if r["ttft_p50_ms"] is not None
    )
    speeds = {k: [r["tokens_per_s"] for r in runs[k]] for k in ("chat", "ids", "hub")}
    speed = {k: median(v) for k, v in speeds.items()}
    multi = {}
    for key in kinds:
        for run in runs[key]:
            run["turn5_ratio"] = _turn_ratio(run)
        multi[key] = _median_run(runs[key], "turn5_ratio")
    return {
        "burst_direct_chat": direct_chat,
        "burst_direct_token_ids": direct_ids,
        "burst_direct": direct,
        "burst_through_hub": through,
        # every run's tokens/s and their medians, which the ratio compares (the burst_* entries above are
        # the runs with the median first-token time)
        "burst_tokens_per_s_runs": speeds,
        "burst_tokens_per_s_median": speed,
        "hub_tokens_per_s_ratio": ratio(speed["hub"], speed["chat" if direct is direct_chat else "ids"]),
        "hub_added_ttft_p50_ms": (through["ttft_p50_ms"] or 0) - best_direct_ttft,
        "hub_flow": flow,
        # per run, against the token-id run just before it (the same cache and machine state)
        "hub_added_ttft_p50_ms_runs": [
            (h["ttft_p50_ms"] or 0) - (d["ttft_p50_ms"] or 0) for h, d in zip(runs["hub"], runs["ids"])
        ],
        "multi_turn": multi["turns"],
        "multi_turn_turn5_ratio": multi["turns"]["turn5_ratio"],
        "multi_turn_cached_tokens_mean": mean(
            t["cached_tokens_mean"] for t in multi["turns"]["per_turn"].values()
        ),
        "think_s": THINK_S,
        # the other multi-turn runs, each as "multi_turn" (the median run by turn 5 / turn 1)
        **{_KEYS[k]: multi[k] for k in kinds if k != "turns"},
        **{_KEYS[k] + "_turn5_ratio": multi[k]["turn5_ratio"] for k in kinds if k != "turns"},
    }


_KEYS = {
    "turns_no_prefetch": "multi_turn_no_prefetch",
    "direct_turns": "multi_turn_direct",
    "think_turns": "multi_turn_think",
    "think_turns_no_prefetch": "multi_turn_think_no_prefetch",
}


if __name__ == "__main__":  # a quick look without the whole bench: python -m rtbench.remote_bench
    print(json.dumps(run_remote_bench(os.cpu_count() or 2), indent=2, default=str))
