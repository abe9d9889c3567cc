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
from ..tasks.registry import load_registry
from .llama_build import build
from .loadclient import run_chat_load
from .serverproc import LlamaServerProcess, ServerProcess
from .stats import mean, percentile, ratio

BURST_TEXTS = [f"Tell me a short fact about the number {i}." for i in range(32)]
NEW_TOKENS = 64
MULTI_TURN = (16, 6, 48)  # sessions, turns, new tokens per reply: the multi-turn workload
WARM_UP_CHAT = ["Hello!"]


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


async def burst(base: str, prompts: list[list[int]] | None = None) -> dict:
    """The 32 burst requests at once: chat messages, or (`prompts`) token ids to /v1/completions."""
    # aiohttp: a client whose own per-request CPU (a fraction of httpx's) does not spread the burst's
    # arrival, so the figures are the servers', for the direct and the hub runs alike
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        if prompts is None:
            url, bodies = (
                base + "/v1/chat/completions",
                [{"messages": [{"role": "user", "content": t}]} for t in BURST_TEXTS],
            )
        else:
            url, bodies = base + "/v1/completions", [{"prompt": p} for p in prompts]
        # one untimed burst first: every slot, connection and cache of the path is warm for the timed one
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


def run_remote_bench(threads: int, workdir: Path | None = None) -> dict:
    workdir = workdir or Path(tempfile.mkdtemp(prefix="rtserver-remote-bench-"))
    binary = build()
    _, tokenizer = load_tokenizer("embedded")
    chat = load_registry(Settings(), tokenizer)[0].chat
    prompts = [chat.render([{"role": "user", "content": t}]) for t in BURST_TEXTS]  # what the hub sends
    llama = LlamaServerProcess(
        binary, embedded_model_path(), workdir / "llama-server.log", slots=32, ctx=16384, threads=threads
    )
    print(f"  [remote] llama-server: starting ({llama.log_path})", flush=True)
    llama.start()
    hub = ServerProcess(
        {
            "RTSERVER_MODEL_BACKEND": "openai",
            "RTSERVER_BACKEND_URLS": llama.base,
            "RTSERVER_TASKS_AUTO_TASKS": "",
            "RTSERVER_SERVER_LOG_LEVEL": "warning",
            "RTSERVER_SECURITY_IP_RATE_LIMIT_PER_S": "0",
            "RTSERVER_SECURITY_MAX_SESSIONS_PER_IP": "0",
        },
        workdir / "hub.log",
    )
    try:
        hub.start(timeout_s=180)
        # multi-turn first, on a server that has served other chats (the warm-up's): its cache holds the
        # system prompt, and no burst prompt shares the first turn's opening words
        print("  [remote] multi-turn: %d sessions x %d turns through the hub" % MULTI_TURN[:2], flush=True)
        asyncio.run(run_chat_load(hub.ws_url, MULTI_TURN[0], 1, 8, prompts=WARM_UP_CHAT))
        turns = asyncio.run(run_chat_load(hub.ws_url, *MULTI_TURN))
        print("  [remote] burst: llama-server directly (/v1/chat/completions)", flush=True)
        direct_chat = asyncio.run(burst(llama.base))
        print("  [remote] burst: llama-server directly (/v1/completions, the hub's token ids)", flush=True)
        direct_ids = asyncio.run(burst(llama.base, prompts))
        print("  [remote] burst: through the rtserver hub", flush=True)
        through = asyncio.run(burst(hub.base))
    finally:
        hub.stop()
        llama.stop()
    direct = max(direct_chat, direct_ids, key=lambda r: r["tokens_per_s"])
    return {
        "llama_server": {"binary": str(binary), "args": llama.cmd[1:]},
        "burst_direct_chat": direct_chat,
        "burst_direct_token_ids": direct_ids,
        "burst_direct": direct,
        "burst_through_hub": through,
        "hub_tokens_per_s_ratio": ratio(through["tokens_per_s"], direct["tokens_per_s"]),
        "hub_added_ttft_p50_ms": (through["ttft_p50_ms"] or 0)
        - min(r["ttft_p50_ms"] for r in (direct_chat, direct_ids) if r["ttft_p50_ms"] is not None),
        "multi_turn": turns,
        "multi_turn_turn5_ratio": ratio(
            turns["per_turn"][5]["ttft_p50_ms"], turns["per_turn"][1]["ttft_p50_ms"]
        ),
        "multi_turn_cached_tokens_mean": mean(t["cached_tokens_mean"] for t in turns["per_turn"].values()),
    }


if __name__ == "__main__":  # a quick look without the whole bench: python -m rtserver.tools.remote_bench
    print(json.dumps(run_remote_bench(os.cpu_count() or 2), indent=2, default=str))
