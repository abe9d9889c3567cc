"""`rtserver loadtest --assist`: does agent assist slow the customers? First 32 chatting customers run
alone. Then the same run beside 4 agents. Each agent asks reply drafts for a live conversation every 5 s.
This runs twice, in turn: alone, beside, alone, beside.

Each phase has an `rtserver serve` of its own (the console on), started fresh. So none finds another one's
sessions in its KV cache. The report has the customers' first-token p95 of the pooled phases of each kind.
It has their ratio, overall and per round. It has the drafts' first token, seen two ways. At the agent, it
runs from the `assist` frame sent to its first streamed `assist_delta`. In the engine, it is the time to
first token of the `suggest_reply` call. Last, it has the round trip at the agent.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import secrets
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection

from .loadclient import run_chat_load
from .serverproc import ONE_ADDRESS_LIMITS_OFF, ServerProcess, raise_nofile_limit
from .stats import percentile, ratio

TURNS = 8  # a customer's turns: long enough for the drafts' p95 to mean something
ROUNDS = 2  # alone, beside, alone, beside: the customers' p95 moves between runs of the same code
THINK_S = 2.0  # between a customer's turns, so the load lasts while the agents work
MAX_NEW_TOKENS = 24


class Agent:
    """One console connection. It asks drafts for a random live conversation every `every_s`."""

    def __init__(self, url: str, token: str, name: str, every_s: float):
        self.url, self.token, self.name, self.every_s = url, token, name, every_s
        self.live: set[str] = set()  # conversations with a customer message
        self.sent: dict[str, float] = {}
        self.first_delta_s: dict[str, float] = {}
        self.results: list[dict[str, Any]] = []
        self.errors: list[str] = []

    async def run(self, stop: asyncio.Event) -> None:
        async with websockets.connect(self.url, open_timeout=60, max_size=None) as ws:
            await ws.send(json.dumps({"type": "login", "token": self.token, "agent": self.name}))
            reader = asyncio.create_task(self._read(ws))
            n = 0
            try:
                while not stop.is_set():
                    with_messages = sorted(self.live)
                    if with_messages:
                        n += 1
                        rid = f"{self.name}-{n}"
                        self.sent[rid] = time.perf_counter()
                        sid = random.choice(with_messages)
                        await ws.send(
                            json.dumps(
                                {
                                    "type": "assist",
                                    "id": rid,
                                    "session_id": sid,
                                    "task": "suggest_reply",
                                    "stream": True,
                                }
                            )
                        )
                    try:
                        await asyncio.wait_for(stop.wait(), self.every_s)
                    except TimeoutError:
                        pass
                while self.sent and len(self.results) + len(self.errors) < n:  # the last answers
                    await asyncio.sleep(0.2)
            finally:
                reader.cancel()

    async def _read(self, ws: ClientConnection) -> None:
        async for raw in ws:
            ev = json.loads(raw)
            kind = ev.get("type")
            if kind == "console_ready":
                self.live |= {c["session_id"] for c in ev["conversations"]}  # listed: it has a message
            elif kind == "message" and ev["message"]["role"] == "user":
                self.live.add(ev["session_id"])
            elif kind == "removed":
                self.live.discard(ev["session_id"])
            elif kind == "assist_delta" and ev["id"] in self.sent and ev["id"] not in self.first_delta_s:
                self.first_delta_s[ev["id"]] = time.perf_counter() - self.sent[ev["id"]]
            elif kind == "assist" and ev["id"] in self.sent:
                wall = time.perf_counter() - self.sent[ev["id"]]
                self.results.append(
                    {
                        "wall_s": wall,
                        "ttft_ms": ev["timing"].get("ttft_ms"),
                        "queued_ms": ev["timing"].get("queued_ms"),
                        "first_delta_s": self.first_delta_s.get(ev["id"]),
                    }
                )
            elif kind == "error" and ev.get("id") in self.sent:
                self.errors.append(ev["code"])


async def customers(server: ServerProcess, chatting: int, samples: list[float]) -> dict[str, Any]:
    """The customers' chat load; every turn's first-token time goes into `samples`."""
    return await run_chat_load(
        server.ws_url, chatting, turns=TURNS, max_new_tokens=MAX_NEW_TOKENS, think_s=THINK_S, samples=samples
    )


async def _with_agents(
    server: ServerProcess, token: str, chatting: int, agents: int, every_s: float, samples: list[float]
) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    """The chat load beside the agents. Returns its summary, the agents' answers and their error codes."""
    console = server.ws_url + "/console"
    crew = [Agent(console, token, f"agent{i}", every_s) for i in range(agents)]
    stop = asyncio.Event()
    running = [asyncio.create_task(a.run(stop)) for a in crew]
    try:
        chat = await customers(server, chatting, samples)
    finally:
        stop.set()
    await asyncio.gather(*running, return_exceptions=True)
    return chat, [r for a in crew for r in a.results], [e for a in crew for e in a.errors]


def draft_figures(results: list[dict[str, Any]], errors: list[str]) -> dict[str, Any]:
    """The drafts' figures. First token in the engine and at the agent, queueing, and round trip."""
    ttfts = [r["ttft_ms"] for r in results if r["ttft_ms"] is not None]
    at_agent = [1000 * r["first_delta_s"] for r in results if r["first_delta_s"] is not None]
    queued = [r["queued_ms"] for r in results if r["queued_ms"] is not None]
    return {
        "drafts": len(results),
        "draft_errors": errors,
        "draft_first_token_p50_ms": percentile(ttfts, 0.5),
        "draft_first_token_p95_ms": percentile(ttfts, 0.95),
        "draft_queued_p95_ms": percentile(queued, 0.95),
        "draft_first_token_at_agent_p50_ms": percentile(at_agent, 0.5),
        "draft_first_token_at_agent_p95_ms": percentile(at_agent, 0.95),
        "draft_first_token_at_agent_ms": sorted(round(t) for t in at_agent),
        "draft_round_trip_p95_s": percentile([r["wall_s"] for r in results], 0.95),
    }


def priority_figures(server: ServerProcess) -> dict[str, dict[str, float]]:
    """Per priority, from /metrics: generations that produced a token. Also mean seconds queued and to the
    first token. This is the engine's own view, since the server started.
    """
    with urllib.request.urlopen(server.base + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    got: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = re.match(
            r'rtserver_priority_(queue|first_token)_seconds_(sum|count)\{priority="(\w+)"\} (\S+)', line
        )
        if m:
            got.setdefault(m[3], {})[f"{m[1]}_{m[2]}"] = float(m[4])
    return {
        p: {
            "started": f.get("queue_count", 0.0),
            "queued_mean_ms": 1000 * f.get("queue_sum", 0.0) / max(f.get("queue_count", 0.0), 1.0),
            "first_token_mean_ms": 1000
            * f.get("first_token_sum", 0.0)
            / max(f.get("first_token_count", 0.0), 1.0),
        }
        for p, f in got.items()
    }


def _phase(
    server: ServerProcess,
    chatting: int,
    crew: tuple[str, int, float] | None,
    samples: list[float],
    results: list[dict[str, Any]],
    errors: list[str],
) -> dict[str, Any]:
    """One round's customers, alone or beside the agents. `crew` holds the console token, agents, and
    seconds between drafts. Their answers and errors are added to `results` and `errors`.
    """
    if crew is None:
        chat = asyncio.run(customers(server, chatting, samples))
    else:
        token, agents, every_s = crew
        chat, found, failed = asyncio.run(_with_agents(server, token, chatting, agents, every_s, samples))
        results += found
        errors += failed
    return {
        "ttft_p95_ms": chat["ttft_p95_ms"],
        "ttft_p50_ms": chat["ttft_p50_ms"],
        "errors": chat["errors"],
        "engine_by_priority": priority_figures(server),
    }


def run_assist_loadtest(
    chatting: int = 32,
    agents: int = 4,
    every_s: float = 5.0,
    config: str | None = None,
    dtype: str | None = None,
    rounds: int = ROUNDS,
) -> dict[str, Any]:
    raise_nofile_limit()
    workdir = Path(tempfile.mkdtemp(prefix="rtserver-assistload-"))
    token = secrets.token_urlsafe(16)
    env = {
        "RTSERVER_SERVER_LOG_LEVEL": "warning",
        "RTSERVER_SECURITY_CONSOLE_TOKEN": token,
        **ONE_ADDRESS_LIMITS_OFF,
    }
    if dtype:
        env["RTSERVER_MODEL_DTYPE"] = dtype
    pooled: dict[str, list[float]] = {"alone": [], "beside": []}
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    per_round: list[dict[str, Any]] = []
    ready: list[float] = []
    for r in range(rounds):
        row: dict[str, Any] = {}
        for phase in ("alone", "beside"):
            server = ServerProcess(env, workdir / f"{phase}-{r + 1}.log", config)
            print(f"round {r + 1}, {phase}: server starting ({server.log_path})", flush=True)
            ready.append(server.start())
            samples: list[float] = []
            try:
                crew = (token, agents, every_s) if phase == "beside" else None
                row[phase] = _phase(server, chatting, crew, samples, results, errors)
            finally:
                server.stop()
            pooled[phase] += samples
        row["ttft_p95_ratio"] = ratio(row["beside"]["ttft_p95_ms"], row["alone"]["ttft_p95_ms"])
        per_round.append(row)
    alone, beside = (percentile(pooled[k], 0.95) for k in ("alone", "beside"))
    return {
        "command": f"rtserver loadtest --assist --chatting {chatting}"
        + (f" --dtype {dtype}" if dtype else ""),
        "server_ready_s": round(max(ready), 1),
        "customers": chatting,
        "turns": TURNS,
        "agents": agents,
        "assist_every_s": every_s,
        "rounds": rounds,
        "ttft_p95_ms_alone": alone,
        "ttft_p95_ms_with_agents": beside,
        "ttft_p95_ratio": ratio(beside, alone),
        "ttft_p50_ms_alone": percentile(pooled["alone"], 0.5),
        "ttft_p50_ms_with_agents": percentile(pooled["beside"], 0.5),
        "per_round": per_round,
        **draft_figures(results, errors),
    }
