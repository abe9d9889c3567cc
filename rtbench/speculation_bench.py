"""`rtserver bench --workloads speculation`: one `rtserver serve` config with drafts on, then off.

Prompt-lookup speculation (rtserver/engine/speculation.py) pays where a reply copies from its prompt.
The same server runs twice: drafting as configured, then with `engine.speculate_max_live = 0`. Each
run first holds 20 support conversations over the chat (two customer turns each, greedy, untimed: the
warm-up, and the transcripts the copy calls read). Then come, timed:
- copy: each conversation's `summarize` and `extract` calls (the agents' copilot), and a chat turn that
  repeats the customer's order number, one call at a time;
- single: the story of WORKLOADS.md (nothing to copy), greedy, 128 tokens;
- burst-unique: 32 streams at once, 64 tokens each (above the threshold, so nothing is drafted).
Both runs read the first run's transcripts. Every output must be the same text in both runs.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from .openai_client import client_session
from .server_bench import (
    BENCH_ENV,
    BURST_TEXTS,
    BURST_TOKENS,
    SINGLE_TEXT,
    SINGLE_TOKENS,
    Progress,
    burst,
    warm_up_one,
)
from .serverproc import ServerProcess
from .stats import per_second, ratio

NAMES = ["Ana Silva", "Ben Okafor", "Chen Wei", "Dana Kowalski", "Eli Haddad"]
PRODUCTS = [
    "two blue ceramic mugs",
    "a FrostLine 40 L cool box",
    "the Trailhead 2 hiking boots, size 44",
    "a pack of 12 AA batteries",
    "the Lumen desk lamp in walnut",
]
ISSUES = ["has not arrived yet", "arrived damaged", "is the wrong colour", "was charged twice"]
CHAT_TOKENS = 48
RUNS = {"drafts on": {}, "drafts off": {"RTSERVER_ENGINE_SPECULATE_MAX_LIVE": "0"}}
BARS = {"copy": 1.5, "single": 0.97, "burst-unique": 0.98}  # drafts on / off, tokens per second


def customers(count: int = 20) -> list[dict[str, str]]:
    """The conversations' customers: a name, an order number, a product, an issue and an e-mail."""
    out = []
    for i in range(count):
        name = NAMES[i % len(NAMES)]
        order = f"{'ABCDEFGH'[i % 8]}{'KMPRTX'[i % 6]}-{48213 + 977 * i:05d}"
        email = f"{name.split()[0].lower()}.{name.split()[1].lower()}{i}@example.com"
        out.append(
            {
                "name": name,
                "order": order,
                "product": PRODUCTS[i % len(PRODUCTS)],
                "issue": ISSUES[i % len(ISSUES)],
                "email": email,
            }
        )
    return out


def customer_turns(c: dict[str, str]) -> list[str]:
    """What the customer writes, turn by turn."""
    return [
        f"Hi, this is {c['name']}. My order {c['order']} for {c['product']} {c['issue']}.",
        f"The order number is {c['order']} and my e-mail is {c['email']}. Can you check it for me?",
    ]


def transcript(messages: list[dict[str, str]]) -> str:
    """A conversation as the copilot tasks read it: one line a message (see plugins/suggest_reply.py)."""
    who = {"user": "Customer", "assistant": "Bot"}
    return "\n".join(f"{who[m['role']]}: {m['content']}" for m in messages)


async def call(http: aiohttp.ClientSession, base: str, task: str, body: dict[str, Any]) -> dict[str, Any]:
    """One task call through the API: its text, generated tokens and wall seconds."""
    started = time.perf_counter()
    async with http.post(f"{base}/v1/tasks/{task}", json=body) as resp:
        answer = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"{task}: HTTP {resp.status}: {str(answer)[:300]}")
    seconds = time.perf_counter() - started
    return {"text": answer["text"], "tokens": answer["usage"]["generated_tokens"], "seconds": seconds}


def chat_body(history: list[dict[str, str]]) -> dict[str, Any]:
    return {"input": {"history": history}, "options": {"temperature": 0.0, "max_new_tokens": CHAT_TOKENS}}


async def conversations(base: str) -> list[list[dict[str, str]]]:
    """Each customer's conversation: their turns and the chat's greedy replies, one turn at a time."""
    out = []
    async with client_session() as http:
        for c in customers():
            history: list[dict[str, str]] = []
            for text in customer_turns(c):
                history.append({"role": "user", "content": text})
                reply = await call(http, base, "chat", chat_body(history))
                history.append({"role": "assistant", "content": reply["text"]})
            out.append(history)
    return out


async def copy_calls(base: str, convs: list[list[dict[str, str]]]) -> dict[str, list[dict[str, Any]]]:
    """The copy-heavy calls, one at a time: summarize, extract, and the order number read back."""
    out: dict[str, list[dict[str, Any]]] = {"summarize": [], "extract": [], "chat": []}
    async with client_session() as http:
        for c, conv in zip(customers(), convs):
            text = transcript(conv)
            out["summarize"].append(await call(http, base, "summarize", {"input": text}))
            out["extract"].append(await call(http, base, "extract", {"input": text}))
            ask = f"My order number is {c['order']}. Please repeat my order number back to me."
            out["chat"].append(await call(http, base, "chat", chat_body([{"role": "user", "content": ask}])))
    return out


def speed(calls: list[dict[str, Any]]) -> dict[str, Any]:
    tokens, seconds = sum(c["tokens"] for c in calls), sum(c["seconds"] for c in calls)
    return {
        "calls": len(calls),
        "generated_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": per_second(tokens, seconds),
    }


async def timed(base: str, convs: list[list[dict[str, str]]]) -> dict[str, Any]:
    """The timed workloads of one run, with every output's text."""
    copy = await copy_calls(base, convs)
    out: dict[str, Any] = {
        "copy": speed([c for calls in copy.values() for c in calls]),
        "copy_by_call": {name: speed(calls) for name, calls in copy.items()},
        "texts": {name: [c["text"] for c in calls] for name, calls in copy.items()},
    }
    progress = Progress("speculation")
    for name, texts, tokens in [
        ("single", [SINGLE_TEXT], SINGLE_TOKENS),
        ("burst-unique", BURST_TEXTS, BURST_TOKENS),
    ]:
        result = await burst(base, texts, tokens, {}, progress, unique=name == "burst-unique", keep_text=True)
        out["texts"][name] = result.pop("texts")
        out[name] = result
    return out


def run_one(
    label: str,
    env: dict[str, str],
    config: str | None,
    threads: int,
    workdir: Path,
    convs: list[list[dict[str, str]]] | None,
) -> dict[str, Any]:
    """`rtserver serve` with `env`: its conversations, then the timed workloads (on `convs` if given)."""
    settings = {"RTSERVER_MODEL_THREADS": str(threads), **BENCH_ENV, **env}
    server = ServerProcess(settings, workdir / f"rtserver-{label.replace(' ', '-')}.log", config)
    print(f"  [speculation: {label}] starting (log {server.log_path})", flush=True)
    server.start(600)
    try:
        asyncio.run(warm_up_one(server.base, {}))
        own = asyncio.run(conversations(server.base))
        result = asyncio.run(timed(server.base, convs or own))
        result["conversations"] = own
        m = server.metrics()
        result["draft_tokens"] = m.get("rtserver_draft_tokens_total", 0.0)
        result["draft_tokens_accepted"] = m.get("rtserver_draft_tokens_accepted_total", 0.0)
        result["health"] = server.health()
    finally:
        server.stop()
    return result


def compare(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """Drafts on against off: the tokens/s ratio per workload, its bar, and whether the texts are equal."""
    out: dict[str, Any] = {}
    for name, bar in BARS.items():
        r = ratio(on[name]["tokens_per_s"], off[name]["tokens_per_s"])
        out[name] = {"ratio": r, "bar": bar, "met": r is not None and r >= bar}
    out["same_text"] = {name: on["texts"][name] == off["texts"][name] for name in on["texts"]}
    out["same_conversations"] = on["conversations"] == off["conversations"]
    return out


def run_speculation_bench(threads: int, config: str | None) -> dict[str, Any]:
    """Drafts on, then off, on the configured model; their figures and the comparison."""
    with tempfile.TemporaryDirectory(prefix="rtbench-spec-") as tmp:
        runs: dict[str, Any] = {}
        first: list[list[dict[str, str]]] | None = None
        for label, env in RUNS.items():
            runs[label] = run_one(label, env, config, threads, Path(tmp), first)
            first = first or runs[label]["conversations"]
    return {"runs": runs, "compare": compare(runs["drafts on"], runs["drafts off"])}


def table_rows(spec: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(figure, value, bar) rows: each workload's tokens/s on and off, the ratio, the texts' equality."""
    runs, cmp = spec["runs"], spec["compare"]
    rows = []
    for name, bar in BARS.items():
        on, off = runs["drafts on"][name]["tokens_per_s"], runs["drafts off"][name]["tokens_per_s"]
        r = cmp[name]["ratio"]
        rows.append(
            (
                f"[speculation] {name}: tokens/s drafts on / off (ratio)",
                f"{on:.1f} / {off:.1f} ({r:.2f}x)" if r is not None else "n/a",
                f">= {bar}x",
            )
        )
    on = runs["drafts on"]
    accepted = on["draft_tokens_accepted"] / on["draft_tokens"] if on["draft_tokens"] else 0.0
    rows.append(
        (
            "[speculation] draft tokens checked / kept (drafts on)",
            f"{on['draft_tokens']:.0f} / {accepted:.0%}",
            "",
        )
    )
    differ = [name for name, same in cmp["same_text"].items() if not same]
    if not cmp["same_conversations"]:
        differ.append("conversations")
    rows.append(
        (
            "[speculation] outputs equal, drafts on and off",
            "all" if not differ else "differ: " + ", ".join(differ),
            "all",
        )
    )
    return rows
