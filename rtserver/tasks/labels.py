"""How a `Choices` task answers: `LabelPicker` scores each label, calibrated, or asks a learned head.

Calibration offsets are computed once per backend and prompt, and shared by every call.
"""

from __future__ import annotations

import asyncio
import math
import weakref

from ..engine.backend import FeatureScorer, InferenceBackend
from .declare import Choices, LabelOutput, Task
from .head import LogisticHead, head_input
from .prompts import Prompts

# A prompt's calibration: (template, chat, labels, content-free inputs).
CalibrationKey = tuple[str, bool, tuple[tuple[str, str], ...], tuple[str, ...]]


class LabelPicker:
    """A task's label scoring: calibrated scores and a softmax, or a learned head's probabilities."""

    def __init__(self, task: Task, prompts: Prompts):
        self.task = task
        self.prompts = prompts
        # Per backend object, held weakly: an id() could be reused by a later backend.
        self.calibration: weakref.WeakKeyDictionary[
            InferenceBackend, dict[CalibrationKey, asyncio.Future[list[float]]]
        ] = weakref.WeakKeyDictionary()

    async def score(
        self,
        backend: InferenceBackend,
        prompt: list[int],
        choices: Choices,
        template: str,
        chat: bool,
        head: LogisticHead | None = None,
    ) -> LabelOutput:
        """The best label and every label's probability."""
        labels = list(choices.labels)
        if head is not None and isinstance(backend, FeatureScorer):
            row = await self.feature_row(backend, prompt, choices, template, chat)
            p = head.predict_proba(head_input(self.task, row, len(labels)))[0]
            probs = dict.fromkeys(labels, 0.0)
            probs.update({name: float(v) for name, v in zip(head.labels, p)})
            return {"label": max(probs, key=lambda name: probs[name]), "probs": probs}
        candidates = self.prompts.candidate_ids(choices)
        # Only differences between the labels' scores matter below (calibration subtracts per label, the
        # softmax is across labels), so the backend may leave out the prompt's log-normaliser.
        public = self.prompts.public_tokens(template, chat)
        scores = await backend.score(prompt, candidates, normalize=False, public_tokens=public)
        if choices.calibration:
            offsets = await self.offsets(backend, template, chat, choices)
            scores = [s - o for s, o in zip(scores, offsets)]
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        total = sum(weights)
        probs = {name: w / total for name, w in zip(labels, weights)}
        return {"label": max(probs, key=lambda name: probs[name]), "probs": probs}

    async def feature_row(
        self, backend: InferenceBackend, prompt: list[int], choices: Choices, template: str, chat: bool
    ) -> list[float]:
        """The head's raw input for one prompt: hidden-state features, then the calibrated label scores
        (the label-scoring path's numbers, from the same forward)."""
        assert isinstance(backend, FeatureScorer)
        public = self.prompts.public_tokens(template, chat)
        candidates = self.prompts.candidate_ids(choices)
        scores, feats = await backend.score_features(
            prompt, candidates, features_from=public, public_tokens=public
        )
        if choices.calibration:
            offsets = await self.offsets(backend, template, chat, choices)
            scores = [s - o for s, o in zip(scores, offsets)]
        return feats + scores

    async def offsets(
        self, backend: InferenceBackend, template: str, chat: bool, choices: Choices
    ) -> list[float]:
        """Each label's mean score over the content-free inputs."""
        # One computation per backend shared by every call that needs it (a burst of first calls must
        # not each score the calibration inputs); a failed one is retried by the next call. `calibrate`
        # computes them at start-up, alone.
        known = self.calibration.setdefault(backend, {})
        key = (template, chat, tuple(choices.labels.items()), tuple(choices.calibration))
        fut = known.get(key)
        if fut is None or (fut.done() and (fut.cancelled() or fut.exception() is not None)):
            fut = asyncio.ensure_future(self._compute(backend, template, chat, choices))
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
                candidates = self.prompts.candidate_ids(choices)
                # Put the prompt's fixed prefix in the server's cache first, as every call finds it:
                # a prefix computed in the same request scores a little differently.
                primer = self.prompts.filled(template, chat, choices.calibration[0])
                public = self.prompts.public_tokens(template, chat)
                await backend.score(primer, candidates, normalize=False, public_tokens=public)
                await self.offsets(backend, template, chat, choices)

    async def _compute(
        self, backend: InferenceBackend, template: str, chat: bool, choices: Choices
    ) -> list[float]:
        candidates = self.prompts.candidate_ids(choices)
        public = self.prompts.public_tokens(template, chat)
        runs = [
            await backend.score(
                self.prompts.filled(template, chat, c), candidates, normalize=False, public_tokens=public
            )
            for c in choices.calibration
        ]
        return [sum(r[i] for r in runs) / len(runs) for i in range(len(candidates))]
