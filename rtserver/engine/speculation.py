"""Prompt-lookup speculation: draft tokens from a sequence's own text, while a step is memory-bound.

Support replies copy a lot: order numbers, product names, the customer's own words in a summary. A
sequence's last few tokens then occur earlier in its prompt or output, and what followed them there is
a good guess at what comes next. `Drafter` proposes those tokens. The step computes them beside the
sequence's last token. The sampler keeps the longest run the model itself would have picked
(`Sampler.verify`). So the output is the same, only sooner. A draft is worth its row only while its
chance of being kept beats what the row costs: each sequence keeps its own rate of kept drafts, and
the draft length is the one that gives the most tokens per unit of step time (`draft_length`). The
cost of a row is the kernel's, measured at start-up (`row_cost`). With many sequences a step is
compute-bound and every row costs its full price. So drafting stops above `max_live` running sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .sequence import PRIOR_RATE, Sequence

DEFAULT_ROW_COST = 0.25  # where no kernel probe measured it
LEARN = 0.3  # the weight of each check's outcome in a sequence's kept rate
RECOVER = 0.05  # a step without drafts moves the rate back this far towards the prior: it tries again


@dataclass(frozen=True)
class Speculation:
    """When a step drafts and how much (`engine.speculate_max_live`, `engine.draft_tokens`)."""

    max_live: int = 2  # steps with more running sequences draft nothing; 0: never
    draft_tokens: int = 3  # at most this many drafts a sequence a step
    min_match: int = 2  # the shortest tail looked up; one token alone matches too often to pay
    max_match: int = 4  # longer tails are looked up first: their continuation is likelier right
    max_rows: int = 16  # a step's decode rows and drafts together: more would run the kernel's big steps
    row_cost: float = DEFAULT_ROW_COST  # a step's time per extra row, over a one-row step's

    def describe(self) -> dict[str, float]:
        """What /health shows: up to how many running sequences draft, how many tokens, a step's rows,
        and what a row costs."""
        return {
            "max_live": self.max_live,
            "draft_tokens": self.draft_tokens,
            "step_rows": self.max_rows,
            "row_cost": round(self.row_cost, 3),
        }

    def draft_length(self, kept_rate: float, room: int, running: int = 1) -> int:
        """The draft length (0 to `room`) that gives the most tokens per unit of step time. With drafts
        each kept at `kept_rate`, k drafts give 1 + rate + ... + rate^k tokens. A sequence's share of a
        step of `running` decodes is (1 + (running - 1) row costs) / running: the more decodes, the
        larger the part of that share a draft row takes."""
        cost = self.row_cost * running / (1.0 + self.row_cost * (running - 1))
        best, best_k, tokens = 1.0, 0, 1.0
        for k in range(1, min(room, self.draft_tokens) + 1):
            tokens += kept_rate**k
            speed = tokens / (1.0 + k * cost)
            if speed > best:
                best, best_k = speed, k
        return best_k

    def drafts_in(self, running: int) -> bool:
        """Whether a step of `running` sequences drafts."""
        return 0 < running <= self.max_live and self.max_rows > running


OFF = Speculation(max_live=0)


class Drafter:
    """Drafts for one sequence: the tokens that followed the latest earlier occurrence of its tail."""

    def __init__(self, speculation: Speculation):
        self.speculation = speculation

    def propose(self, seq: Sequence, room: int, running: int = 1) -> list[int]:
        """Up to `room` draft tokens to follow `seq`'s last one, as many as pay at its kept rate in a
        step of `running` decodes."""
        s = self.speculation
        if room <= 0 or not seq.params.speculate:
            return []
        k = s.draft_length(seq.draft_rate, room, running)
        if k == 0:
            seq.draft_rate += RECOVER * (PRIOR_RATE - seq.draft_rate)
            return []
        return lookup(seq.token_array(), k, s.min_match, s.max_match)

    @staticmethod
    def learn(seq: Sequence, kept: int, drafted: int) -> None:
        """A check's outcome into the sequence's kept rate: `kept` drafts in a row, then a rejection
        unless all were kept (the rate's estimate from such a run: kept over tries)."""
        observed = kept / (kept + (kept < drafted))
        seq.draft_rate += LEARN * (observed - seq.draft_rate)


def lookup(tokens: np.ndarray, k: int, min_match: int, max_match: int) -> list[int]:
    """The up to `k` tokens after the latest earlier occurrence of the last n of `tokens` (n from
    `max_match` down to `min_match`, the first n that occurs). Empty when none occurs."""
    total = len(tokens)
    if total < 2:
        return []
    # earlier positions holding the last token: every match of a tail ends at one of them
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    for n in range(min(max_match, total - 1), min_match - 1, -1):
        found = ends[ends >= n - 1]
        for back in range(1, n):
            found = found[tokens[found - back] == tokens[total - 1 - back]]
        if found.size:
            start = int(found[-1]) + 1
            return [int(t) for t in tokens[start : start + k]]
    return []
