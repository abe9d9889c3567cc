"""How a stateless task runs: `PromptTask` binds a `Task` to the tokenizer and runs calls on a backend.

The prompt's fixed prefix is tokenized once, so every call shares its KV. Calls score `Choices` with
calibration (or a learned head, `prepare`d once the backend runs) or generate and parse.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import random
import secrets
import time
import weakref
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

from cachetools import TTLCache

from ..engine.backend import (
    FeatureScorer,
    FinishReason,
    Generation,
    InferenceBackend,
    SamplingParams,
    SequenceResult,
    Tokenizer,
)
from .chat import ChatPrompt
from .declare import Choices, Task, TaskError, TaskOutput
from .fitting import FULL, Pace
from .head import LogisticHead, head_input
from .prepare import prepare_heads

log = logging.getLogger("rtserver.tasks")

Deltas = Callable[[int, str], None]  # (sample index, text): a generating call's replies as they stream


def no_deltas(sample: int, text: str) -> None:
    """Nobody watches the replies arrive."""


class PromptTask:
    """A stateless task bound to a tokenizer: renders prompts (caching the fixed prefix tokens) and runs
    calls on a backend, by label scoring (`Choices`) or by generating and parsing."""

    def __init__(self, task: Task, tokenizer: Tokenizer):
        self.task = task
        self.tokenizer = tokenizer
        self._prefixes: dict[tuple[str, bool], tuple[list[int], str, str]] = {}
        self._suffixes: dict[str, list[int]] = {}
        self._candidates: dict[tuple[tuple[str, str], ...], list[list[int]]] = {}
        # per backend object (weakly: an id() could be reused by a later backend), then per prompt
        self._calibration: weakref.WeakKeyDictionary[
            Any, dict[tuple[Any, ...], asyncio.Future[list[float]]]
        ] = weakref.WeakKeyDictionary()
        self.cache: TTLCache[tuple[Any, ...], TaskOutput] | None = (
            TTLCache(task.cache_size, task.cache_ttl_s) if task.cache_size and not task.stateful else None
        )
        self.cache_hits = 0
        self.cache_misses = 0
        self.heads: dict[int, LogisticHead] = {}  # variant index (-1: the task's prompt) -> fitted head
        self.fitted: dict[str, tuple[str, LogisticHead]] = {}  # head key -> (model id, head): fit-heads
        self.head_note: str | None = None  # why a declared head is not used (None: used, or none)
        self.head_model = ""  # the model id the heads in use were fitted for
        self.fit_missing = False  # no fit for this model: `rtserver fit-heads` or a background fit makes one

    # -- prompts ------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _encode_input(self, text: str) -> list[int]:
        """User text: special-token strings in it (e.g. "<|im_end|>") stay plain text."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        except TypeError:  # a tokenizer without the option
            return self._encode(text)

    def _split_template(self, template: str, chat: bool) -> tuple[list[int], str, str]:
        """Token ids of everything before {text} (the shared prefix), text to put before the input when it
        is tokenized, and the raw text after it."""
        key = (template, chat)
        if key not in self._prefixes:
            marker = "\x00TEXT\x00"
            rendered = template.replace("{text}", marker)
            if chat:
                messages = [{"role": "user", "content": rendered}]
                if self.task.system_prompt:
                    messages.insert(0, {"role": "system", "content": self.task.system_prompt})
                rendered = self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True
                )
            before, after = rendered.split(marker)
            # The prefix keeps its trailing space as its own token ("Message: " + "great"): on the dev
            # split that scored better with the embedded model than letting the space glue onto the
            # text (" great"; docs/sentiment-research.md). `glue` is where that choice would go.
            glue = ""
            self._prefixes[key] = (self._encode(before), glue, after)
        return self._prefixes[key]

    def _suffix_ids(self, suffix: str) -> list[int]:
        ids = self._suffixes.get(suffix)
        if ids is None:
            ids = self._suffixes[suffix] = self._encode(suffix)
        return ids

    def candidate_ids(self, choices: Choices) -> list[list[int]]:
        key = tuple(choices.labels.items())
        ids = self._candidates.get(key)
        if ids is None:
            ids = self._candidates[key] = [self._encode(words) for words in choices.labels.values()]
        return ids

    def render(self, text: str) -> tuple[list[int], Choices | None]:
        """(prompt ids, choices) for a cleaned input text, within the token limit. The fixed prefix is
        tokenized on its own so every call starts with the same tokens (and shares their KV)."""
        return self.render_parts(text)[:2]

    def render_parts(self, text: str) -> tuple[list[int], Choices | None, str, bool]:
        template, choices, chat = self.task.select(text)
        prefix, glue, suffix = self._split_template(template, chat)
        body = self._encode_input(glue + text)
        if len(body) > self.task.max_input_tokens:
            if self.task.truncate == "reject":
                raise TaskError(
                    "input_too_long",
                    f"{self.task.name}: text has {len(body)} tokens, the limit "
                    f"is {self.task.max_input_tokens}",
                )
            keep = self.task.max_input_tokens
            body = body[:keep] if self.task.truncate == "head" else body[-keep:]
        return prefix + body + self._suffix_ids(suffix), choices, template, chat

    def cost(self, overrides: dict[str, Any] | None = None) -> int:
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
        raw_input: Any,
        overrides: dict[str, Any] | None = None,
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
        key = (
            scope,
            " ".join(text.split()).lower(),
            "[]" if not overrides else repr(sorted(overrides.items())),
        )
        cache = self.cache if scope is not None else None
        if cache is not None:
            hit = cache.get(key)
            if hit is not None:
                self.cache_hits += 1
                return TaskOutput(hit.task, hit.output, hit.text, hit.usage, hit.timing, True)
            self.cache_misses += 1
        started = time.perf_counter()
        prompt, choices, template, chat = self.render_parts(text)
        public = len(self._split_template(template, chat)[0])  # the fixed prefix: the task's own text
        if choices is not None:
            head = self.heads.get(self.task.variant_of(text)) if self.heads else None
            output = await self._score(backend, prompt, choices, template, chat, head)
            out = TaskOutput(
                self.task.name,
                output,
                output["label"],
                {"prompt_tokens": len(prompt), "generated_tokens": 0},
                {"total_ms": (time.perf_counter() - started) * 1000},
            )
        else:
            params = params if params is not None else self.task.sampling(None, caller)
            out = await self._generated(backend, prompt, params, public, on_delta)
        if cache is not None:
            cache[key] = out
        return out

    async def follow(
        self,
        backend: InferenceBackend,
        prompt: ChatPrompt,
        session_key: Hashable,
        overrides: dict[str, Any] | None = None,
        on_delta: Deltas = no_deltas,
        caller: str | None = None,
    ) -> TaskOutput:
        """One call on a live conversation's own prompt (`Task.conversation_prompt`): it starts from
        that session's KV (`fork_session`), so only the instruction and the reply are computed."""
        params = self.task.sampling(overrides, caller)
        return await self._generated(backend, prompt.ids, params, prompt.public_tokens, on_delta, session_key)

    async def _generated(
        self,
        backend: InferenceBackend,
        prompt: list[int],
        params: SamplingParams,
        public: int,
        on_delta: Deltas,
        fork: Hashable | None = None,
    ) -> TaskOutput:
        """A generating task's call: the reply parsed by the task's parser (a JSON task's: as JSON);
        with `samples` above 1, that many replies, `{"samples": [parsed, ...]}` (the distinct ones, in
        order), each drawn with its own seed."""
        n = self.task.samples
        started = time.perf_counter()
        results = await self._replies(backend, prompt, params, public, on_delta, fork)
        parsed = [self._parsed(r, params) for r in results]
        if n == 1:
            output = parsed[0]
        else:
            output = {"samples": [p for i, p in enumerate(parsed) if p not in parsed[:i]]}
        lead = results[0]  # submitted as the call began: its first token is the call's
        usage = dataclasses.asdict(results[0].usage)
        usage["generated_tokens"] = sum(r.usage.generated_tokens for r in results)
        return TaskOutput(
            self.task.name,
            output,
            results[0].text if n == 1 else "\n".join(r.text for r in results),
            usage,
            {
                "queued_ms": lead.queued_ms,
                "ttft_ms": lead.ttft_ms,
                "total_ms": (time.perf_counter() - started) * 1000,
            },
        )

    async def _replies(
        self,
        backend: InferenceBackend,
        prompt: list[int],
        params: SamplingParams,
        public: int,
        on_delta: Deltas,
        fork: Hashable | None,
    ) -> list[SequenceResult]:
        """The call's `samples` replies. The first one's prompt goes alone (from `fork`'s KV where
        given); the others follow its first token and reuse that prompt's KV. A cancelled call
        cancels its generations."""
        n = self.task.samples
        seed = params.seed if params.seed is not None else random.getrandbits(48)
        scope = secrets.randbits(62)  # this call's own: no other call, nor session, shares it
        streams: list[Generation] = []

        def draw(i: int) -> Generation:
            source = fork if i == 0 else None
            if n == 1:
                stream = backend.generate(prompt, params, public_tokens=public, fork_session=source)
            else:
                one = dataclasses.replace(params, seed=seed + i)
                stream = backend.generate(
                    prompt, one, public_tokens=public, prefix_scope=scope, fork_session=source
                )
            streams.append(stream)
            return stream

        async def forward(i: int, stream: Generation, *, first_only: bool = False) -> None:
            async for event in stream:
                if event.text:
                    on_delta(i, event.text)
                if first_only:
                    return

        async def follow(i: int, stream: Generation) -> SequenceResult:
            await forward(i, stream)
            return await stream.result()

        try:
            lead = draw(0)
            if n > 1:
                await forward(0, lead, first_only=True)
            rest = [draw(i) for i in range(1, n)]
            return list(await asyncio.gather(*(follow(i, s) for i, s in enumerate([lead, *rest]))))
        except asyncio.CancelledError:
            for stream in streams:
                stream.cancel()
            raise

    def _parsed(self, result: SequenceResult, params: SamplingParams) -> dict[str, Any]:
        """One reply's value: the task's parser on its text, its JSON, or the text itself."""
        if result.error:
            raise TaskError("internal", f"{self.task.name}: generation failed")
        fmt = params.output
        if not fmt.free and result.finish_reason is not FinishReason.EOS:
            raise TaskError(
                "output_truncated",
                f"{self.task.name}: the output reached {params.max_new_tokens} tokens before its "
                f"{fmt.kind} was complete",
            )
        try:
            if self.task.parser:
                parsed = self.task.parser(result.text)
            else:
                parsed = json.loads(result.text) if fmt.is_json else {"text": result.text}
        except Exception as exc:  # a plugin bug: this request fails, nothing else does
            log.exception("%s: output parser failed on %r", self.task.name, result.text)
            raise TaskError(
                "internal", f"{self.task.name}: the task's output parser failed ({type(exc).__name__})"
            ) from exc
        return parsed if isinstance(parsed, dict) else {"value": parsed}

    async def _score(
        self,
        backend: InferenceBackend,
        prompt: list[int],
        choices: Choices,
        template: str,
        chat: bool,
        head: LogisticHead | None = None,
    ) -> dict[str, Any]:
        labels = list(choices.labels)
        if head is not None and isinstance(backend, FeatureScorer):
            row = await self.feature_row(backend, prompt, choices, template, chat)
            p = head.predict_proba(head_input(self.task, row, len(labels)))[0]
            probs = dict.fromkeys(labels, 0.0)
            probs.update({name: float(v) for name, v in zip(head.labels, p)})
            return {"label": max(probs, key=lambda name: probs[name]), "probs": probs}
        candidates = self.candidate_ids(choices)
        # Only differences between the labels' scores matter below (calibration subtracts per label, the
        # softmax is across labels), so the backend may leave out the prompt's log-normaliser.
        public = len(self._split_template(template, chat)[0])
        scores = await backend.score(prompt, candidates, normalize=False, public_tokens=public)
        if choices.calibration:
            offsets = await self._calibration_offsets(backend, template, chat, choices, candidates)
            scores = [s - o for s, o in zip(scores, offsets)]
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        total = sum(weights)
        probs = {name: w / total for name, w in zip(labels, weights)}
        label = max(probs, key=lambda name: probs[name])
        return {"label": label, "probs": probs}

    async def _calibration_offsets(
        self,
        backend: InferenceBackend,
        template: str,
        chat: bool,
        choices: Choices,
        candidates: list[list[int]],
    ) -> list[float]:
        # One computation per backend shared by every call that needs it (a burst of first calls must
        # not each score the calibration inputs); a failed one is retried by the next call. `calibrate`
        # computes them at start-up, alone.
        known = self._calibration.setdefault(backend, {})
        key = (template, chat, tuple(choices.labels.items()), tuple(choices.calibration))
        fut = known.get(key)
        if fut is None or (fut.done() and (fut.cancelled() or fut.exception() is not None)):
            fut = asyncio.ensure_future(
                self._compute_calibration(backend, template, chat, choices, candidates)
            )
            known[key] = fut
        return await asyncio.shield(fut)

    async def calibrate(self, backend: InferenceBackend) -> None:
        """Score every prompt's calibration inputs alone, before any call. On a batching server a score
        depends a little on the rest of the batch, enough to move the offsets and flip labels."""
        task = self.task
        prompts = [(task.prompt, task.choices, task.chat_template)] + [
            (
                v.prompt,
                v.choices if v.choices is not None else task.choices,
                task.chat_template if v.chat_template is None else v.chat_template,
            )
            for v in task.variants
        ]
        for template, choices, chat in prompts:
            if choices is not None and choices.calibration:
                candidates = self.candidate_ids(choices)
                # Put the prompt's fixed prefix in the server's cache first, as every call finds it:
                # a prefix computed in the same request scores a little differently.
                primer = self._calibration_prompt(template, chat, choices.calibration[0])
                public = len(self._split_template(template, chat)[0])
                await backend.score(primer, candidates, normalize=False, public_tokens=public)
                await self._calibration_offsets(backend, template, chat, choices, candidates)

    async def _compute_calibration(
        self,
        backend: InferenceBackend,
        template: str,
        chat: bool,
        choices: Choices,
        candidates: list[list[int]],
    ) -> list[float]:
        public = len(self._split_template(template, chat)[0])
        runs = [
            await backend.score(
                self._calibration_prompt(template, chat, c), candidates, normalize=False, public_tokens=public
            )
            for c in choices.calibration
        ]
        return [sum(r[i] for r in runs) / len(runs) for i in range(len(candidates))]

    def _calibration_prompt(self, template: str, chat: bool, content_free: str) -> list[int]:
        prefix, glue, suffix = self._split_template(template, chat)
        return prefix + self._encode_input(glue + content_free) + self._suffix_ids(suffix)

    # -- the learned head -----------------------------------------------------------------------
    async def feature_row(
        self, backend: InferenceBackend, prompt: list[int], choices: Choices, template: str, chat: bool
    ) -> list[float]:
        """The head's raw input for one prompt: hidden-state features, then the calibrated label scores
        (the label-scoring path's numbers, from the same forward)."""
        assert isinstance(backend, FeatureScorer)
        prefix = self._split_template(template, chat)[0]
        candidates = self.candidate_ids(choices)
        scores, feats = await backend.score_features(
            prompt, candidates, features_from=len(prefix), public_tokens=len(prefix)
        )
        if choices.calibration:
            offsets = await self._calibration_offsets(backend, template, chat, choices, candidates)
            scores = [s - o for s, o in zip(scores, offsets)]
        return feats + scores

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
