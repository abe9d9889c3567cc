"""Prompt-lookup speculation: draft tokens from a sequence's own text, while a step is memory-bound.

Support replies copy a lot: order numbers, product names, the customer's own words in a summary. A
sequence's last few tokens then occur earlier in its prompt or output, and what followed them there is
a good guess at what comes next. `Drafter` proposes those tokens. The step computes them beside the
sequence's last token. The sampler keeps the longest run the model itself would have picked
(`Sampler.verify`). So the output is the same, only sooner. A step that reads its weights for a few
rows costs about what a one-row step does. With many sequences a step is compute-bound and drafts
would cost their full price. So drafting stops above `max_live` running sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .sequence import Sequence


@dataclass(frozen=True)
class Speculation:
    """When a step drafts and how much (`engine.speculate_max_live`, `engine.draft_tokens`)."""

    max_live: int = 2  # steps with more running sequences draft nothing; 0: never
    draft_tokens: int = 4  # at most this many drafts a sequence a step
    min_match: int = 2  # the shortest tail looked up; one token alone matches too often to pay
    max_match: int = 4  # longer tails are looked up first: their continuation is likelier right
    max_rows: int = 16  # a step's decode rows and drafts together: more would run the kernel's big steps

    @classmethod
    def of(cls, max_live: int, draft_tokens: int, max_rows: int) -> Speculation:
        """The [engine] settings, within the rows a step keeps on the kernel's small-step path."""
        return cls(max_live=max_live, draft_tokens=draft_tokens, max_rows=max_rows)

    def describe(self) -> dict[str, int]:
        """What /health shows: up to how many running sequences draft, how many tokens, a step's rows."""
        return {"max_live": self.max_live, "draft_tokens": self.draft_tokens, "step_rows": self.max_rows}

    def drafts_in(self, running: int) -> bool:
        """Whether a step of `running` sequences drafts."""
        return 0 < running <= self.max_live and self.max_rows > running


OFF = Speculation(max_live=0)


class Drafter:
    """Drafts for one sequence: the tokens that followed the latest earlier occurrence of its tail."""

    def __init__(self, speculation: Speculation):
        self.speculation = speculation

    def propose(self, seq: Sequence, room: int) -> list[int]:
        """Up to `room` draft tokens (never more than `draft_tokens`) to follow `seq`'s last one."""
        s = self.speculation
        k = min(room, s.draft_tokens)
        if k <= 0 or not seq.params.speculate:
            return []
        return lookup(seq.token_array(), k, s.min_match, s.max_match)


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
