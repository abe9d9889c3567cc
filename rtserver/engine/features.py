"""The learned head's features: what a scoring prompt's forward keeps of its hidden states.

One vector a prompt: the final hidden state at its last token, each pool layer's mean over the
positions from `features_from` on, then each last layer's state at the last token. The runner
taps its layers (`FeatureTaps`); a sequence gathers its chunks' parts (`PooledFeatures`).
Sums over rows: no extra tokens or matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class PoolingItem(Protocol):
    """What the taps read of a step item (plan.StepItem; not imported: a sequence holds features)."""

    start: int
    tokens: list[int]
    logits: str
    pool_from: int | None


@dataclass(frozen=True)
class FeatureLayers:
    """The layers a learned head reads (see backend.FeatureScorer)."""

    pool: tuple[int, ...]  # their means over the message
    last: tuple[int, ...]  # their state at the prompt's last token

    @classmethod
    def of(cls, n_layers: int) -> FeatureLayers:
        """Chosen on the sentiment dev splits (docs/sentiment-research.md).

        Every second layer's mean below the last (its rows are cut before its MLP), and an early
        layer's last token (a sixth of the way up), beside the final hidden state.
        """
        return cls(tuple(range(0, n_layers - 1, 2)) or (0,), (n_layers // 6,))


@dataclass
class Features:
    """Hidden-state features of one item in one step (a learned head's input), float32."""

    rows: int = 0  # rows pooled: the item's positions from pool_from on
    sums: list[torch.Tensor] = field(default_factory=list)  # per pool layer, the sum over those rows
    # with logits: the final hidden state at the item's last row, then per last layer
    last: list[torch.Tensor] | None = None

    def final(self, state: torch.Tensor) -> None:
        """The final (normed) hidden state at the item's last row, first of the `last` states."""
        if self.last is not None:
            self.last.insert(0, state.float())


class FeatureTaps:
    """What one group of a step's rows gives its items' features, layer by layer."""

    def __init__(self, layers: FeatureLayers):
        self.layers = layers
        self._pooling: list[tuple[list[torch.Tensor], int, int]] = []  # (sums, first row, end)
        self._lasts: list[tuple[list[torch.Tensor], int]] = []  # (states, row)

    def item(self, it: PoolingItem, first_row: int) -> Features | None:
        """The features of an item whose rows start at `first_row`; None if it pools nothing.

        It pools its positions from `pool_from` on, and with logits keeps its last row's states.
        """
        if it.pool_from is None:
            return None
        f = Features()
        skip = max(0, it.pool_from - it.start)
        end = first_row + len(it.tokens)
        if skip < len(it.tokens):
            f.rows = len(it.tokens) - skip
            self._pooling.append((f.sums, first_row + skip, end))
        if it.logits == "last":
            f.last = []
            self._lasts.append((f.last, end - 1))
        return f

    def after(self, layer: int, x: torch.Tensor) -> None:
        """Read layer `layer`'s output rows `x`."""
        if layer in self.layers.pool:
            for sums, a, b in self._pooling:
                sums.append(x[a:b].float().sum(0))
        if layer in self.layers.last:
            for states, r in self._lasts:
                states.append(x[r].float())


class PooledFeatures:
    """A scoring sequence's features, gathered over the chunks of its prompt."""

    def __init__(self) -> None:
        self.sum: torch.Tensor | None = None
        self.rows = 0

    def add(self, f: Features) -> None:
        if f.sums:
            total = torch.cat(f.sums)
            self.sum = total if self.sum is None else self.sum + total
            self.rows += f.rows

    def vector(self, f: Features) -> list[float] | None:
        """The head's input, from the prompt's last chunk `f`: final state, means, last states."""
        if f.last is None or self.sum is None:
            return None
        return torch.cat([f.last[0], self.sum / self.rows, *f.last[1:]]).tolist()
