"""Label scoring: the scores of a scoring call's candidates.

A candidate's first token is scored from the prompt's last logits row. A longer candidate is
teacher-forced in a label round: a planned step item past the prompt, in the sequence's own KV
(room reserved at admission, never shared, never kept). The scheduler plans one round a step.
"""

from __future__ import annotations

import torch

from .plan import StepItem


class LabelScorer:
    """Label scores from a step's logits: first tokens, then each round's continuation."""

    def first(self, it: StepItem, row: torch.Tensor) -> list[float]:
        """Every candidate's first-token score, from the prompt's last logits row.

        That is its log-softmax over the vocabulary. With `score_columns` it is the raw logit: the
        log-normaliser left out is the same for every candidate of the prompt.
        """
        seq = it.seq
        assert seq.candidates is not None
        if seq.score_columns is None:
            logprobs = torch.log_softmax(row, -1)
            return [float(logprobs[c[0]]) for c in seq.candidates]
        column = {t: j for j, t in enumerate(seq.score_columns)}
        return [float(row[column[c[0]]]) for c in seq.candidates]

    def round(self, it: StepItem, logits: torch.Tensor) -> float:
        """A label round's log-probability of the candidate's tokens after its first."""
        assert it.seq.candidates is not None and it.label is not None
        cand = it.seq.candidates[it.label]
        lp = torch.log_softmax(logits, -1)
        return float(lp[torch.arange(len(cand) - 1), torch.tensor(cand[1:])].sum())


def rounds_of(candidates: list[list[int]]) -> list[int]:
    """The candidates a label round teacher-forces: those longer than one token."""
    return [i for i, c in enumerate(candidates) if len(c) > 1]
