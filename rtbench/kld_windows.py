"""A text's token ids cut into windows as llama-perplexity cuts them, and which positions each one scores.

Window w holds ids[w * n_ctx : (w + 1) * n_ctx] (the ids past the last whole window are left out). Where
the model's tokenizer puts BOS first, the window's first id is replaced by it as the model sees it (the
base file keeps the text's id). The next-token distributions of positions n_ctx // 2 .. n_ctx - 2 are
scored: the second half of the window, every position with at least n_ctx / 2 ids before it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Windows:
    ids: list[int]
    n_ctx: int
    bos: int | None = None  # the id the model sees first in every window; None: the text's own

    def __post_init__(self) -> None:
        if self.n_ctx < 4 or self.n_ctx % 2:
            raise ValueError(f"n_ctx = {self.n_ctx}: an even window of at least 4 ids")
        if self.count == 0:
            raise ValueError(f"{len(self.ids)} token ids make no window of {self.n_ctx}")

    @property
    def count(self) -> int:
        return len(self.ids) // self.n_ctx

    @property
    def first(self) -> int:
        """The first scored position of a window."""
        return self.n_ctx // 2

    @property
    def scored(self) -> int:
        """Scored positions per window: first .. n_ctx - 2 (the last position has no next id)."""
        return self.n_ctx - 1 - self.first

    @property
    def tokens_scored(self) -> int:
        return self.count * self.scored

    def tokens(self, w: int) -> list[int]:
        """Window w's ids as the text has them (what the base file records)."""
        if not 0 <= w < self.count:
            raise IndexError(f"window {w} of {self.count}")
        return self.ids[w * self.n_ctx : (w + 1) * self.n_ctx]

    def inputs(self, w: int) -> list[int]:
        """Window w's ids as the model sees them: BOS first where the model takes one."""
        ids = self.tokens(w)
        return ids if self.bos is None else [self.bos, *ids[1:]]

    def all_tokens(self) -> list[list[int]]:
        return [self.tokens(w) for w in range(self.count)]
