"""How a stateless task runs: `PromptTask` binds a `Task` to the tokenizer and runs calls on a backend.

Its parts have one job each: `prompts.py` renders, `cache.py` keeps results, `labels.py` scores
`Choices` (calibrated, or by a learned head, `prepare`d once the backend runs), `replies.py`
generates and parses.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping
from pathlib import Path

from cachetools import TTLCache

from ..engine.backend import InferenceBackend, Tokenizer
from .cache import CacheKey, ResultCache
from .chat import ChatPrompt
from .declare import Choices, Task, TaskOutput
from .fitting import FULL, Pace
from .head import LogisticHead
from .labels import LabelPicker
from .prepare import prepare_heads
from .prompts import Prompts
from .replies import Deltas, generate, no_deltas

__all__ = ["Deltas", "PromptTask", "no_deltas"]


class PromptTask:
    """A stateless task bound to a tokenizer: runs calls on a backend, by label scoring (`Choices`) or
    by generating and parsing, and holds the learned heads it scores with."""

    def __init__(self, task: Task, tokenizer: Tokenizer):
        self.task = task
        self.tokenizer = tokenizer
        self.prompts = Prompts(task, tokenizer)
        self.labels = LabelPicker(task, self.prompts)
        self.results = ResultCache(0 if task.stateful else task.cache_size, task.cache_ttl_s)
        self.heads: dict[int, LogisticHead] = {}  # variant index (-1: the task's prompt) -> fitted head
        self.fitted: dict[str, tuple[str, LogisticHead]] = {}  # head key -> (model id, head): fit-heads
        self.head_note: str | None = None  # why a declared head is not used (None: used, or none)
        self.head_model = ""  # the model id the heads in use were fitted for
        self.fit_missing = False  # no fit for this model: `rtserver fit-heads` or a background fit makes one

    # -- the result cache ----------------------------------------------------------------------
    @property
    def cache(self) -> TTLCache[CacheKey, TaskOutput] | None:
        return self.results.entries

    @cache.setter
    def cache(self, entries: TTLCache[CacheKey, TaskOutput] | None) -> None:
        self.results.entries = entries

    @property
    def cache_hits(self) -> int:
        return self.results.hits

    @property
    def cache_misses(self) -> int:
        return self.results.misses

    # -- prompts ------------------------------------------------------------------------------
    def render(self, text: str) -> tuple[list[int], Choices | None]:
        """(prompt ids, choices) for a cleaned input text, within the token limit. The fixed prefix is
        tokenized on its own so every call starts with the same tokens (and shares their KV)."""
        return self.render_parts(text)[:2]

    def render_parts(self, text: str) -> tuple[list[int], Choices | None, str, bool]:
        """(prompt ids, choices, template, chat) for a cleaned input text."""
        return self.prompts.render(text)

    def candidate_ids(self, choices: Choices) -> list[list[int]]:
        return self.prompts.candidate_ids(choices)

    def cost(self, overrides: Mapping[str, object] | None = None) -> int:
        """The most tokens one call can take: the longest prompt and what it may generate."""
        prompt, choices, _, _ = self.render_parts("x")
        if choices is not None:
            return len(prompt) + self.task.max_input_tokens
        one = len(prompt) + self.task.max_input_tokens + self.task.sampling(overrides).max_new_tokens
        return one * self.task.samples

    # -- running ------------------------------------------------------------------------------
    async def run(
        self,
        backend: InferenceBackend,
        raw_input: object,
        overrides: Mapping[str, object] | None = None,
        *,
        scope: Hashable | None = None,
        on_delta: Deltas = no_deltas,
        caller: str | None = None,
    ) -> TaskOutput:
        """One call. Results are cached per `scope` (a session, the HTTP API): a scope never sees
        another's entries, nor how fast they come back; without one the cache is not used. A
        generating call hands each reply's text to `on_delta` as it streams (not on a cache hit).
        `caller` sets the call's priority (`Task.sampling`)."""
        text = raw_input.get("text") if isinstance(raw_input, dict) else raw_input
        text = self.task.clean_text(text)
        # Overrides are checked before the cache is read (a bad one is an error, cached or not); without
        # any, the task's own decoding is valid by construction and only built when generating.
        params = None if overrides is None else self.task.sampling(overrides, caller)
        key = ResultCache.key(scope, text, overrides) if scope is not None else None
        if key is not None and (hit := self.results.get(key)) is not None:
            return hit
        started = time.perf_counter()
        prompt, choices, template, chat = self.prompts.render(text)
        public = self.prompts.public_tokens(template, chat)  # the fixed prefix: the task's own text
        if choices is not None:
            head = self.heads.get(self.task.variant_of(text)) if self.heads else None
            output = await self.labels.score(backend, prompt, choices, template, chat, head)
            out = TaskOutput(
                self.task.name,
                output,
                output["label"],
                {"prompt_tokens": len(prompt), "generated_tokens": 0},
                {"total_ms": (time.perf_counter() - started) * 1000},
            )
        else:
            params = params if params is not None else self.task.sampling(None, caller)
            out = await generate(self.task, backend, prompt, params, public, on_delta)
        if key is not None:
            self.results.put(key, out)
        return out

    async def follow(
        self,
        backend: InferenceBackend,
        prompt: ChatPrompt,
        session_key: Hashable,
        overrides: Mapping[str, object] | None = None,
        on_delta: Deltas = no_deltas,
        caller: str | None = None,
    ) -> TaskOutput:
        """One call on a live conversation's own prompt (`Task.conversation_prompt`): it starts from
        that session's KV (`fork_session`), so only the instruction and the reply are computed."""
        params = self.task.sampling(overrides, caller)
        return await generate(
            self.task, backend, prompt.ids, params, prompt.public_tokens, on_delta, session_key
        )

    # -- label scoring and the learned head ---------------------------------------------------------
    async def calibrate(self, backend: InferenceBackend) -> None:
        """Compute the calibration offsets at start-up, alone (`LabelPicker.calibrate`)."""
        await self.labels.calibrate(backend)

    async def feature_row(
        self, backend: InferenceBackend, prompt: list[int], choices: Choices, template: str, chat: bool
    ) -> list[float]:
        """The head's raw input for one prompt (`LabelPicker.feature_row`)."""
        return await self.labels.feature_row(backend, prompt, choices, template, chat)

    async def prepare(
        self,
        backend: InferenceBackend,
        cache_dir: Path | None = None,
        backend_name: str = "",
        *,
        fit: bool = True,
        pace: Pace = FULL,
    ) -> str | None:
        """Load the task's learned heads (`prepare.py`); a note says why it scores labels instead."""
        return await prepare_heads(self, backend, cache_dir, backend_name, fit=fit, pace=pace)

    def use_heads(
        self,
        heads: dict[int, LogisticHead],
        fitted: dict[str, tuple[str, LogisticHead]],
        note: str | None,
        *,
        missing: bool = False,
    ) -> None:
        """Switch the task to these heads (none: label scoring, `note` says why)."""
        self.heads, self.fitted, self.head_note, self.fit_missing = heads, fitted, note, missing

    def head_state(self) -> dict[str, str] | None:
        """Which scoring a task with a learned head uses and why, for /health (None: it declares none)."""
        if self.task.head is None:
            return None
        if self.heads:
            return {"mode": "head", "head": f"fitted for model {self.head_model}"}
        return {"mode": "labels", "head": self.head_note or "learned heads are not loaded"}
