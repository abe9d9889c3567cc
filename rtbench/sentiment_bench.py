"""The sentiment workload of `rtserver bench`: 256 distinct texts at once, then the same 256 again
(result cache), against the write-ups' method (generative prompt, greedy, 3 new tokens, HF `generate`
in batches of 4); and what a sentiment auto-task adds to a chat reply's time to first token."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from rtserver.engine.backend import SamplingParams, Tokenizer
from rtserver.engine.core import Engine
from rtserver.engine.scheduler import Scheduler
from rtserver.engine.sequence import Sequence
from rtserver.tasks.registry import TaskRegistry

from .stats import fraction, known, mean, median, per_second

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "sentiment"
WRITEUP_PROMPT = (
    "Classify the sentiment of the following text as positive or negative. "
    "Answer with one word only.\nText: {text}"
)
CACHED_ROUNDS = 5  # the cached burst is short and noisy: repeated, its median is reported
AUTO_TASK_CHATS = 8  # chat replies measured per mode (alone / with the auto-task / forced same step)
# Distinct first words: no message shares more than the chat template's head with another (prefix cache).
AUTO_TASK_MESSAGES = [
    "Hi! Can you help me with my order?",
    "The delivery was late again, I am annoyed.",
    "Thanks, that solved it, you are great!",
    "How do I change my password?",
    "This app keeps crashing and I lost my work.",
    "Can I get a refund for the broken lamp?",
    "I love the new design, well done.",
    "What are your opening hours on Sunday?",
    "My parcel arrived damaged, what now?",
    "Is there a student discount?",
    "Great support today, many thanks to Anna.",
    "Why was I charged twice this month?",
    "Please cancel my subscription.",
    "Your website is very slow tonight.",
    "Do you ship to Canada?",
    "Excellent quality, I will order again.",
    "Could someone call me back tomorrow?",
    "Nobody answered my email for a week.",
    "Where can I find my invoice?",
    "Awesome, the update fixed everything.",
    "Are the batteries included?",
    "Terrible experience with the courier.",
    "Which plan includes cloud backup?",
    "Wonderful service, thank you!",
]


def sentiment_texts(n: int = 256) -> list[str]:
    """n distinct short texts: the shipped labeled test sets when present, else generated ones."""
    texts: list[str] = []
    for name in ("en_test.jsonl", "zh_test.jsonl", "en_dev.jsonl", "zh_dev.jsonl"):
        path = DATA_DIR / name
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                text = json.loads(line)["text"]
                if len(text) < 200 and text not in texts:
                    texts.append(text)
    i = 0
    while len(texts) < n:
        texts.append(f"Review {i}: the product was {'great' if i % 2 else 'disappointing'} overall.")
        i += 1
    return texts[:n]


class StepLog:
    """Records (start, end, StepStats) of every scheduler step while active (bench instrumentation)."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.records: list[tuple[float, float, Any]] = []

    def _step(self) -> None:
        s = self.scheduler
        before, started = s.steps, time.perf_counter()
        type(s).step(s)
        if s.steps != before:
            self.records.append((started, time.perf_counter(), s.last_step))

    def __enter__(self) -> StepLog:
        # the worker thread calls self.step() each round: an instance attribute shadows the method
        self.scheduler.step = self._step  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.scheduler.step

    def first_token_step(self, seq: Sequence) -> tuple[int, float, int] | None:
        """(steps that ran from the sequence's submission to its first token, the duration of the last
        and the prompt tokens it computed)."""
        if seq.first_token_at is None:
            return None
        spans = [r for r in self.records if r[1] > seq.submitted_at and r[0] <= seq.first_token_at]
        if not spans:
            return None
        start, end, stats = spans[-1]
        return len(spans), end - start, stats.prefill_tokens


async def _chat_turn(engine: Engine, registry: TaskRegistry, text: str, mode: str, key: str) -> Sequence:
    """One chat reply to `text`; mode "alone", "auto" (the sentiment auto-task spawned right after the
    reply's generation is queued, as the hub does) or "same-step" (the auto-task forced into the reply's
    first step: the worst case). Returns the reply's sequence."""
    chat = registry.chat
    encoded = chat.encode([{"role": "user", "content": text}])
    prompt, public = encoded.ids, encoded.public_tokens
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    task = None
    if mode == "same-step":
        # Hold the scheduler's admission (its condition lock; reentrant, so this thread can still
        # submit) until both sequences wait, so they are admitted together.
        scheduler = engine.scheduler
        with scheduler._cond:
            stream = engine.generate(prompt, params, session_key=key, public_tokens=public)
            task = asyncio.get_running_loop().create_task(registry.run(engine, "sentiment", text))
            while not task.done() and not any(s.candidates is not None for s in scheduler.waiting):
                await asyncio.sleep(0)
    else:
        stream = engine.generate(prompt, params, session_key=key, public_tokens=public)
        if mode == "auto":
            task = asyncio.get_running_loop().create_task(registry.run(engine, "sentiment", text))
    await stream.result()
    if task is not None:
        assert not (await task).cached
    engine.drop_session(key)
    return stream.seq


async def auto_task_ttft(engine: Engine, registry: TaskRegistry, n: int = AUTO_TASK_CHATS) -> dict[str, Any]:
    """A chat reply's time to first token alone and with the sentiment auto-task on its message, in ms
    and in scheduler steps (the unit: the reply's own first step when alone). Modes alternate so drift
    affects all alike; every message is distinct (no result-cache hits, equal prefix-cache reuse)."""
    modes = ("alone", "auto", "same-step")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with StepLog(engine.scheduler) as log:
        for i in range(len(modes) * n):
            mode = modes[i % len(modes)]
            seq = await _chat_turn(
                engine, registry, AUTO_TASK_MESSAGES[i % len(AUTO_TASK_MESSAGES)], mode, f"bench-auto-{i}"
            )
            steps, step_s, step_tokens = log.first_token_step(seq) or (None, None, None)
            r = seq.result()
            runs[mode].append(
                {
                    "ttft_ms": r.ttft_ms,
                    "total_ms": r.total_ms,
                    "steps_to_first_token": steps,
                    "first_token_step_ms": None if step_s is None else step_s * 1000,
                    "first_token_step_tokens": step_tokens,
                    "prefilled_tokens": r.usage.prefilled_tokens,
                }
            )

    def p50(mode: str, key: str) -> float:
        return known(median(r[key] for r in runs[mode]))

    step_ms = known(median(r["first_token_step_ms"] for r in runs["alone"] if r["first_token_step_ms"]))
    alone = p50("alone", "ttft_ms")
    out: dict[str, Any] = {
        "chats_per_mode": n,
        "step_ms": step_ms,
        "chat_prefilled_tokens_p50": p50("alone", "prefilled_tokens"),
        "ttft_alone_p50_ms": alone,
    }
    for mode, name in (("auto", "auto_task"), ("same-step", "same_step")):
        out[f"ttft_{name}_p50_ms"] = p50(mode, "ttft_ms")
        out[f"added_ms_{name}"] = p50(mode, "ttft_ms") - alone
        out[f"added_steps_{name}"] = (p50(mode, "ttft_ms") - alone) / step_ms
        out[f"max_steps_to_first_token_{name}"] = max(r["steps_to_first_token"] or 0 for r in runs[mode])
        out[f"in_first_step_{name}"] = fraction(
            (r["first_token_step_tokens"] or 0) > r["prefilled_tokens"] for r in runs[mode]
        )
    out["reply_total_p50_ms"] = {m: p50(m, "total_ms") for m in modes}
    out["runs"] = runs
    return out


async def engine_sentiment(
    engine: Engine, tokenizer: Tokenizer, registry: TaskRegistry | None = None
) -> dict[str, Any]:
    """The sentiment task with its learned head, as a server with `tasks.learned_heads = true` runs it
    (fitted first: features from the cache in model.cache_dir, computed on a first run), and beside it,
    in the same run, the zero-data label scoring (`head = false`, the default) as `label_scoring`."""
    from rtserver.config import Settings
    from rtserver.tasks.registry import load_registry

    result: dict[str, Any] = {}
    if registry is None:
        settings = Settings()
        plain, _ = load_registry(
            dataclasses.replace(settings, task={"sentiment": {"head": False}}), tokenizer
        )
        result["label_scoring"] = await _sentiment_rates(engine, plain)
        registry, _ = load_registry(settings, tokenizer)
        started = time.perf_counter()
        await registry.prepare(
            lambda name: ("local", engine), Path(settings.model.cache_dir).expanduser() / "heads"
        )
        result["head_ready_s"] = time.perf_counter() - started
    result.update(await _sentiment_rates(engine, registry))
    result["auto_task"] = await auto_task_ttft(engine, registry)
    return result


async def _sentiment_rates(engine: Engine, registry: TaskRegistry) -> dict[str, Any]:
    texts = sentiment_texts()
    await registry.run(engine, "sentiment", {"text": "warm-up text"})  # calibration + warm-up
    stats0 = engine.stats()
    started = time.perf_counter()
    fresh = await asyncio.gather(
        *(registry.run(engine, "sentiment", {"text": t}, scope="bench") for t in texts)
    )
    fresh_s = time.perf_counter() - started
    stats1 = engine.stats()
    rates: list[float] = []
    for _ in range(CACHED_ROUNDS):
        started = time.perf_counter()
        again = await asyncio.gather(
            *(registry.run(engine, "sentiment", {"text": t}, scope="bench") for t in texts)
        )
        rates.append(known(per_second(len(texts), time.perf_counter() - started)))
        assert all(a.cached for a in again) and [a.output for a in again] == [f.output for f in fresh]
    steps = stats1["steps"] - stats0["steps"]
    kv0, kv1 = stats0["kv"], stats1["kv"]
    assert kv0 is not None and kv1 is not None  # the local engine always has its KV cache
    task = registry.get("sentiment")
    return {
        "method": "learned head" if getattr(task, "heads", None) else "label scoring",
        "texts": len(texts),
        "fresh_per_s": per_second(len(texts), fresh_s),
        "cached_per_s": median(rates),
        "cached_per_s_rounds": rates,
        "prefilled_tokens_per_text": (stats1["tokens_prefilled"] - stats0["tokens_prefilled"]) / len(texts),
        "prefix_cached_tokens_per_text": (kv1.prefix_hits - kv0.prefix_hits) / len(texts),
        "prompt_tokens_per_text": mean(f.usage["prompt_tokens"] for f in fresh),
        "fresh_steps": steps,
        "fresh_step_ms": fresh_s * 1000 / max(steps, 1),
        "labels": [f.output["label"] for f in fresh],
    }


def hf_sentiment_baseline(model: Any, tokenizer: Any, n: int = 64, batch: int = 4) -> dict[str, Any]:
    texts = sentiment_texts()[:n]
    pad = model.generation_config.pad_token_id or tokenizer.eos_token_id
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": WRITEUP_PROMPT.format(text=t)}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for t in texts
    ]
    started = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=pad)
    wall = time.perf_counter() - started
    return {"texts": len(texts), "per_s": per_second(len(texts), wall)}
