"""`rtserver bench --workloads servers`: `llama-server` and a real `rtserver serve`, one at a time.

Both get the same OpenAI streaming clients on the burst, single and arrival workloads, greedy with
`ignore_eos`, after an untimed warm-up; their peak RSS is followed from the start. Burst and arrival run
on two prompt sets: the chat template's shared system prompt, and unique prefixes (every request its
own system message, so no server can share a prefix between requests). llama-server keeps its default
`cache_prompt` (a slot reuses its own earlier prompt) and runs the embedded GGUF as shipped, with one
slot more than the 32 burst streams so that an arrival does not queue.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

from .openai_client import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    StreamResult,
    chat_body,
    client_session,
    completion_body,
    completion_prompt,
    stream_chat,
)
from .serverproc import ONE_ADDRESS_LIMITS_OFF, LlamaServerProcess, ServerProcess
from .stats import mean, median, per_second, percentile, ratio

BURST_TEXTS = [f"Tell me a short fact about the number {i}." for i in range(32)]
SINGLE_TEXT = "Write a short story about a robot who learns to paint."
WARM_UP_TEXTS = [f"Say hello to visitor number {i}." for i in range(32)]  # no timed prompt's words
BURST_TOKENS, SINGLE_TOKENS = 64, 128
BACKGROUND_TOKENS = 200  # fits a llama-server slot of 256 tokens with the ~42-token prompt
ARRIVAL_TOKENS = 2
UNIQUE_SYSTEM = "Conversation {i:03d}. You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# workload -> (what runs, whether every request gets its own system message)
WORKLOADS = {
    "burst": ("burst", False),
    "burst-unique": ("burst", True),
    "single": ("single", False),
    "arrival": ("arrival", False),
    "arrival-unique": ("arrival", True),
}
SERVER_WORKLOADS = tuple(WORKLOADS)
PROMPT_SETS = {
    "shared": "burst, arrival: the chat template's default system prompt on every request",
    "unique": "burst-unique, arrival-unique: request i has the system message " + repr(UNIQUE_SYSTEM),
}
LLAMA_SLOTS, LLAMA_CTX_PER_SLOT = 33, 256


class Prompts:
    """How a workload's texts become requests: chat messages through the model's chat template, or,
    for a base model (`completion`), plain-text completions of a question and answer."""

    def __init__(self, completion: bool = False):
        self.completion = completion
        self.path = COMPLETIONS_PATH if completion else CHAT_PATH

    def body(self, text: str, tokens: int, extra: dict, system: str | None = None) -> dict:
        if not self.completion:
            return chat_body(text, tokens, extra, system)
        return completion_body(completion_prompt(text, system), tokens, extra)


CHAT = Prompts()


def systems(count: int, unique: bool, first: int = 0) -> list[str | None]:
    """The system message of each of `count` requests: its own numbered one, or the template's default."""
    return [UNIQUE_SYSTEM.format(i=first + i) if unique else None for i in range(count)]


# -- figures (pure) -----------------------------------------------------------------------------


def burst_summary(results: list[StreamResult], asked: int, wall_s: float) -> dict:
    """A burst's figures: tokens/s over the wall time (prefill included), TTFT from submission, and
    whether every reply had exactly the `asked` number of tokens."""
    ttfts = [r.ttft_ms for r in results if r.ttft_ms is not None]
    tokens = sum(r.tokens for r in results)
    return {
        "requests": len(results),
        "generated_tokens": tokens,
        "asked_tokens": asked * len(results),
        "exact_token_counts": all(r.tokens == asked for r in results),
        "wall_s": wall_s,
        "tokens_per_s": per_second(tokens, wall_s),
        "ttft_p50_ms": percentile(ttfts, 0.5),
        "ttft_p95_ms": percentile(ttfts, 0.95),
        "prompt_tokens_mean": mean(r.prompt_tokens for r in results if r.prompt_tokens is not None),
    }


def step_gaps_ms(chunk_times: list[list[float]], start: float, end: float) -> list[float]:
    """The gaps between consecutive tokens of each stream, for tokens that arrived in [start, end]."""
    gaps = []
    for times in chunk_times:
        inside = [t for t in times if start <= t <= end]
        gaps += [(b - a) * 1000 for a, b in zip(inside, inside[1:])]
    return gaps


def arrival_summary(
    ttfts: list[float], exact: bool, decode_step_ms: float | None, background: int, restarts: int
) -> dict:
    p95 = percentile(ttfts, 0.95)
    return {
        "arrivals": len(ttfts),
        "background_streams": background,
        "background_restarts": restarts,  # background streams that ended and were sent again
        "exact_token_counts": exact,
        "ttft_p50_ms": percentile(ttfts, 0.5),
        "ttft_p95_ms": p95,
        "ttft_max_ms": max(ttfts, default=None),
        "decode_step_ms": decode_step_ms,
        "ttft_p95_in_steps": ratio(p95, decode_step_ms),
    }


# -- progress -----------------------------------------------------------------------------------


class Progress:
    """Prints which system and workload run and, every `every_s`, how many tokens have streamed."""

    def __init__(self, label: str, every_s: float = 5.0, out: Callable[[str], None] = print):
        self.label, self.every_s, self.out = label, every_s, out
        self.tokens = 0

    def count(self) -> None:
        self.tokens += 1

    @contextmanager
    def phase(self, what: str, expected_tokens: int | None = None) -> Iterator[None]:
        self.tokens = 0
        self.out(f"  [{self.label}] {what} ...")
        loop = asyncio.get_running_loop()
        started = time.perf_counter()

        def tick() -> None:
            of = f"/{expected_tokens}" if expected_tokens else ""
            self.out(
                f"  [{self.label}] {what}: {self.tokens}{of} tokens, {time.perf_counter() - started:.0f} s"
            )
            handle[0] = loop.call_later(self.every_s, tick)

        handle = [loop.call_later(self.every_s, tick)]
        try:
            yield
        finally:
            handle[0].cancel()
            self.out(f"  [{self.label}] {what}: done in {time.perf_counter() - started:.1f} s")


# -- workloads against one server ----------------------------------------------------------------


async def burst(
    base: str,
    texts: list[str],
    new_tokens: int,
    extra: dict,
    progress: Progress,
    prompts: Prompts = CHAT,
    unique: bool = False,
) -> dict:
    bodies = [prompts.body(t, new_tokens, extra, s) for t, s in zip(texts, systems(len(texts), unique))]
    async with client_session() as http:
        started = time.perf_counter()
        results = await asyncio.gather(
            *(stream_chat(http, base, b, progress.count, prompts.path) for b in bodies)
        )
        wall = time.perf_counter() - started
    return burst_summary(list(results), new_tokens, wall)


async def arrival(
    base: str, count: int, extra: dict, progress: Progress, prompts: Prompts = CHAT, unique: bool = False
) -> dict:
    """TTFT of `count` new requests sent one after another while the 32 burst streams decode. A
    background stream that ends is sent again, so 32 decode throughout however slowly a server admits
    them. With `unique`, every background stream and every arrival has its own system message."""
    chunk_times: list[list[float]] = [[] for _ in BURST_TEXTS]
    backgrounds = systems(len(BURST_TEXTS), unique)
    arrivals = systems(count, unique, first=len(BURST_TEXTS))

    def recorder(i: int) -> Callable[[], None]:
        def record() -> None:
            chunk_times[i].append(time.perf_counter())
            progress.count()

        return record

    restarts = [0]

    async def keep_streaming(http: aiohttp.ClientSession, i: int, body: dict) -> None:
        while True:
            await stream_chat(http, base, body, recorder(i), prompts.path)
            restarts[0] += 1

    async with client_session() as http:
        background = [
            asyncio.ensure_future(
                keep_streaming(http, i, prompts.body(t, BACKGROUND_TOKENS, extra, backgrounds[i]))
            )
            for i, t in enumerate(BURST_TEXTS)
        ]
        try:
            while not all(chunk_times):  # every background stream decodes
                for task in background:
                    if task.done():
                        task.result()  # a stream failed: its error
                await asyncio.sleep(0.01)
            window_start = time.perf_counter()
            ttfts, exact = [], True
            for system in arrivals:
                body = prompts.body(SINGLE_TEXT, ARRIVAL_TOKENS, extra, system)
                r = await stream_chat(http, base, body, None, prompts.path)
                if r.ttft_ms is not None:
                    ttfts.append(r.ttft_ms)
                exact = exact and r.tokens == ARRIVAL_TOKENS
            window_end = time.perf_counter()
        finally:
            for task in background:
                task.cancel()  # closes the connection: the server stops that stream
            await asyncio.gather(*background, return_exceptions=True)
    step = median(step_gaps_ms(chunk_times, window_start, window_end))
    return arrival_summary(ttfts, exact, step, len(BURST_TEXTS), restarts[0])


async def warm_up(base: str, extra: dict, prompts: Prompts = CHAT) -> None:
    """Untimed: a batch as wide as the burst (whatever is built per batch size is built) and one lone
    request, on messages no timed request uses."""
    async with client_session() as http:
        await asyncio.gather(
            *(stream_chat(http, base, prompts.body(t, 4, extra), None, prompts.path) for t in WARM_UP_TEXTS)
        )
        await stream_chat(http, base, prompts.body(WARM_UP_TEXTS[0], 8, extra), None, prompts.path)


async def run_workloads(
    base: str,
    workloads: list[str] | tuple[str, ...],
    extra: dict,
    progress: Progress,
    arrivals: int = 20,
    prompts: Prompts = CHAT,
) -> dict:
    """The asked workloads, in SERVER_WORKLOADS' order, after the warm-up."""
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"unknown server workloads {sorted(unknown)} (known: {', '.join(WORKLOADS)})")
    out: dict[str, Any] = {}
    with progress.phase("warm-up"):
        await warm_up(base, extra, prompts)
    for name in (w for w in SERVER_WORKLOADS if w in workloads):
        kind, unique = WORKLOADS[name]
        if kind == "burst":
            with progress.phase(
                f"{name}: {len(BURST_TEXTS)} x {BURST_TOKENS} tokens", len(BURST_TEXTS) * BURST_TOKENS
            ):
                out[name] = await burst(base, BURST_TEXTS, BURST_TOKENS, extra, progress, prompts, unique)
        elif kind == "single":
            with progress.phase(f"{name}: 1 x {SINGLE_TOKENS} tokens", SINGLE_TOKENS):
                out[name] = await burst(base, [SINGLE_TEXT], SINGLE_TOKENS, extra, progress, prompts)
        else:
            with progress.phase(f"{name}: {arrivals} new requests while {len(BURST_TEXTS)} streams decode"):
                out[name] = await arrival(base, arrivals, extra, progress, prompts, unique)
    return out


# -- the two servers ------------------------------------------------------------------------------


def run_llama_server(
    binary: Path,
    model: Path,
    threads: int,
    workloads: list[str] | tuple[str, ...],
    workdir: Path,
    arrivals: int = 20,
    prompts: Prompts = CHAT,
) -> dict:
    """llama-server on `model` with its default `cache_prompt`, through the asked workloads."""
    llama = LlamaServerProcess(
        binary,
        model,
        workdir / "llama-server.log",
        slots=LLAMA_SLOTS,
        ctx=LLAMA_SLOTS * LLAMA_CTX_PER_SLOT,
        threads=threads,
    )
    label = "llama-server"
    print(f"  [{label}] starting ({' '.join(llama.cmd[1:])}; log {llama.log_path})", flush=True)
    ready_s = llama.start()
    try:
        result = asyncio.run(run_workloads(llama.base, workloads, {}, Progress(label), arrivals, prompts))
        llama.rss.sample()
        result |= llama.rss.figures()
    finally:
        llama.stop()
    return {
        "system": "llama-server",
        "args": llama.cmd[1:],
        "cache_prompt": "default",
        "ready_s": ready_s,
        **result,
    }


def run_rtserver(
    dtype: str,
    threads: int,
    config: str | None,
    workloads: list[str] | tuple[str, ...],
    workdir: Path,
    arrivals: int = 20,
    model: str | None = None,
    prompts: Prompts = CHAT,
    timeout_s: float = 600,
    kv_budget_mb: float | None = None,
) -> dict:
    """`rtserver serve` with `dtype` (and `model`, else the configured one; `kv_budget_mb`, else the
    configured budget) through the asked workloads."""
    model_env = {"RTSERVER_MODEL_MODEL": model} if model else {}
    if kv_budget_mb is not None:
        model_env["RTSERVER_ENGINE_KV_BUDGET_MB"] = str(int(kv_budget_mb))
    server = ServerProcess(
        {
            "RTSERVER_MODEL_DTYPE": dtype,
            "RTSERVER_MODEL_THREADS": str(threads),
            "RTSERVER_TASKS_AUTO_TASKS": "",
            "RTSERVER_TASKS_FIT_HEADS_IN_BACKGROUND": "false",  # no fit competing with the figures
            "RTSERVER_SERVER_LOG_LEVEL": "warning",
            # the API may hold all of the KV: no chat door shares it here
            "RTSERVER_SECURITY_API_KV_SHARE": "1",
            **ONE_ADDRESS_LIMITS_OFF,
            **model_env,
        },
        workdir / f"rtserver-{dtype}.log",
        config,
    )
    label = f"rtserver {dtype}"
    print(f"  [{label}] starting (log {server.log_path})", flush=True)
    ready_s = server.start(timeout_s)  # a loaded machine reads the weights slowly (seen: 300 s)
    try:
        result = asyncio.run(run_workloads(server.base, workloads, {}, Progress(label), arrivals, prompts))
        server.rss.sample()
        result |= server.rss.figures()
        result["health"] = server.health()
    finally:
        server.stop()
    return {
        "system": "rtserver",
        "dtype": dtype,
        "runs_as": runs_as(dtype, model or "embedded"),
        "ready_s": ready_s,
        **result,
    }


def runs_as(dtype: str, model: str = "embedded") -> str:
    """What a dtype setting means for the model on this CPU (`auto` chooses per model and CPU): the
    server process, on the same machine, resolves it the same way."""
    from ..engine.model import effective_dtype

    return effective_dtype(dtype, model)


def run_servers_bench(
    dtypes: list[str],
    threads: int,
    config: str | None = None,
    workloads: list[str] | None = None,
    arrivals: int = 20,
    llama_binary: Path | None = None,
    workdir: Path | None = None,
) -> dict:
    """llama-server, then `rtserver serve` with each of `dtypes`; one system at a time, each on both
    prompt sets."""
    from ..engine.model import embedded_model_path
    from .llama_build import build

    workloads = list(workloads or SERVER_WORKLOADS)
    workdir = workdir or Path(tempfile.mkdtemp(prefix="rtserver-servers-bench-"))
    binary = llama_binary or build()
    systems = {
        "llama-server": run_llama_server(binary, embedded_model_path(), threads, workloads, workdir, arrivals)
    }
    for dtype in dtypes:
        systems[f"rtserver-{dtype}"] = run_rtserver(dtype, threads, config, workloads, workdir, arrivals)
    return {"threads": threads, "workloads": workloads, "prompt_sets": PROMPT_SETS, "systems": systems}


def ratio_key(workload: str, figure: str) -> str:
    return f"{workload.replace('-', '_')}_{figure}"


def ratios(systems: dict, reference: str = "llama-server") -> dict:
    """Each rtserver system's figures divided by the reference's: tokens/s (higher is better) and TTFT
    p95 (lower is better), on both prompt sets."""
    ref = systems.get(reference, {})
    out: dict[str, dict] = {}
    for name, s in systems.items():
        if name == reference:
            continue
        out[name] = {
            ratio_key(w, "tokens_per_s"): ratio(
                s.get(w, {}).get("tokens_per_s"), ref.get(w, {}).get("tokens_per_s")
            )
            for w in ("burst", "burst-unique", "single")
        } | {
            ratio_key(w, "ttft_p95"): ratio(
                s.get(w, {}).get("ttft_p95_ms"), ref.get(w, {}).get("ttft_p95_ms")
            )
            for w in ("burst", "burst-unique", "arrival", "arrival-unique")
        }
    return out


def fmt(v: float | None, unit: str = "") -> str:
    return "n/a" if v is None else f"{v:,.1f}{unit}"


def times(v: float | None) -> str:
    """A ratio to two decimals: the bars sit at 0.5x and 1.5x."""
    return "n/a" if v is None else f"{v:.2f}x"


def table_rows(servers: dict) -> list[tuple[str, str, str]]:
    """(figure, value, bar) rows of the servers comparison for the bench's printed table, each prompt
    set's row beside the other's; the shared set's bars are issue 12's, the unique set's issue 25's."""
    systems = servers.get("systems", {})

    def exact(r: dict) -> str:
        return "exact" if r.get("exact_token_counts") else "NOT exact"

    rows: list[tuple[str, str, str]] = []
    for name, s in systems.items():
        rtserver = name != "llama-server"
        for w in ("burst", "burst-unique", "single"):
            r = s.get(w)
            if r:
                rows.append(
                    (
                        f"[servers] {name} {w} tokens/s; TTFT p50 / p95 ms",
                        f"{fmt(r['tokens_per_s'])} ({exact(r)}); "
                        f"{fmt(r['ttft_p50_ms'])} / {fmt(r['ttft_p95_ms'])}",
                        "TTFT p95 <= 1000" if rtserver and w.startswith("burst") else "",
                    )
                )
        for w in ("arrival", "arrival-unique"):
            a = s.get(w)
            if a:
                rows.append(
                    (
                        f"[servers] {name} {w} TTFT p50 / p95 ms; decode step ms; p95 in steps",
                        f"{fmt(a['ttft_p50_ms'])} / {fmt(a['ttft_p95_ms'])}; {fmt(a['decode_step_ms'])}; "
                        f"{fmt(a['ttft_p95_in_steps'], 'x')}"
                        + (
                            f" ({a['background_restarts']} background streams sent again)"
                            if a.get("background_restarts")
                            else ""
                        ),
                        "<= 1.5x" if rtserver else "",
                    )
                )
        rows.append(
            (f"[servers] {name} peak RSS MB", fmt(s.get("peak_rss_mb")), "<= 1536" if rtserver else "")
        )
    unique_ran = any("burst-unique" in s for s in systems.values())
    for name, r in ratios(systems).items():
        rows.append(
            (
                f"[servers] {name} / llama-server: burst tokens/s, single tokens/s",
                f"{fmt(r['burst_tokens_per_s'], 'x')}, {fmt(r['single_tokens_per_s'], 'x')}",
                ">= 2.5x, >= 1.0x",
            )
        )
        rows.append(
            (
                f"[servers] {name} / llama-server: burst TTFT p95, arrival TTFT p95",
                f"{fmt(r['burst_ttft_p95'], 'x')}, {fmt(r['arrival_ttft_p95'], 'x')}",
                "",
            )
        )
        if unique_ran:
            rows.append(
                (
                    f"[servers] {name} / llama-server, unique prefixes: burst tokens/s; burst TTFT p95, "
                    "arrival TTFT p95",
                    f"{times(r['burst_unique_tokens_per_s'])}; {times(r['burst_unique_ttft_p95'])}, "
                    f"{times(r['arrival_unique_ttft_p95'])}",
                    ">= 1.5x; <= 0.5x",
                )
            )
    return rows
