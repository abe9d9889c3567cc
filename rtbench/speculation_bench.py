"""`rtserver bench --workloads speculation`: one `rtserver serve` config with drafts on, then off.

Prompt-lookup speculation (rtserver/engine/speculation.py) pays where a reply copies from its prompt.
The same server runs twice: drafting as configured, then with `engine.speculate_max_live = 0`. Each
run holds 20 support conversations over `/ws` (two customer turns each, greedy, untimed: the warm-up).
Then come, timed, one call at a time:
- copy: an agent's `summarize` and `extract` on each conversation over `/console` (the copilot), and
  a third customer turn asking for the order number back;
- single: the story of WORKLOADS.md (nothing to copy), greedy, 128 tokens;
- burst-unique: 32 streams at once, 64 tokens each (above the threshold, so nothing is drafted).
Tokens come from the server's own count (`rtserver_tokens_generated` before and after each call).
Every output must be the same text in both runs.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection

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
from .wsclient import connect, hello, recv

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
ASK_BACK = "Please read my order number back to me, so I know you have it right."
RUNS = {"drafts on": {}, "drafts off": {"RTSERVER_ENGINE_SPECULATE_MAX_LIVE": "0"}}
BARS = {"copy": 1.5, "single": 0.97, "burst-unique": 0.98}  # drafts on / off, tokens per second
TOKENS = "rtserver_tokens_generated_total"
WAIT_S = 300.0  # the longest wait for a call's answer: a summary on a slow machine


def customers(count: int = 20) -> list[dict[str, str]]:
    """The conversations' customers: a name, an order number, a product, an issue and an e-mail."""
    out = []
    for i in range(count):
        first, last = NAMES[i % len(NAMES)].split()
        out.append(
            {
                "name": f"{first} {last}",
                "order": f"{'ABCDEFGH'[i % 8]}{'KMPRTX'[i % 6]}-{48213 + 977 * i:05d}",
                "product": PRODUCTS[i % len(PRODUCTS)],
                "issue": ISSUES[i % len(ISSUES)],
                "email": f"{first.lower()}.{last.lower()}{i}@example.com",
            }
        )
    return out


def customer_turns(c: dict[str, str]) -> list[str]:
    """What the customer writes before the timed turn."""
    return [
        f"Hi, this is {c['name']}. My order {c['order']} for {c['product']} {c['issue']}.",
        f"The order number is {c['order']} and my e-mail is {c['email']}. Can you check it for me?",
    ]


class Customer:
    """One customer's `/ws` session, kept open for the run."""

    def __init__(self, ws: ClientConnection, session_id: str):
        self.ws, self.session_id = ws, session_id

    @classmethod
    async def open(cls, url: str) -> Customer:
        ws = await connect(url)
        ev = await hello(ws, "bench")
        if ev["type"] == "error":
            raise RuntimeError(f"/ws refused the customer: {ev}")
        return cls(ws, ev["session_id"])

    async def say(self, text: str) -> tuple[str, float | None]:
        """One greedy turn; the bot's reply and the server's time to its first token (ms)."""
        options = {"max_new_tokens": CHAT_TOKENS, "temperature": 0}
        await self.ws.send(json.dumps({"type": "chat", "id": "t", "text": text, "options": options}))
        while True:
            ev = await recv(self.ws, WAIT_S)
            if ev.get("id") != "t" or ev.get("auto"):
                continue
            if ev["type"] == "done":
                return str(ev["text"]), ev["timing"].get("ttft_ms")
            if ev["type"] == "error":
                raise RuntimeError(f"chat turn failed: {ev}")


class Agent:
    """One console login: the copilot tasks on a conversation, one call at a time."""

    def __init__(self, ws: ClientConnection):
        self.ws, self.calls = ws, 0

    @classmethod
    async def open(cls, url: str, token: str) -> Agent:
        ws = await connect(url)
        await ws.send(json.dumps({"type": "login", "token": token, "agent": "bench"}))
        while (ev := await recv(ws, WAIT_S))["type"] != "console_ready":
            if ev["type"] == "error":
                raise RuntimeError(f"/console refused the agent: {ev}")
        return cls(ws)

    async def assist(self, session_id: str, task: str) -> tuple[str, float | None]:
        self.calls += 1
        rid = f"a{self.calls}"
        await self.ws.send(json.dumps({"type": "assist", "id": rid, "session_id": session_id, "task": task}))
        while True:
            ev = await recv(self.ws, WAIT_S)
            if ev.get("id") != rid:
                continue
            if ev["type"] == "assist":
                return str(ev["text"]), ev["timing"].get("ttft_ms")
            if ev["type"] == "error":
                raise RuntimeError(f"{task} failed: {ev}")


async def timed(server: ServerProcess, run: Awaitable[tuple[str, float | None]]) -> dict[str, Any]:
    """One call, alone on the server: its text, the server's generated tokens, the seconds, and the
    server's time to first token (the prompt's share)."""
    before = server.metrics().get(TOKENS, 0.0)
    started = time.perf_counter()
    text, ttft_ms = await run
    seconds = time.perf_counter() - started
    tokens = server.metrics().get(TOKENS, 0.0) - before
    return {"text": text, "tokens": tokens, "seconds": seconds, "ttft_s": (ttft_ms or 0.0) / 1000}


async def copy_workload(
    server: ServerProcess, token: str
) -> tuple[list[list[str]], dict[str, list[dict[str, Any]]]]:
    """The conversations (untimed), then the copy-heavy calls, one at a time."""
    who = customers()
    people = [await Customer.open(server.ws_url) for _ in who]
    agent = await Agent.open(server.ws_url + "/console", token)
    conversations: list[list[str]] = []
    calls: dict[str, list[dict[str, Any]]] = {"summarize": [], "extract": [], "chat": []}
    try:
        for person, c in zip(people, who):
            conversations.append([(await person.say(text))[0] for text in customer_turns(c)])
        for person in people:
            for task in ("summarize", "extract"):
                calls[task].append(await timed(server, agent.assist(person.session_id, task)))
            calls["chat"].append(await timed(server, person.say(ASK_BACK)))
    finally:
        for ws in [p.ws for p in people] + [agent.ws]:
            await ws.close()
    return conversations, calls


def speed(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """Calls' tokens per second of wall time, and the share of it before their first tokens."""
    tokens, seconds = sum(c["tokens"] for c in calls), sum(c["seconds"] for c in calls)
    first = sum(c["ttft_s"] for c in calls)
    return {
        "calls": len(calls),
        "generated_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": per_second(tokens, seconds),
        "first_token_share": first / seconds if seconds else None,
    }


def run_one(
    label: str, env: dict[str, str], config: str | None, threads: int, workdir: Path
) -> dict[str, Any]:
    """`rtserver serve` with `env` through the workloads."""
    token = secrets.token_urlsafe(16)
    settings = {
        "RTSERVER_MODEL_THREADS": str(threads),
        **BENCH_ENV,
        "RTSERVER_SECURITY_CONSOLE_TOKEN": token,
        **env,
    }
    server = ServerProcess(settings, workdir / f"rtserver-{label.replace(' ', '-')}.log", config)
    print(f"  [speculation: {label}] starting (log {server.log_path})", flush=True)
    server.start(600)
    try:
        asyncio.run(warm_up_one(server.base, {}))
        conversations, copy = asyncio.run(copy_workload(server, token))
        result: dict[str, Any] = {
            "copy": speed([c for calls in copy.values() for c in calls]),
            "copy_by_call": {name: speed(calls) for name, calls in copy.items()},
            "texts": {name: [c["text"] for c in calls] for name, calls in copy.items()},
            "conversations": conversations,
        }
        progress = Progress(f"speculation: {label}")
        for name, texts, tokens in [
            ("single", [SINGLE_TEXT], SINGLE_TOKENS),
            ("burst-unique", BURST_TEXTS, BURST_TOKENS),
        ]:
            unique = name == "burst-unique"
            figures = asyncio.run(
                burst(server.base, texts, tokens, {}, progress, unique=unique, keep_text=True)
            )
            result["texts"][name] = figures.pop("texts")
            result[name] = figures
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
        runs = {label: run_one(label, env, config, threads, Path(tmp)) for label, env in RUNS.items()}
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
    by = {
        name: ratio(runs["drafts on"]["copy_by_call"][name]["tokens_per_s"], v["tokens_per_s"])
        for name, v in runs["drafts off"]["copy_by_call"].items()
    }
    share = runs["drafts off"]["copy"]["first_token_share"]
    rows.append(
        (
            "[speculation] copy by call: ratio (share of drafts-off time before the first token)",
            ", ".join(f"{name} {r:.2f}x" for name, r in by.items() if r is not None)
            + (f" ({share:.0%})" if share is not None else ""),
            "",
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
