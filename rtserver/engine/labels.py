"""Label scoring: the scores of a scoring call's candidates, from its prompt's last logits row.

A candidate's first token is scored from that row. Longer candidates are teacher-forced in the
sequence's own KV past its prompt: room reserved at admission, never shared, never kept.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from .plan import StepItem

log = logging.getLogger("rtserver.step")

# one finished scoring prompt: its item, and its logits row at the prompt's last position
Done = tuple[StepItem, torch.Tensor]


class Forwarder(Protocol):
    """The logits of a step's items, per item (the model runner's `forward`)."""

    def forward(self, items: list[StepItem]) -> list[torch.Tensor | None]: ...


class LabelScorer:
    """Label scores of the scoring calls a step finished, over the model's forward."""

    def __init__(self, model: Forwarder):
        self.model = model

    def score(self, done: list[Done]) -> list[list[float] | Exception]:
        """`score_labels` for all; where that fails, for each alone, so one call's labels fail alone.

        Alone is deterministic: each call runs in its own KV.
        """
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

    def score_labels(self, done: list[Done]) -> list[list[float]]:
        """The label scores of items that finished a scoring prompt.

        The first token scores from the prompt's last row: its log-softmax over the vocabulary, or
        with `score_columns` its raw logit (the log-normaliser left out is the same for every
        candidate of the prompt). Round r teacher-forces the r-th longer candidate of every
        sequence in one forward.
        """
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
            outs = self.model.forward(
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
