"""A step's output: what the runner computed for each item of the plan, for the scheduler to apply.

The runner never writes into a sequence. Its forward gives logits and hidden-state features
(`Forward`). `StepRunner` composes the forward, a sampler and a label scorer: `execute` adds the
sampled tokens, the label scores and per item the work of its own that failed (`StepOutput`).
The scheduler applies all of it in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .features import Features
from .grammar import Rows
from .labels import LabelScorer
from .plan import NO_JOINS, JoinSource, StepItem
from .sampler import Sampler
from .sequence import Sequence


@dataclass
class Forward:
    """A forward's result per item (joiners appended): the logits it asked for, its features."""

    logits: list[torch.Tensor | None]
    features: list[Features | None]
    joined: list[StepItem] = field(default_factory=list)  # items that joined the step under way


@dataclass
class StepOutput:
    """What one step computed per item of its plan (items that joined mid-step appended)."""

    items: list[StepItem]  # the plan's, then those that joined
    features: list[Features | None]
    tokens: list[int | None]  # the next token of a generation whose prompt is computed
    runs: list[list[int] | None]  # a decode with drafts: the drafts kept, then its own next token
    scores: list[list[float] | None]  # first-token label scores of a scoring call whose prompt is computed
    rounds: list[float | None]  # a label round's log-probability of its candidate's later tokens
    errors: list[tuple[str, Exception] | None]  # work of this item alone that failed: (stage, error)

    @classmethod
    def of(cls, items: list[StepItem], features: list[Features | None]) -> StepOutput:
        n = len(items)
        return cls(items, features, [None] * n, [None] * n, [None] * n, [None] * n, [None] * n)


class Model(Protocol):
    """The forward a step runs (the model runner, or a test's fake)."""

    def run(self, items: list[StepItem], joins: JoinSource = NO_JOINS) -> Forward: ...

    def forward(self, items: list[StepItem]) -> list[torch.Tensor | None]: ...


class TokenSampler(Protocol):
    """Picks each generation's next token from its logits row, and checks drafts (sampler.Sampler)."""

    def sample(self, seqs: list[Sequence], logits: Rows) -> list[int | Exception]: ...

    def verify(self, seq: Sequence, rows: torch.Tensor, drafts: list[int]) -> list[int] | Exception: ...


class StepRunner:
    """One step: the model's forward, then its sampler and label scorer over the logits."""

    def __init__(self, model: Model, sampler: TokenSampler | None = None, scorer: LabelScorer | None = None):
        self.model = model
        self.sampler: TokenSampler = sampler or Sampler()
        self.scorer = scorer or LabelScorer()

    def execute(self, items: list[StepItem], joins: JoinSource = NO_JOINS) -> StepOutput:
        """The forward, then a token for each generation and scores for each scoring call whose
        prompt it finished. A sequence whose own sampling or scoring raises gets the error."""
        fw = self.model.run(items, joins)
        items = [*items, *fw.joined]
        out = StepOutput.of(items, fw.features)
        sampling: list[tuple[int, torch.Tensor]] = []
        for i, (it, lg) in enumerate(zip(items, fw.logits)):
            if lg is None:
                continue
            if it.drafts:
                run = self.sampler.verify(it.seq, lg, it.tokens[1:])
                if isinstance(run, Exception):
                    out.errors[i] = ("sampling", run)
                else:
                    out.runs[i] = run
                continue
            if it.seq.candidates is None:
                sampling.append((i, lg[-1]))
                continue
            try:  # one call's labels fail alone
                if it.label is not None:
                    out.rounds[i] = self.scorer.round(it, lg)
                else:
                    out.scores[i] = self.scorer.first(it, lg[-1])
            except Exception as exc:
                out.errors[i] = ("label scoring", exc)
        if sampling:
            # the rows as they are: a step of a large vocabulary would copy megabytes to stack them
            picked = self.sampler.sample([items[i].seq for i, _ in sampling], [r for _, r in sampling])
            for (i, _), token in zip(sampling, picked):
                if isinstance(token, Exception):
                    out.errors[i] = ("sampling", token)
                else:
                    out.tokens[i] = token
        return out
