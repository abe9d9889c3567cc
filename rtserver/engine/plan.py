"""The step plan: what the scheduler asks the model runner to compute in one forward. Its own module
so that the scheduler (who decides) and the runner (who computes) meet on neutral ground."""

from __future__ import annotations

from dataclasses import dataclass

from .kv import KVHandle
from .sequence import Sequence


@dataclass
class StepItem:
    """Tokens of one sequence computed in this step: positions start..start+len(tokens)-1."""

    seq: Sequence
    kv: KVHandle  # where this item's context lives
    start: int
    tokens: list[int]
    logits: str  # "last" | "all" | "none"
    # Only these vocabulary columns of the logits (label scoring reads a few token ids: a gather of those
    # rows of the output embedding instead of the whole-vocabulary matmul). None = the full rows.
    columns: list[int] | None = None
    # Hidden-state features (a learned head's input): pool the pool layers over this item's positions from
    # `pool_from` on (the step's output carries them: step.Features).
    pool_from: int | None = None
