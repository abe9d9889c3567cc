"""A `PromptTask`'s learned heads: the plugin's shipped fit, one `rtserver fit-heads` stored, or a fit.

A start-up only loads (`fit=False`): a prompt without a fit for the loaded model scores labels until
`rtserver fit-heads` (or a background fit) makes one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Protocol

import numpy as np

from ..engine.backend import FeatureScorer, InferenceBackend
from .declare import Choices, LearnedHead, Task
from .fitting import FULL, Pace
from .head import (
    LogisticHead,
    features_key,
    head_input,
    head_key,
    load_cached,
    load_examples,
    load_fitted,
    load_stored,
    store_cached,
    stored_path,
)

log = logging.getLogger("rtserver.tasks")


class PromptTask(Protocol):
    """What loading heads needs of `run.PromptTask` (named, not imported: run.py imports this)."""

    task: Task
    head_model: str

    def render_parts(self, text: str) -> tuple[list[int], Choices | None, str, bool]: ...

    def candidate_ids(self, choices: Choices) -> list[list[int]]: ...

    async def feature_row(
        self, backend: InferenceBackend, prompt: list[int], choices: Choices, template: str, chat: bool
    ) -> list[float]: ...

    def use_heads(
        self,
        heads: dict[int, LogisticHead],
        fitted: dict[str, tuple[str, LogisticHead]],
        note: str | None,
        *,
        missing: bool = False,
    ) -> None: ...


async def prepare_heads(
    pt: PromptTask,
    backend: InferenceBackend,
    cache_dir: Path | None = None,
    backend_name: str = "",
    *,
    fit: bool = True,
    pace: Pace = FULL,
) -> str | None:
    """Load the task's learned heads (nothing to do without one): the plugin's shipped fit, or the one
    `rtserver fit-heads` stored in `cache_dir`. With `fit`, a prompt without one is fitted from the
    examples at `pace`; without, the task scores labels. Returns a note when it scores labels (no
    hidden states on this backend, or no fit). The heads switch in at once, when all are ready."""
    spec = pt.task.head
    if spec is None or pt.task.choices is None:
        pt.use_heads({}, {}, None)
        return None
    if not isinstance(backend, FeatureScorer):
        note = (
            f"task {pt.task.name!r}: its learned head needs the model's hidden states, which backend "
            f"{backend_name or type(backend).__name__!r} does not return; the task runs by label "
            "scoring (no head)"
        )
        log.warning("%s", note)
        pt.use_heads({}, {}, note)
        return note
    groups: dict[int, list[tuple[str, str]]] = {}
    raw = load_examples(Path(spec.examples), spec.labels, list(pt.task.choices.labels))
    for text, label in raw:
        clean = pt.task.clean_text(text)
        groups.setdefault(pt.task.variant_of(clean), []).append((clean, label))
    known = _known_fits(spec, stored_path(cache_dir, pt.task.name))
    model_id = backend.feature_model_id
    heads: dict[int, LogisticHead] = {}
    fitted: dict[str, tuple[str, LogisticHead]] = {}
    for index, rows in sorted(groups.items()):
        prepared = await _prompt_head(pt, backend, model_id, spec, known, rows, cache_dir, fit, pace)
        if prepared is None:
            continue
        key, head = prepared
        if head is None:
            note = f"no fit for model {model_id}; run rtserver fit-heads"
            log.warning("task %s: %s (until then it scores labels)", pt.task.name, note)
            pt.use_heads({}, {}, note, missing=True)
            return note
        heads[index], fitted[key] = head, (model_id, head)
    pt.use_heads(heads, fitted, None)
    pt.head_model = model_id
    return None


async def _prompt_head(
    pt: PromptTask,
    backend: InferenceBackend,
    model_id: str,
    spec: LearnedHead,
    known: dict[str, tuple[LogisticHead, str]],
    rows: list[tuple[str, str]],
    cache_dir: Path | None,
    fit: bool,
    pace: Pace,
) -> tuple[str, LogisticHead | None] | None:
    """The head of one prompt (the task's or a variant's) by its key: a known fit for this model, else
    fitted (`fit`) or none. None: too few examples, that prompt keeps label scoring."""
    template, choices, chat = pt.task.select(rows[0][0])
    assert choices is not None
    labels = [name for name in choices.labels if any(label == name for _, label in rows)]
    name, shown = pt.task.name, template[:40]
    if len(rows) < spec.min_examples or len(labels) < 2:
        why = "too few for a head, it keeps label scoring"
        log.warning("%s: %d examples (%d labels) for prompt %r: %s", name, len(rows), len(labels), shown, why)
        return None
    texts, y = [t for t, _ in rows], [label for _, label in rows]
    fkey = _features_key(pt, model_id, choices, template, chat, texts)
    key = head_key(fkey, labels, y, LogisticHead(labels, spec.l2), spec.use_scores)
    if key in known:
        head, source = known[key]
        what = f"fitted for this model, prompt and {len(rows)} examples"
        log.info("%s: learned head for prompt %r loaded from %s (%s)", name, shown, source, what)
        return key, head
    if not fit:
        return key, None
    how = f"fitting one from the {len(rows)} examples (computing their features the first time)"
    missing = f"no head fitted for this model ({model_id}), prompt {shown!r} and examples"
    log.warning("task %s has %s: %s", name, missing, how)
    x = await example_features(pt, backend, choices, template, chat, texts, cache_dir, fkey, pace)
    started = time.perf_counter()
    rows_in = head_input(pt.task, x, len(choices.labels))
    loop = asyncio.get_running_loop()
    head = await loop.run_in_executor(pace.executor, LogisticHead(labels, spec.l2).fit, rows_in, y)
    took = time.perf_counter() - started
    log.info("%s: learned head fitted on %d examples in %.1f s (prompt %r)", name, len(rows), took, shown)
    return key, head


async def example_features(
    pt: PromptTask,
    backend: InferenceBackend,
    choices: Choices,
    template: str,
    chat: bool,
    texts: list[str],
    cache_dir: Path | None,
    key: str,
    pace: Pace,
) -> np.ndarray:
    assert isinstance(backend, FeatureScorer)
    cached = load_cached(cache_dir, key)
    if cached is not None and cached.shape[0] == len(texts):
        return cached
    started = time.perf_counter()
    sem = asyncio.Semaphore(pace.concurrency)

    async def one(text: str) -> list[float]:
        async with sem:
            prompt = pt.render_parts(text)[0]
            return await pt.feature_row(backend, prompt, choices, template, chat)

    x = np.asarray(await asyncio.gather(*(one(t) for t in texts)), dtype=np.float32)
    log.info(
        "%s: features of %d examples computed in %.1f s",
        pt.task.name,
        len(texts),
        time.perf_counter() - started,
    )
    store_cached(cache_dir, key, x)
    return x


def _known_fits(spec: LearnedHead, stored: Path | None) -> dict[str, tuple[LogisticHead, str]]:
    """Every fit on hand by key, with the file it came from: the plugin's shipped one, then the one
    `rtserver fit-heads` stored."""
    known: dict[str, tuple[LogisticHead, str]] = {}
    if spec.fitted is not None:
        known.update({key: (head, str(spec.fitted)) for key, head in load_fitted(Path(spec.fitted)).items()})
    known.update({key: (head, str(stored)) for key, head in load_stored(stored).items()})
    return known


def _features_key(
    pt: PromptTask, model_id: str, choices: Choices, template: str, chat: bool, texts: list[str]
) -> str:
    """The cache key of the examples' features: everything they depend on."""
    task = pt.task
    return features_key(
        model_id,
        template,
        chat,
        task.system_prompt if chat else None,
        pt.candidate_ids(choices),
        choices.calibration,
        task.max_input_tokens,
        task.truncate,
        texts,
    )
