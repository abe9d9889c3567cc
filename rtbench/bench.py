"""`rtserver bench`: the engine and in-run baselines on the benchmark workloads, side by side.

Everything runs in one process, one workload after another. So the ratios compare like with like. The
baselines use the same loaded model. They are `generate` per request, static batches of 4, and transformers'
`generate_batch`. Each generates exactly the asked tokens. The `servers` workload is in server_bench.py,
`formats` in formats_bench.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import gc
import json
import logging
import os
import platform
import resource
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rtserver.config import EngineSettings
from rtserver.engine.backend import SamplingParams
from rtserver.engine.core import Engine
from rtserver.engine.heap import return_freed_memory
from rtserver.engine.model import LoadedModel
from rtserver.tasks.chat import encode_chat, finished_turn

from .bench_report import print_table, table
from .chart import write_chart
from .openai_client import completion_prompt
from .stats import accuracy, known, mean, per_second, percentile

log = logging.getLogger("rtserver.bench")

BURST_TEXTS = [f"Tell me a short fact about the number {i}." for i in range(32)]
SINGLE_TEXT = "Write a short story about a robot who learns to paint."
MULTI_TURN_MESSAGES = [
    "Hi! Who are you?",
    "What can you help me with?",
    "Tell me a fun fact.",
    "Why is that interesting?",
    "Give me one more.",
    "Thanks, bye!",
]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """The chat prompt of one user message. A base model without a chat template gets the completion prompt
    the servers bench sends it.
    """
    ids: list[int]
    if not getattr(tokenizer, "chat_template", None):
        ids = tokenizer(completion_prompt(text)).input_ids
    else:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    return ids


def header_tokens(tokenizer: Any) -> int:
    """The chat prompt's ids before the user's message: template header and system prompt. The server shares
    those across sessions. So the engine's workloads share exactly that, as the hub's prompts do.
    """
    if not getattr(tokenizer, "chat_template", None):
        return 0
    return encode_chat(tokenizer, [{"role": "user", "content": "Hi"}]).public_tokens


class LoopLag:
    """Measures how late the event loop wakes up from a 5 ms sleep while work runs."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._task: asyncio.Task[Any] | None = None

    async def _probe(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            self.samples.append((time.perf_counter() - t - 0.005) * 1000)

    def __enter__(self) -> LoopLag:
        self._task = asyncio.get_running_loop().create_task(self._probe())
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._task is not None:
            self._task.cancel()

    def summary(self) -> dict[str, Any]:
        return {
            "loop_lag_p95_ms": percentile(self.samples, 0.95),
            "loop_lag_max_ms": max(self.samples, default=None),
        }


# -- the engine -------------------------------------------------------------------------------


async def engine_burst(
    engine: Engine, prompts: list[list[int]], new_tokens: int, public_tokens: int = 0
) -> dict[str, Any]:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    started = time.perf_counter()
    with LoopLag() as lag:
        streams = [engine.generate(p, params, public_tokens=public_tokens) for p in prompts]
        results = [await s.result() for s in streams]
    wall = time.perf_counter() - started
    generated = sum(r.usage.generated_tokens for r in results)
    ttfts = [known(r.ttft_ms) for r in results]
    return {
        "requests": len(prompts),
        "generated_tokens": generated,
        "exact_token_counts": exact_counts([r.usage.generated_tokens for r in results], new_tokens),
        "wall_s": wall,
        "tokens_per_s": per_second(generated, wall),
        "ttft_p50_ms": percentile(ttfts, 0.5),
        "ttft_p95_ms": percentile(ttfts, 0.95),
        **lag.summary(),
        "outputs": [r.token_ids for r in results],
    }


def exact_counts(counts: list[int], asked: int) -> bool:
    """Whether every request generated exactly `asked` tokens. No early EOS, no shrinking batch."""
    return bool(counts) and all(c == asked for c in counts)


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    """How far greedy outputs match the float32 ones. Counts identical outputs, and tokens before
    divergence.
    """
    same_prefix = []
    for out, ref in zip(outputs, reference):
        n = 0
        while n < min(len(out), len(ref)) and out[n] == ref[n]:
            n += 1
        same_prefix.append(n / max(len(ref), 1))
    return {
        "identical_outputs": accuracy(outputs, reference),
        "tokens_before_divergence": mean(same_prefix),
    }


def kv_agreement(engine: dict[str, dict[str, Any]]) -> None:
    """Each run beside the same weights' run with float32 KV (label "<dtype> kv=float32"). Records how
    far its greedy burst outputs and sentiment labels equal that run's.
    """
    for label, result in engine.items():
        base = label.partition(" kv=")[0]
        ref = engine.get(f"{base} kv=float32")
        if ref is None or ref is result:
            continue
        if "burst" in result and "burst" in ref:
            outputs = result["burst"]["outputs"]
            result["agreement_with_float32_kv"] = agreement(outputs, ref["burst"]["outputs"])
        if "labels" in result.get("sentiment", {}) and "labels" in ref.get("sentiment", {}):
            result["sentiment"]["agreement_with_float32_kv"] = accuracy(
                result["sentiment"]["labels"], ref["sentiment"]["labels"]
            )


async def engine_arrival(
    engine: Engine, background: list[list[int]], arrival: list[int], count: int, public_tokens: int = 0
) -> dict[str, Any]:
    """TTFT of new requests submitted one at a time, while the background streams decode."""
    long_params = SamplingParams(max_new_tokens=512, ignore_eos=True)  # outlasts the arrivals
    streams = [engine.generate(p, long_params, public_tokens=public_tokens) for p in background]
    async for _ in streams[0]:  # wait until every background stream decodes
        if all(s.seq.first_token_at is not None for s in streams):
            break
    ttfts: list[float] = []
    for _ in range(count):
        params = SamplingParams(max_new_tokens=2, ignore_eos=True)
        r = await engine.generate(arrival, params, public_tokens=public_tokens).result()
        ttfts.append(known(r.ttft_ms))
    for s in streams:
        s.cancel()
    for s in streams:
        await s.result()
    return {
        "arrivals": count,
        "background_streams": len(background),
        "ttft_p50_ms": percentile(ttfts, 0.5),
        "ttft_p95_ms": percentile(ttfts, 0.95),
        "ttft_max_ms": max(ttfts),
    }


async def engine_multi_turn(
    engine: Engine,
    tokenizer: Any,
    sessions: int,
    turns: int,
    new_tokens: int,
    messages: list[str] = MULTI_TURN_MESSAGES,
    ignore_eos: bool = True,
) -> dict[str, Any]:
    ttft_by_turn: dict[int, list[float]] = {t: [] for t in range(1, turns + 1)}
    prefilled_by_turn: dict[int, list[int]] = {t: [] for t in range(1, turns + 1)}
    generated = 0

    async def one(s: int) -> None:
        nonlocal generated
        history: list[dict[str, Any]] = []
        last = None
        for t in range(turns):
            text = messages[t % len(messages)]
            history.append({"role": "user", "content": f"{text} (session {s})" if ignore_eos else text})
            chat = encode_chat(tokenizer, history, last)  # as the hub builds it
            r = await engine.generate(
                chat.ids,
                SamplingParams(max_new_tokens=new_tokens, ignore_eos=ignore_eos),
                session_key=f"bench-{s}",
                public_tokens=chat.public_tokens,
            ).result()
            history.append({"role": "assistant", "content": r.text})
            last = finished_turn(tokenizer, chat.rendered, chat.ids, r.text, r.token_ids)
            ttft_by_turn[t + 1].append(known(r.ttft_ms))
            prefilled_by_turn[t + 1].append(r.usage.prefilled_tokens)
            generated += r.usage.generated_tokens

    started = time.perf_counter()
    await asyncio.gather(*(one(s) for s in range(sessions)))
    wall = time.perf_counter() - started
    for s in range(sessions):
        engine.drop_session(f"bench-{s}")
    return {
        "sessions": sessions,
        "turns": turns,
        "tokens_per_s": per_second(generated, wall),
        "ttft_p50_ms_by_turn": {t: percentile(v, 0.5) for t, v in ttft_by_turn.items()},
        "ttft_p95_ms_by_turn": {t: percentile(v, 0.95) for t, v in ttft_by_turn.items()},
        "mean_prefilled_tokens_by_turn": {t: mean(v) for t, v in prefilled_by_turn.items()},
    }


# -- baselines --------------------------------------------------------------------------------


def _baseline_figures(requests: int, counts: list[int], new_tokens: int, wall: float) -> dict[str, Any]:
    """What a baseline run reports: its requests, tokens and rate."""
    return {
        "requests": requests,
        "generated_tokens": sum(counts),
        "exact_token_counts": exact_counts(counts, new_tokens),
        "wall_s": wall,
        "tokens_per_s": per_second(sum(counts), wall),
    }


def hf_naive(model: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    started = time.perf_counter()
    counts = []
    for p in prompts:
        out = model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=model.generation_config.pad_token_id or 0,
        )
        counts.append(out.shape[1] - len(p))
    return _baseline_figures(len(prompts), counts, new_tokens, time.perf_counter() - started)


def hf_static_batches(
    model: Any, tokenizer: Any, prompts: list[list[int]], new_tokens: int, batch: int = 4
) -> dict[str, Any]:
    pad = model.generation_config.pad_token_id or tokenizer.eos_token_id
    started = time.perf_counter()
    counts: list[int] = []
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
        counts += [out.shape[1] - width] * len(group)  # min_new_tokens: no row ends before the others
    return _baseline_figures(len(prompts), counts, new_tokens, time.perf_counter() - started)


def hf_generate_batch(model: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """transformers' continuous batching at its best settings here. It uses SDPA attention and no EOS. Its
    `min_new_tokens` is not honoured there: with EOS on, replies end early and its batches shrink. Its
    manager is warmed by one untimed run of the same batch.
    """
    from transformers import GenerationConfig

    if model.config._attn_implementation != "sdpa":
        model.set_attn_implementation("sdpa")

    def config(tokens: int) -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=tokens,
            do_sample=False,
            eos_token_id=-1,  # no token ends a request: exactly max_new_tokens each
            pad_token_id=model.generation_config.pad_token_id or 0,
        )

    # the warm-up is the timed call itself: the manager's cache is sized for the first call's requests
    model.generate_batch(
        prompts, generation_config=config(new_tokens), persistent_manager=True, progress_bar=False
    )
    started = time.perf_counter()
    outputs = model.generate_batch(
        prompts, generation_config=config(new_tokens), persistent_manager=True, progress_bar=False
    )
    wall = time.perf_counter() - started
    counts = [len(o.generated_tokens) for o in outputs.values()]
    return {
        "requests": len(prompts),
        "generated_tokens": sum(counts),
        "exact_token_counts": len(counts) == len(prompts) and exact_counts(counts, new_tokens),
        "attn_implementation": model.config._attn_implementation,
        "wall_s": wall,
        "tokens_per_s": per_second(sum(counts), wall),
    }


# -- the run ----------------------------------------------------------------------------------


def _commit() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
                timeout=5,
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def say(line: str) -> None:
    """Progress while the bench runs: which system, which workload."""
    print(line, flush=True)


async def run_engine_workloads(
    loaded: LoadedModel, options: EngineSettings, workloads: list[str], label: str = "engine"
) -> dict[str, Any]:
    tok = loaded.tokenizer
    engine = Engine(loaded, options, release_dense_weights=True)  # as `rtserver serve` runs it
    engine.start()
    # the KV type and the activations' width: both move greedy agreement with float32 KV
    results: dict[str, Any] = {"kv": engine.kv_memory.describe(), "kernels": engine.kernels}
    try:
        burst = [chat_ids(tok, t) for t in BURST_TEXTS]
        single = chat_ids(tok, SINGLE_TEXT)
        header = header_tokens(tok)
        say(f"  [{label}] warm-up")
        await engine.generate(single, SamplingParams(max_new_tokens=8)).result()  # warm-up, untimed
        await engine_burst(engine, burst[:4], 4, header)
        if "burst" in workloads:
            say(f"  [{label}] burst: 32 x 64 tokens")
            results["burst"] = await engine_burst(engine, burst, 64, header)
        if "single" in workloads:
            say(f"  [{label}] single: 1 x 128 tokens")
            results["single"] = await engine_burst(engine, [single], 128, header)
        if "arrival" in workloads:
            say(f"  [{label}] arrival: 20 new requests while 32 streams decode")
            results["arrival"] = await engine_arrival(engine, burst, single, 20, header)
        if "multi-turn" in workloads:
            say(f"  [{label}] multi-turn: 16 sessions x 6 turns")
            results["multi-turn"] = await engine_multi_turn(engine, tok, 16, 6, 48)
        if "e2e" in workloads:  # the engine-only twin of the end-to-end run below
            from .loadclient import DEFAULT_PROMPTS

            say(f"  [{label}] e2e engine-only twin: 32 sessions x 5 turns")
            results["e2e-engine-only"] = await engine_multi_turn(
                engine, tok, 32, 5, 64, DEFAULT_PROMPTS, ignore_eos=False
            )
        if "sentiment" in workloads:
            from .sentiment_bench import engine_sentiment

            say(f"  [{label}] sentiment: 256 texts, then the same again")
            results["sentiment"] = await engine_sentiment(engine, tok)
        if "structured" in workloads:  # last: it ends by stopping the engine for its replay
            from .structured_bench import engine_structured

            say(f"  [{label}] structured: 1000 JSON Schema generations, the mask's cost per token")
            results["structured"] = await engine_structured(engine, lambda text: chat_ids(tok, text))
    finally:
        await engine.stop()
    return results


def run_baselines(loaded: LoadedModel, workloads: list[str], naive_requests: int) -> dict[str, Any]:
    model: Any = loaded.model  # as the hf_* baselines take it: transformers' generate is untyped
    tok = loaded.tokenizer
    burst = [chat_ids(tok, t) for t in BURST_TEXTS]
    single = chat_ids(tok, SINGLE_TEXT)
    model.generate(
        torch.tensor([single]),
        max_new_tokens=4,
        do_sample=False,
        pad_token_id=model.generation_config.pad_token_id or 0,
    )  # warm-up
    out: dict[str, Any] = {}
    if "burst" in workloads:
        say(f"  [transformers] burst: generate one by one ({naive_requests} requests x 64 tokens)")
        naive = hf_naive(model, burst[:naive_requests], 64)
        say("  [transformers] burst: generate in batches of 4 (32 x 64 tokens)")
        static4 = hf_static_batches(model, tok, burst, 64)
        say("  [transformers] burst: generate_batch (32 x 64 tokens)")
        out["burst"] = {"naive": naive, "static4": static4, "cb": hf_generate_batch(model, burst, 64)}
    if "single" in workloads:
        say("  [transformers] single: generate (1 x 128 tokens)")
        out["single"] = {"naive": hf_naive(model, [single], 128)}
    if "sentiment" in workloads:
        from .sentiment_bench import hf_sentiment_baseline

        say("  [transformers] sentiment: generative, batches of 4")
        out["sentiment"] = hf_sentiment_baseline(model, tok)
    return out


def run_e2e(
    dtype: str, config: str | None, sessions: int = 32, turns: int = 5, new_tokens: int = 64
) -> dict[str, Any]:
    """`rtserver serve` in a subprocess on 127.0.0.1. The load client drives it over WebSocket."""
    import tempfile

    from .loadclient import run_chat_load
    from .serverproc import ONE_ADDRESS_LIMITS_OFF, ServerProcess

    server = ServerProcess(
        {
            "RTSERVER_MODEL_DTYPE": dtype,
            "RTSERVER_TASKS_AUTO_TASKS": "",
            "RTSERVER_SERVER_LOG_LEVEL": "warning",
            **ONE_ADDRESS_LIMITS_OFF,
        },
        Path(tempfile.mkdtemp(prefix="rtserver-e2e-")) / "server.log",
        config,
    )
    server.start(timeout_s=180)
    try:
        asyncio.run(run_chat_load(server.ws_url, 1, 1, 8))  # warm-up
        return asyncio.run(run_chat_load(server.ws_url, sessions, turns, new_tokens))
    finally:
        server.stop()


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux)
    except OSError:
        pass


def peak_rss_since_reset_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return peak_rss_mb()


def cpu_description() -> str:
    """The CPU's model name, and the instruction sets that change which dtype and kernels win here. Figures
    from machines of another kind are not comparable.
    """
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    wanted = [("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "bf16"), ("amx_bf16", "AMX")]
    present = [label for flag, label in wanted if flag in flags]
    return f"{name} ({', '.join(present)})" if present else name


def dtype_label(loaded: LoadedModel) -> str:
    return loaded.dtype_name


EVERY_DTYPE_WORKLOADS = ("burst", "single", "arrival", "sentiment")  # the rest run on the first dtype only
SERVER_WORKLOADS = ("remote", "servers", "formats", "speculation")  # servers in their own processes
OWN_MODEL_WORKLOADS = (*SERVER_WORKLOADS, "kld")  # none runs on the bench's engine: kld loads its files


def _run_engines(
    report: dict[str, Any],
    save: Callable[[], None],
    load: Callable[[str], LoadedModel],
    engine_dtypes: list[str],
    options: EngineSettings,
    workloads: list[str],
    config: str | None,
) -> None:
    """The engine workloads into `report["engine"]`. Each engine dtype runs on a freshly loaded model."""
    engine_workloads = [w for w in workloads if w not in OWN_MODEL_WORKLOADS]
    for i, spec in enumerate(engine_dtypes if engine_workloads else []):
        gc.collect()
        return_freed_memory()  # what the previous dtype's run left in the heap must not count for this one
        _reset_peak_rss()
        dtype, _, kv_dtype = spec.partition(":kv=")
        loaded = load(dtype)
        report["model"] = loaded.name
        label = dtype_label(loaded) + (f" kv={kv_dtype}" if kv_dtype else "")
        mine = engine_workloads if i == 0 else [w for w in workloads if w in EVERY_DTYPE_WORKLOADS]
        say(f"[engine {label}] in-process: {', '.join(mine)}")
        run_options = dataclasses.replace(options, kv_dtype=kv_dtype) if kv_dtype else options
        result = asyncio.run(run_engine_workloads(loaded, run_options, mine, f"engine {label}"))
        result["peak_rss_mb"] = peak_rss_since_reset_mb()
        del loaded
        if i == 0 and "e2e" in workloads:
            say(f"[rtserver {dtype}] e2e: 32 WebSocket sessions x 5 turns")
            result["e2e"] = run_e2e(dtype, config)
        report["engine"][label] = result
        save()


def _run_servers(
    report: dict[str, Any],
    save: Callable[[], None],
    engine_dtypes: list[str],
    workloads: list[str],
    threads: int,
    config: str | None,
    formats: list[str] | None,
    reps: int,
) -> None:
    """The servers comparison, the formats matrix and the remote hub, as `workloads` asks."""
    if "servers" in workloads:
        from .server_bench import run_servers_bench

        say(f"[servers] llama-server, then rtserver serve ({', '.join(engine_dtypes)}), one at a time")
        report["servers"] = run_servers_bench(engine_dtypes, threads, config)
        save()
    if "formats" in workloads:
        from .formats_bench import run_formats_bench

        def saved(formats_so_far: dict[str, Any]) -> None:
            report["formats"] = formats_so_far
            save()

        say(f"[formats] the model files people run: llama-server, then rtserver serve {engine_dtypes[0]}")
        report["formats"] = run_formats_bench(
            formats, engine_dtypes[0], threads, config, reps=reps, on_row=saved
        )
        save()
    if "speculation" in workloads:
        from .speculation_bench import run_speculation_bench

        say("[speculation] rtserver serve with drafts on, then off")
        report["speculation"] = run_speculation_bench(threads, config)
        save()
    if "remote" in workloads:
        from .remote_bench import run_remote_bench

        say("[remote] rtserver as a hub in front of llama-server")
        report["remote"] = run_remote_bench(threads)
        save()


def _run_kld(
    report: dict[str, Any],
    save: Callable[[], None],
    dtype: str,
    options: EngineSettings,
    threads: int,
    cache_dir: str,
    formats: list[str] | None,
) -> None:
    """The kld workload: each file's default path and llama.cpp against its float32 reference."""
    from .kld_bench import run_kld_bench

    def saved(kld_so_far: dict[str, Any]) -> None:
        report["kld"] = kld_so_far
        save()

    say(f"[kld] KL divergence from float32: rtserver {dtype} (prefill, decode), then llama-perplexity")
    report["kld"] = run_kld_bench(formats, dtype, options, threads, cache_dir, on_row=saved, say=say)
    save()


def _agreements(engine: dict[str, Any]) -> None:
    """Each engine dtype's outputs and labels against float32's, where both ran."""
    reference = engine.get("float32", {}).get("burst", {}).get("outputs")
    for label, result in engine.items():
        if reference and label != "float32" and "burst" in result:
            result["agreement_with_float32"] = agreement(result["burst"]["outputs"], reference)
    kv_agreement(engine)
    labels = engine.get("float32", {}).get("sentiment", {}).get("labels")
    for label, result in engine.items():
        if labels and label != "float32" and "labels" in result.get("sentiment", {}):
            result["sentiment"]["agreement_with_float32"] = accuracy(result["sentiment"]["labels"], labels)


def run_bench(
    load: Callable[[str], LoadedModel],
    engine_dtypes: list[str],
    baseline_dtype: str,
    options: EngineSettings,
    workloads: list[str],
    baselines: bool,
    naive_requests: int,
    out_dir: str,
    config: str | None = None,
    threads: int = 0,
    formats: list[str] | None = None,
    reps: int = 1,
    cache_dir: str = "~/.cache/rtserver",
) -> dict[str, Any]:
    """Engine workloads run on the first engine dtype. The burst, single, arrival and sentiment ones run on
    the others too, for speed and agreement with float32. Each runs on a freshly loaded model. Then comes
    the servers comparison: llama-server, then `rtserver serve` with each engine dtype. Then comes the
    formats matrix. `formats` picks its rows and `reps` runs each pair of servers. rtserver runs on the
    first engine dtype there. Then comes kld, on `formats`' files too (its own two by default), with the
    first engine dtype as the default path. Then come the baselines. The JSON is rewritten after every
    phase and formats row. So an interrupted run still leaves its figures. A chart of them is written
    beside it at the end.
    """
    threads = threads or os.cpu_count() or 1
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "threads": threads,
        "cpu": cpu_description(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "workloads": workloads,
        "engine": {},
        "baselines": {},
    }
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / f"bench-{report['date'].replace(':', '')}.json"

    def save() -> None:
        path.write_text(json.dumps(report, indent=2, default=str))

    _run_engines(report, save, load, engine_dtypes, options, workloads, config)
    _run_servers(report, save, engine_dtypes, workloads, threads, config, formats, reps)
    if "kld" in workloads:
        _run_kld(report, save, engine_dtypes[0], options, threads, cache_dir, formats)
    if baselines and any(w not in OWN_MODEL_WORKLOADS for w in workloads):
        gc.collect()
        say(f"[transformers] baselines in {baseline_dtype}")
        loaded = load(baseline_dtype)
        report["baseline_dtype"] = dtype_label(loaded)
        report["baselines"] = run_baselines(loaded, workloads, naive_requests)
    _agreements(report["engine"])
    report["table"] = table(report)
    save()
    chart = write_chart(report, path.with_suffix(".svg"))
    print_table(report, path, chart)
    return report
