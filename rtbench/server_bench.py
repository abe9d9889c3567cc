"""`rtserver bench --workloads servers`: `llama-server` and a real `rtserver serve`, one at a time.

Both get the same OpenAI streaming clients on the burst, single and arrival workloads, greedy with
`ignore_eos`, after an untimed warm-up: one request, then a batch as wide as the burst (`single-first`
runs between the two: the state of a server that has one customer at a time). Their peak RSS is
followed from the start, and rtserver's KV bytes in use through its /metrics. A refused or failed
request counts in its workload's `errors`; a workload that fails as a whole is that workload's
`error`, and the others still run. Burst and arrival run on two prompt sets: the chat template's
shared system prompt, and unique prefixes (every request its own system message, so no server can
share a prefix between requests). llama-server keeps its default `cache_prompt` (a slot reuses its
own earlier prompt) and runs the embedded GGUF as shipped, with one slot more than the 32 burst
streams so that an arrival does not queue.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
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
# workload -> (what runs, whether every request gets its own system message), in the order they run;
# `single-first` runs before the warm-up's wide batch, `single` after the bursts
WORKLOADS = {
    "single-first": ("single", False),
    "burst": ("burst", False),
    "burst-unique": ("burst", True),
    "single": ("single", False),
    "arrival": ("arrival", False),
    "arrival-unique": ("arrival", True),
}
SERVER_WORKLOADS = ("burst", "burst-unique", "single", "arrival", "arrival-unique")  # `servers`' own
ERROR_SAMPLES = 3  # distinct error messages kept per workload
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

    def body(
        self, text: str, tokens: int, extra: dict[str, Any], system: str | None = None
    ) -> dict[str, Any]:
        if not self.completion:
            return chat_body(text, tokens, extra, system)
        return completion_body(completion_prompt(text, system), tokens, extra)


CHAT = Prompts()


def systems(count: int, unique: bool, first: int = 0) -> list[str | None]:
    """The system message of each of `count` requests: its own numbered one, or the template's default."""
    return [UNIQUE_SYSTEM.format(i=first + i) if unique else None for i in range(count)]


# -- figures (pure) -----------------------------------------------------------------------------


def burst_summary(
    results: list[StreamResult], asked: int, wall_s: float, errors: list[str] | None = None
) -> dict[str, Any]:
    """A burst's figures: tokens/s over the wall time (prefill included), TTFT from submission, and
    whether every request was answered with exactly the `asked` number of tokens; `errors`: the
    messages of the requests refused or failed (their tokens count as none)."""
    errors = errors or []
    ttfts = [r.ttft_ms for r in results if r.ttft_ms is not None]
    tokens = sum(r.tokens for r in results)
    return {
        "requests": len(results) + len(errors),
        "errors": len(errors),
        "error_samples": list(dict.fromkeys(errors))[:ERROR_SAMPLES],
        "generated_tokens": tokens,
        "asked_tokens": asked * (len(results) + len(errors)),
        "exact_token_counts": not errors and all(r.tokens == asked for r in results),
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
) -> dict[str, Any]:
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
    extra: dict[str, Any],
    progress: Progress,
    prompts: Prompts = CHAT,
    unique: bool = False,
    keep_text: bool = False,
) -> dict[str, Any]:
    """`texts` at once; the burst's figures (`keep_text`: and each reply's text, under "texts")."""
    bodies = [prompts.body(t, new_tokens, extra, s) for t, s in zip(texts, systems(len(texts), unique))]
    async with client_session() as http:
        started = time.perf_counter()
        outcomes = await asyncio.gather(
            *(stream_chat(http, base, b, progress.count, prompts.path) for b in bodies),
            return_exceptions=True,
        )
        wall = time.perf_counter() - started
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
            raise outcome  # cancelled or interrupted: not a server's answer
    results = [o for o in outcomes if isinstance(o, StreamResult)]
    errors = [f"{type(o).__name__}: {o}" for o in outcomes if isinstance(o, Exception)]
    summary = burst_summary(results, new_tokens, wall, errors)
    if keep_text:
        summary["texts"] = [o.text if isinstance(o, StreamResult) else None for o in outcomes]
    return summary


async def arrival(
    base: str,
    count: int,
    extra: dict[str, Any],
    progress: Progress,
    prompts: Prompts = CHAT,
    unique: bool = False,
) -> dict[str, Any]:
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

    async def keep_streaming(http: aiohttp.ClientSession, i: int, body: dict[str, Any]) -> None:
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


async def warm_up_one(base: str, extra: dict[str, Any], prompts: Prompts = CHAT) -> None:
    """Untimed: one lone request, on a message no timed request uses."""
    async with client_session() as http:
        await stream_chat(http, base, prompts.body(WARM_UP_TEXTS[0], 8, extra), None, prompts.path)


async def warm_up_wide(base: str, extra: dict[str, Any], prompts: Prompts = CHAT) -> None:
    """Untimed: a batch as wide as the burst (whatever is built per batch size is built), on messages no
    timed request uses."""
    async with client_session() as http:
        await asyncio.gather(
            *(stream_chat(http, base, prompts.body(t, 4, extra), None, prompts.path) for t in WARM_UP_TEXTS)
        )


async def run_workloads(
    base: str,
    workloads: list[str] | tuple[str, ...],
    extra: dict[str, Any],
    progress: Progress,
    arrivals: int = 20,
    prompts: Prompts = CHAT,
) -> dict[str, Any]:
    """The asked workloads in WORKLOADS' order: one warm-up request, `single-first`, the warm-up's
    wide batch, the rest. A workload that fails as a whole is its `error`; the next one still runs."""
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"unknown server workloads {sorted(unknown)} (known: {', '.join(WORKLOADS)})")
    out: dict[str, Any] = {}
    with progress.phase("warm-up: one request"):
        await warm_up_one(base, extra, prompts)
    wide = False
    for name in (w for w in WORKLOADS if w in workloads):
        if name != "single-first" and not wide:
            with progress.phase(f"warm-up: {len(WARM_UP_TEXTS)} requests at once"):
                await warm_up_wide(base, extra, prompts)
            wide = True
        try:
            out[name] = await run_workload(name, base, extra, progress, arrivals, prompts)
        except Exception as exc:  # a refused arrival, a dropped connection: this workload's error
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


async def run_workload(
    name: str, base: str, extra: dict[str, Any], progress: Progress, arrivals: int, prompts: Prompts
) -> dict[str, Any]:
    kind, unique = WORKLOADS[name]
    if kind == "burst":
        with progress.phase(
            f"{name}: {len(BURST_TEXTS)} x {BURST_TOKENS} tokens", len(BURST_TEXTS) * BURST_TOKENS
        ):
            return await burst(base, BURST_TEXTS, BURST_TOKENS, extra, progress, prompts, unique)
    if kind == "single":
        with progress.phase(f"{name}: 1 x {SINGLE_TOKENS} tokens", SINGLE_TOKENS):
            return await burst(base, [SINGLE_TEXT], SINGLE_TOKENS, extra, progress, prompts)
    with progress.phase(f"{name}: {arrivals} new requests while {len(BURST_TEXTS)} streams decode"):
        return await arrival(base, arrivals, extra, progress, prompts, unique)


def failures(result: dict[str, Any]) -> int:
    """A server's refused or failed requests over its workloads; a workload that failed as a whole
    counts one."""
    ran = [result[name] for name in WORKLOADS if isinstance(result.get(name), dict)]
    return sum(1 if "error" in w else int(w.get("errors") or 0) for w in ran)


# -- the two servers ------------------------------------------------------------------------------


def run_llama_server(
    binary: Path,
    model: Path,
    threads: int,
    workloads: list[str] | tuple[str, ...],
    workdir: Path,
    arrivals: int = 20,
    prompts: Prompts = CHAT,
) -> dict[str, Any]:
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


class KVWatch:
    """rtserver's KV bytes in use (`rtserver_kv_used_bytes` of its /metrics), read every `every_s` on a
    thread while the workloads run, and once more at their end: the highest and the last reading."""

    METRIC = "rtserver_kv_used_bytes"

    def __init__(self, read: Callable[[], dict[str, float]], every_s: float = 0.5):
        self.read, self.every_s = read, every_s
        self.readings: list[float] = []
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-watch", daemon=True)

    def sample(self) -> None:
        try:
            self.readings.append(self.read()[self.METRIC])
        except Exception:  # a slow or busy server: this reading is missing, the next one counts
            self.failed += 1

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def __enter__(self) -> KVWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def figures(self) -> dict[str, Any]:
        mb = [b / (1 << 20) for b in self.readings]
        return {
            "kv_used_peak_mb": max(mb, default=None),
            "kv_used_end_mb": mb[-1] if mb else None,
            "kv_used_readings": len(mb),
            "kv_used_failed_readings": self.failed,
        }


# What the bench sets on every `rtserver serve` it runs: the OpenAI door on (ServerProcess), no
# background work competing with the figures, and no per-address limits, since every client of the
# bench comes from 127.0.0.1 where 32 customers would come from 32 addresses.
BENCH_ENV = {
    "RTSERVER_TASKS_AUTO_TASKS": "",
    "RTSERVER_TASKS_FIT_HEADS_IN_BACKGROUND": "false",
    "RTSERVER_SERVER_LOG_LEVEL": "warning",
    **ONE_ADDRESS_LIMITS_OFF,
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
    api_kv_share: float | None = 1.0,
) -> dict[str, Any]:
    """`rtserver serve` with `dtype` (and `model`, else the configured one) through the asked workloads,
    its KV in use followed. `api_kv_share`: the API door's share of the KV (no chat door shares it
    here); None keeps the configured one. The result's `settings_set` names every setting changed."""
    settings = {"RTSERVER_MODEL_DTYPE": dtype, "RTSERVER_MODEL_THREADS": str(threads), **BENCH_ENV}
    if model:
        settings["RTSERVER_MODEL_MODEL"] = model
    if api_kv_share is not None:
        settings["RTSERVER_SECURITY_API_KV_SHARE"] = f"{api_kv_share:g}"
    server = ServerProcess(settings, workdir / f"rtserver-{dtype}.log", config)
    label = f"rtserver {dtype}"
    print(f"  [{label}] starting (log {server.log_path})", flush=True)
    ready_s = server.start(timeout_s)  # a loaded machine reads the weights slowly (seen: 300 s)
    try:
        with KVWatch(server.metrics) as kv:
            result = asyncio.run(
                run_workloads(server.base, workloads, {}, Progress(label), arrivals, prompts)
            )
        server.rss.sample()
        result |= server.rss.figures() | kv.figures()
        result["health"] = server.health()
    finally:
        server.stop()
    return {
        "system": "rtserver",
        "dtype": dtype,
        "runs_as": runs_as(dtype, model or "embedded"),
        "settings_set": {k: v for k, v in server.env.items() if k.startswith("RTSERVER_")},
        "ready_s": ready_s,
        **result,
    }


def runs_as(dtype: str, model: str = "embedded") -> str:
    """What a dtype setting means for the model on this CPU (`auto` chooses per model and CPU): the
    server process, on the same machine, resolves it the same way."""
    from rtserver.engine.model import effective_dtype

    return effective_dtype(dtype, model)


def run_servers_bench(
    dtypes: list[str],
    threads: int,
    config: str | None = None,
    workloads: list[str] | None = None,
    arrivals: int = 20,
    llama_binary: Path | None = None,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """llama-server, then `rtserver serve` with each of `dtypes`; one system at a time, each on both
    prompt sets."""
    from rtserver.engine.model import embedded_model_path

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


def ratios(systems: dict[str, Any], reference: str = "llama-server") -> dict[str, Any]:
    """Each rtserver system's figures divided by the reference's: tokens/s (higher is better) and TTFT
    p95 (lower is better), on both prompt sets."""
    ref = systems.get(reference, {})
    out: dict[str, dict[str, Any]] = {}
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
