"""The KL divergence of a model's next-token distributions from a reference's, as llama-perplexity counts it.

Per scored position: KL(reference || model) = sum over the vocabulary of p_ref * (log p_ref - log p_model),
summed only where log p_ref > -16 (llama-perplexity's cut: the rest weigh under 1e-7 each), and whether both
put the same token first (the first index of the largest value, as its loops pick it). `Divergence` gathers
rows and gives the mean, the percentiles and the top-1 agreement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .stats import mean, percentile

Array = npt.NDArray[Any]
LOG_PROB_CUT = -16.0  # reference terms at or below this log-probability are left out, as llama.cpp does
ROWS_AT_ONCE = 32  # float64 copies of a 262,144-entry vocabulary: 2 MB a row each


def log_softmax(logits: Array) -> Array:
    """Log-probabilities of each row of logits, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)
    out: Array = x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))
    return out


def row_divergences(reference_log_probs: Array, logits: Array) -> tuple[Array, Array]:
    """Per row: KL(reference || softmax(logits)) and whether both rank the same token first.
    `reference_log_probs` are log-probabilities (rows summing to one in probability), `logits` any scale.
    """
    ref = np.asarray(reference_log_probs, dtype=np.float64)
    ours = log_softmax(logits)
    if ref.shape != ours.shape:
        raise ValueError(f"reference rows {ref.shape} and model rows {ours.shape} differ")
    kept = ref > LOG_PROB_CUT
    terms = np.where(kept, np.exp(np.where(kept, ref, 0.0)) * (ref - ours), 0.0)
    same_top = ref.argmax(axis=-1) == ours.argmax(axis=-1)
    return terms.sum(axis=-1), same_top


@dataclass
class Divergence:
    """The per-position divergences of one model against the reference, gathered window by window."""

    values: list[float] = field(default_factory=list)
    same_top: int = 0

    def add(self, reference_log_probs: Array, logits: Array) -> None:
        for at in range(0, len(logits), ROWS_AT_ONCE):
            rows = slice(at, at + ROWS_AT_ONCE)
            kld, same = row_divergences(reference_log_probs[rows], logits[rows])
            self.values += kld.tolist()
            self.same_top += int(same.sum())

    @property
    def count(self) -> int:
        return len(self.values)

    def summary(self) -> dict[str, Any]:
        """Mean, median, p99 and largest KLD (linear interpolation between ranks, as llama-perplexity
        prints them), top-1 agreement, and the positions counted. None where no position was.
        """
        n = self.count
        return {
            "mean_kld": mean(self.values),
            "median_kld": percentile(self.values, 0.5),
            "p99_kld": percentile(self.values, 0.99),
            "max_kld": max(self.values, default=None),
            "top1_agreement": self.same_top / n if n else None,
            "tokens_scored": n,
        }
