"""End-to-end WebSocket load client: N concurrent chat sessions, each sending several turns.

`run_chat_load` returns tokens/s, the client's and the server's TTFT per turn number, and errors by code.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from .stats import mean, per_second, percentile, ratio

DEFAULT_PROMPTS = [
    "Tell me about the ocean in two sentences.",
    "What else lives there?",
    "Which of those is the largest?",
    "How long does it live?",
    "Summarise our chat in one line.",
    "Thanks! One more fact, please.",
]


async def _ready(ws: Any, timeout_s: float, record: dict[str, Any]) -> bool:
    """Wait for `ready` after the hello; False (the error recorded) when the server refused."""
    while True:
        ev = json.loads(await asyncio.wait_for(ws.recv(), timeout_s))
        if ev["type"] == "ready":
            return True
        if ev["type"] == "error" and ev.get("code") != "session_expired":
            record["errors"].append(ev["code"])
            return False


def _per_turn(turns_done: list[dict[str, Any]], turns: int) -> dict[int, dict[str, Any]]:
    """Per turn number: how many completed, their first-token times and prompt tokens."""
    per_turn: dict[int, dict[str, Any]] = {}
    for turn in range(1, turns + 1):
        rows = [t for t in turns_done if t["turn"] == turn]
        ttfts = [t["client_ttft_ms"] for t in rows if t["client_ttft_ms"] is not None]
        server = [t["server_ttft_ms"] for t in rows if t["server_ttft_ms"] is not None]
        per_turn[turn] = {
            "n": len(rows),
            "ttft_p50_ms": percentile(ttfts, 0.5),
            "ttft_p95_ms": percentile(ttfts, 0.95),
            "server_ttft_p50_ms": percentile(server, 0.5),
            "prompt_tokens_mean": mean(t["prompt"] for t in rows),
            "cached_tokens_mean": mean(t["cached"] for t in rows),
        }
    return per_turn


async def _session(
    url: str,
    index: int,
    turns: int,
    max_new_tokens: int,
    prompts: list[str],
    options: dict[str, Any],
    timeout_s: float,
    record: dict[str, Any],
    auth_token: str | None,
    think_s: float,
) -> None:
    import websockets

    async with websockets.connect(url, max_size=None, open_timeout=timeout_s) as ws:
        hello: dict[str, Any] = {"type": "hello", "client": f"loadclient-{index}"}
        if auth_token:
            hello["auth_token"] = auth_token
        await ws.send(json.dumps(hello))
        if not await _ready(ws, timeout_s, record):
            return
        for turn in range(1, turns + 1):
            if turn > 1 and think_s > 0:
                await asyncio.sleep(think_s)
            rid = f"t{turn}"
            text = prompts[(turn - 1) % len(prompts)]
            sent = time.perf_counter()
            await ws.send(
                json.dumps(
                    {
                        "type": "chat",
                        "id": rid,
                        "text": text,
                        "options": {"max_new_tokens": max_new_tokens, **options},
                    }
                )
            )
            first: float | None = None
            while True:
                ev = json.loads(await asyncio.wait_for(ws.recv(), timeout_s))
                if ev.get("id") != rid or ev.get("auto"):
                    continue  # auto-task results and anything else not for this turn
                if ev["type"] == "token" and first is None:
                    first = time.perf_counter()
                elif ev["type"] == "done":
                    end = time.perf_counter()
                    record["turns"].append(
                        {
                            "session": index,
                            "turn": turn,
                            "generated": ev["usage"]["generated_tokens"],
                            "prompt": ev["usage"]["prompt_tokens"],
                            "cached": ev["usage"]["cached_tokens"],
                            "client_ttft_ms": None if first is None else (first - sent) * 1000,
                            "server_ttft_ms": ev["timing"]["ttft_ms"],
                            "total_ms": (end - sent) * 1000,
                        }
                    )
                    break
                elif ev["type"] == "error":
                    record["errors"].append(ev["code"])
                    break


def _summary(
    record: dict[str, Any],
    sessions: int,
    turns: int,
    max_new_tokens: int,
    wall: float,
    samples: list[float] | None,
) -> dict[str, Any]:
    """The figures `run_chat_load` returns, from what its sessions recorded."""
    tokens = sum(t["generated"] for t in record["turns"])
    per_turn = _per_turn(record["turns"], turns)
    all_ttft = [t["client_ttft_ms"] for t in record["turns"] if t["client_ttft_ms"] is not None]
    if samples is not None:
        samples.extend(all_ttft)
    errors: dict[str, int] = {}
    for code in record["errors"]:
        errors[code] = errors.get(code, 0) + 1
    first, last = per_turn[1]["ttft_p50_ms"], per_turn[turns]["ttft_p50_ms"]
    return {
        "sessions": sessions,
        "turns": turns,
        "max_new_tokens": max_new_tokens,
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": per_second(tokens, wall),
        "completed_turns": len(record["turns"]),
        "errors": errors,
        "per_turn": per_turn,
        "ttft_p50_ms": percentile(all_ttft, 0.5),
        "ttft_p95_ms": percentile(all_ttft, 0.95),
        "server_ttft_p95_ms": percentile(
            [t["server_ttft_ms"] for t in record["turns"] if t["server_ttft_ms"] is not None], 0.95
        ),
        "turn_ratio_p50": ratio(last, first),
    }


async def run_chat_load(
    url: str,
    sessions: int = 32,
    turns: int = 5,
    max_new_tokens: int = 32,
    *,
    prompts: list[str] | None = None,
    options: dict[str, Any] | None = None,
    timeout_s: float = 600.0,
    auth_token: str | None = None,
    think_s: float = 0.0,
    samples: list[float] | None = None,
) -> dict[str, Any]:
    """Run the load and return the summary dict (`samples`, where given, gets every turn's TTFT):

    {"sessions", "turns", "max_new_tokens", "wall_s", "tokens", "tokens_per_s", "completed_turns",
     "errors": {code: count}, "per_turn": {turn: {"n", "ttft_p50_ms", "ttft_p95_ms",
     "server_ttft_p50_ms", "cached_tokens_mean", "prompt_tokens_mean"}},
     "ttft_p50_ms", "ttft_p95_ms", "turn_ratio_p50": turn-`turns` p50 / turn-1 p50}

    `url` is the WebSocket URL (ws://host:port/ws). `options` are extra decoding options sent with each
    chat (default greedy, so runs are comparable). Connection failures count as errors ("connect").
    """
    record: dict[str, Any] = {"turns": [], "errors": []}
    opts = {"temperature": 0} if options is None else dict(options)
    started = time.perf_counter()
    results = await asyncio.gather(
        *[
            _session(
                url,
                i,
                turns,
                max_new_tokens,
                prompts or DEFAULT_PROMPTS,
                opts,
                timeout_s,
                record,
                auth_token,
                think_s,
            )
            for i in range(sessions)
        ],
        return_exceptions=True,
    )
    wall = time.perf_counter() - started
    for r in results:
        if isinstance(r, BaseException):
            record["errors"].append("connect" if isinstance(r, OSError) else type(r).__name__)
    return _summary(record, sessions, turns, max_new_tokens, wall, samples)
