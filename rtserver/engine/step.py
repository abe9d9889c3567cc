"""A step's output: what the runner computed for each item of the plan, for the scheduler to apply.

The runner never writes into a sequence. Its forward gives logits and hidden-state features
(`Forward`); `StepRunner.execute` adds the sampled tokens and label scores, and per item the work
of its own that failed (`StepOutput`). The scheduler applies all of it in one place.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .grammar import Rows
from .plan import NO_JOINS, JoinSource, StepItem
from .sampler import Sampler
from .sequence import Sequence

log = logging.getLogger("rtserver.step")


@dataclass
class Features:
    """Hidden-state features of one item (a learned head's input), float32."""

    rows: int = 0  # rows pooled: the item's positions from pool_from on
    sums: list[torch.Tensor] = field(default_factory=list)  # per pool layer, the sum over those rows
    # with logits: the final hidden state at the item's last row, then per last layer
    last: list[torch.Tensor] | None = None


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
    scores: list[list[float] | None]  # label scores of a scoring call whose prompt is computed
    errors: list[tuple[str, Exception] | None]  # work of this item alone that failed: (stage, error)

    @classmethod
    def of(cls, items: list[StepItem], features: list[Features | None]) -> StepOutput:
        n = len(items)
        return cls(items, features, [None] * n, [None] * n, [None] * n)


class StepRunner:
    """A step from a forward: sampling and label scoring over its logits. Subclasses give `run`."""

    sampler = Sampler()

    def run(self, items: list[StepItem], joins: JoinSource = NO_JOINS) -> Forward:
        """The forward of one step; items from `joins` may join it (see ModelRunner.run)."""
        raise NotImplementedError

    def forward(self, items: list[StepItem], joins: JoinSource = NO_JOINS) -> list[torch.Tensor | None]:
        """The logits of one step, per item (joiners appended)."""
        return self.run(items, joins).logits

    def sample(self, seqs: list[Sequence], logits: Rows) -> list[int | Exception]:
        return self.sampler.sample(seqs, logits)

    def execute(self, items: list[StepItem], joins: JoinSource = NO_JOINS) -> StepOutput:
        """One step: the forward, then a token for each generation and scores for each scoring call
        whose prompt it finished. A sequence whose own sampling or scoring raises gets the error."""
        fw = self.run(items, joins)
        items = [*items, *fw.joined]
        out = StepOutput.of(items, fw.features)
        sampling: list[tuple[int, torch.Tensor]] = []
        scoring: list[tuple[int, torch.Tensor]] = []
        for i, (it, lg) in enumerate(zip(items, fw.logits)):
            if lg is not None:
                (sampling if it.seq.candidates is None else scoring).append((i, lg[-1]))
        if sampling:
            # the rows as they are: a step of a large vocabulary would copy megabytes to stack them
            picked = self.sample([items[i].seq for i, _ in sampling], [r for _, r in sampling])
            for (i, _), token in zip(sampling, picked):
                if isinstance(token, Exception):
                    out.errors[i] = ("sampling", token)
                else:
                    out.tokens[i] = token
        if scoring:
            for (i, _), scores in zip(scoring, self._scores([(items[i], row) for i, row in scoring])):
                if isinstance(scores, Exception):
                    out.errors[i] = ("label scoring", scores)
                else:
                    out.scores[i] = scores
        return out

    def _scores(self, done: list[tuple[StepItem, torch.Tensor]]) -> list[list[float] | Exception]:
        """score_labels for all; where that fails, for each alone (deterministic, in its own KV), so
        one call's labels fail alone."""
        try:
            return list(self.score_labels(done))
        except Exception:
            log.warning("label scoring failed for %s; retrying one by one", [it.seq.id for it, _ in done])
        out: list[list[float] | Exception] = []
        for pair in done:
            try:
                out.append(self.score_labels([pair])[0])
            except Exception as exc:
                out.append(exc)
        return out

    def score_labels(self, done: list[tuple[StepItem, torch.Tensor]]) -> list[list[float]]:
        """The label scores of items that finished a scoring prompt, given each one's logits row at the
        prompt's last position. A candidate's first token is scored from that row: its log-softmax over
        the vocabulary, or with `score_columns` its raw logit (the log-normaliser left out is the same for
        every candidate of the prompt). Candidates longer than one token are teacher-forced in the
        sequence's own KV past its prompt (room reserved at admission, never shared, never kept): round
        r computes the r-th such candidate of every sequence in one forward."""
        results: list[list[float]] = []
        longer: list[list[tuple[StepItem, list[float], int, list[int]]]] = []
        for it, row in done:
            seq = it.seq
            assert seq.candidates is not None
            if seq.score_columns is None:
                logprobs = torch.log_softmax(row, -1)
                scores = [float(logprobs[c[0]]) for c in seq.candidates]
            else:
                column = {t: j for j, t in enumerate(seq.score_columns)}
                scores = [float(row[column[c[0]]]) for c in seq.candidates]
            results.append(scores)
            for r, (i, cand) in enumerate((i, c) for i, c in enumerate(seq.candidates) if len(c) > 1):
                if r == len(longer):
                    longer.append([])
                longer[r].append((it, scores, i, cand))
        for group in longer:
            outs = self.forward(
                [
                    StepItem(it.seq, it.kv, it.start + len(it.tokens), cand[:-1], "all")
                    for it, _, _, cand in group
                ]
            )
            for (_, scores, i, cand), lg in zip(group, outs):
                assert lg is not None
                lp = torch.log_softmax(lg, -1)
                scores[i] += float(lp[torch.arange(len(cand) - 1), torch.tensor(cand[1:])].sum())
        return results
