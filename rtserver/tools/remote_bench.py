"""`rtserver bench --workloads remote`: rtserver as a hub in front of llama.cpp's llama-server, beside the
same llama-server driven directly, in one run.

- multi-turn (first, on a server that has already served the warm-up's chats, so its cache holds the
  system prompt): the multi-turn workload through the hub (tools/loadclient.py; 16 WebSocket sessions ×
  6 turns, 48 new tokens per reply, as the engine's multi-turn workload): TTFT per turn, turn 5 / turn 1,
  and the prompt tokens the server had cached (session affinity keeps them warm).
- burst: 32 OpenAI streaming clients at once (the burst workload's messages, greedy, exactly 64 new
  tokens with EOS ignored) against llama-server itself — through its `/v1/chat/completions`, and through
  its `/v1/completions` with the very token ids the hub sends (the chat template rendered as the hub
  renders it) — then the first client against `rtserver serve` with `model.backend = "openai"` pointing
  at that llama-server. Tokens/s and time to first token; the hub's ratio and its added TTFT are taken
  against the better of the two direct runs.

Every figure is taken REPS times, the runs interleaved (a burst: direct, hub, hub with the send gate,
...; multi-turn: through the hub, then driven directly with the same prompts), and the reported
figure is the median run's; every run's figure is kept in the JSON. Before each multi-turn run the
server's slots are erased and the warm-up chats replayed, so every run starts from the same cache. The
hub runs twice: as configured by default, and with `backend.send_window_ms = 1` (remote/gate.py on).

llama-server is built by rtserver/tools/llama_build.py (cached per CPU) and runs the embedded GGUF file
as is, with `-np 32 -c 16384 -t <threads>`.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import aiohttp

from ..config import Settings
from ..engine.model import embedded_model_path, load_tokenizer
from ..tasks.chat import ChatTask
from ..tasks.registry import load_registry
from .llama_build import build
from .loadclient import DEFAULT_PROMPTS, run_chat_load
from .serverproc import LlamaServerProcess, ServerProcess
from .stats import mean, median, percentile, ratio

BURST_TEXTS = [f"Tell me a short fact about the number {i}." for i in range(32)]
NEW_TOKENS = 64
MULTI_TURN = (16, 6, 48)  # sessions, turns, new tokens per reply: the multi-turn workload
WARM_UP_CHAT = ["Hello!"]
REPS = 3
SLOTS = 32


async def _stream(http: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """One streamed request (chat completion or completion): time to its first text, tokens made."""
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
    usage: dict = {}
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


def _burst_requests(base: str, prompts: list[list[int]] | None) -> tuple[str, list[dict]]:
    """The 32 burst requests: chat messages, or (`prompts`) token ids to /v1/completions."""
    if prompts is None:
        return base + "/v1/chat/completions", [
            {"messages": [{"role": "user", "content": t}]} for t in BURST_TEXTS
        ]
    return base + "/v1/completions", [{"prompt": p} for p in prompts]


async def burst(base: str, prompts: list[list[int]] | None = None, warm: bool = True) -> dict:
    """The 32 burst requests at once; `warm`: one untimed burst first, so that every slot, connection
    and cache of the path is warm for the timed one."""
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


def _median_run(runs: list[dict], key: str) -> dict:
    """The run whose `key` is the median (the lower middle one of an even count), with every run's
    figure beside it."""
    ordered = sorted(runs, key=lambda r: r[key] if r[key] is not None else float("inf"))
    return {**ordered[(len(ordered) - 1) // 2], "runs_" + key: [r[key] for r in runs]}


async def _erase_slots(base: str) -> None:
    """Empty every slot's cache (llama-server `POST /slots/<id>?action=erase`)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        for slot in range(SLOTS):
            async with http.post(f"{base}/slots/{slot}?action=erase") as r:
                r.raise_for_status()


async def direct_multi_turn(base: str, chat: ChatTask, sessions: int, turns: int, new_tokens: int) -> dict:
    """The multi-turn workload driven on llama-server directly: each session's prompt is its history
    rendered by the chat template (as the hub renders it), sent as token ids to /v1/completions with the
    hub's decoding (greedy); per turn, the time to the first text and llama-server's own `timings`."""
    record: list[dict] = []

    async def session(http: aiohttp.ClientSession) -> None:
        history: list[dict] = []
        for turn in range(1, turns + 1):
            history.append({"role": "user", "content": DEFAULT_PROMPTS[(turn - 1) % len(DEFAULT_PROMPTS)]})
            body = {
                "prompt": chat.render(history),
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
            text, usage, timings = "", {}, {}
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
            history.append({"role": "assistant", "content": text})
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            record.append(
                {
                    "turn": turn,
                    "ttft_ms": None if first is None else (first - started) * 1000,
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
    per_turn = {}
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
    return {"sessions": sessions, "turns": turns, "max_new_tokens": new_tokens, "per_turn": per_turn}


def _turn_ratio(run: dict) -> float | None:
    return ratio(run["per_turn"][5]["ttft_p50_ms"], run["per_turn"][1]["ttft_p50_ms"])


def _hub(llama: LlamaServerProcess, log_path: Path, extra: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess(
        {
            "RTSERVER_MODEL_BACKEND": "openai",
            "RTSERVER_BACKEND_URLS": llama.base,
            "RTSERVER_TASKS_AUTO_TASKS": "",
            "RTSERVER_SERVER_LOG_LEVEL": "warning",
            "RTSERVER_SECURITY_IP_RATE_LIMIT_PER_S": "0",
            "RTSERVER_SECURITY_MAX_SESSIONS_PER_IP": "0",
            **(extra or {}),
        },
        log_path,
    )


def run_remote_bench(threads: int, workdir: Path | None = None) -> dict:
    workdir = workdir or Path(tempfile.mkdtemp(prefix="rtserver-remote-bench-"))
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
    print(f"  [remote] llama-server: starting ({llama.log_path})", flush=True)
    llama.start()
    hub = _hub(llama, workdir / "hub.log")
    gated = _hub(llama, workdir / "hub-gated.log", {"RTSERVER_BACKEND_SEND_WINDOW_MS": "1"})
    runs: dict[str, list[dict]] = {k: [] for k in ("chat", "ids", "hub", "gated", "turns", "direct_turns")}
    try:
        hub.start(timeout_s=180)
        gated.start(timeout_s=180)
        # multi-turn first, on a server that has served other chats (the warm-up's): its cache holds the
        # system prompt, and no burst prompt shares the first turn's opening words
        for rep in range(REPS):
            print(f"  [remote] multi-turn {rep + 1}/{REPS}: through the hub, then directly", flush=True)
            asyncio.run(_erase_slots(llama.base))
            asyncio.run(run_chat_load(hub.ws_url, MULTI_TURN[0], 1, 8, prompts=WARM_UP_CHAT))
            runs["turns"].append(asyncio.run(run_chat_load(hub.ws_url, *MULTI_TURN)))
            asyncio.run(_erase_slots(llama.base))
            asyncio.run(run_chat_load(hub.ws_url, MULTI_TURN[0], 1, 8, prompts=WARM_UP_CHAT))
            runs["direct_turns"].append(asyncio.run(direct_multi_turn(llama.base, chat, *MULTI_TURN)))
        targets = {
            "chat": (llama.base, None),  # llama-server's /v1/chat/completions
            "ids": (llama.base, prompts),  # its /v1/completions with the hub's token ids
            "hub": (hub.base, None),
            "gated": (gated.base, None),
        }
        for rep in range(REPS):
            print(f"  [remote] burst {rep + 1}/{REPS}: direct (chat, token ids), hub, hub gated", flush=True)
            for key, (base, ids) in targets.items():
                try:
                    runs[key].append(asyncio.run(burst(base, ids, warm=rep == 0)))
                except aiohttp.ClientError as exc:
                    raise RuntimeError(f"burst {rep + 1} ({key}, {base}) failed: {exc!r}") from exc
    finally:
        hub.stop()
        gated.stop()
        llama.stop()
    direct_chat, direct_ids = (
        _median_run(runs["chat"], "ttft_p50_ms"),
        _median_run(runs["ids"], "ttft_p50_ms"),
    )
    through, through_gated = (
        _median_run(runs["hub"], "ttft_p50_ms"),
        _median_run(runs["gated"], "ttft_p50_ms"),
    )
    direct = max(direct_chat, direct_ids, key=lambda r: r["tokens_per_s"])
    best_direct_ttft = min(
        r["ttft_p50_ms"] for r in (direct_chat, direct_ids) if r["ttft_p50_ms"] is not None
    )
    for run in runs["turns"] + runs["direct_turns"]:
        run["turn5_ratio"] = _turn_ratio(run)
    turns, direct_turns = (
        _median_run(runs["turns"], "turn5_ratio"),
        _median_run(runs["direct_turns"], "turn5_ratio"),
    )
    return {
        "llama_server": {"binary": str(binary), "args": llama.cmd[1:]},
        "reps": REPS,
        "burst_direct_chat": direct_chat,
        "burst_direct_token_ids": direct_ids,
        "burst_direct": direct,
        "burst_through_hub": through,
        "burst_through_hub_gated": through_gated,
        "hub_tokens_per_s_ratio": ratio(
            median(r["tokens_per_s"] for r in runs["hub"]),
            median(r["tokens_per_s"] for r in runs["chat" if direct is direct_chat else "ids"]),
        ),
        "hub_added_ttft_p50_ms": (through["ttft_p50_ms"] or 0) - best_direct_ttft,
        "hub_gated_added_ttft_p50_ms": (through_gated["ttft_p50_ms"] or 0) - best_direct_ttft,
        # per run, against the token-id run just before it (the same cache and machine state)
        "hub_added_ttft_p50_ms_runs": [
            (h["ttft_p50_ms"] or 0) - (d["ttft_p50_ms"] or 0) for h, d in zip(runs["hub"], runs["ids"])
        ],
        "hub_gated_added_ttft_p50_ms_runs": [
            (h["ttft_p50_ms"] or 0) - (d["ttft_p50_ms"] or 0) for h, d in zip(runs["gated"], runs["ids"])
        ],
        "multi_turn": turns,
        "multi_turn_turn5_ratio": turns["turn5_ratio"],
        "multi_turn_cached_tokens_mean": mean(t["cached_tokens_mean"] for t in turns["per_turn"].values()),
        "multi_turn_direct": direct_turns,
        "multi_turn_direct_turn5_ratio": direct_turns["turn5_ratio"],
    }


if __name__ == "__main__":  # a quick look without the whole bench: python -m rtserver.tools.remote_bench
    print(json.dumps(run_remote_bench(os.cpu_count() or 2), indent=2, default=str))
