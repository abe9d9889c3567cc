"""The step plan: what the scheduler asks the model runner to compute in one forward.

Its own module, so the scheduler (who decides) and the runner (who computes) meet on neutral
ground. A step is its items and a `JoinSource`: prompts that arrive mid-step may join it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .kv import KVHandle
from .sequence import Sequence


@dataclass
class StepItem:
    """Tokens of one sequence computed in this step: positions start..start+len(tokens)-1, or `positions`."""

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
    # A label round: teacher-force candidate `label` past the prompt (its log-probabilities, added to its
    # score). Its KV is scratch room reserved at admission, never kept.
    label: int | None = None
    # Positions with gaps, where spliced KV sits between computed tokens; None = start.. in a row.
    positions: list[int] | None = None
    # A decode's draft tokens after its last one (speculation.py): logits "all", checked by the sampler.
    drafts: int = 0

    @property
    def end(self) -> int:
        """One past the item's last position."""
        return self.positions[-1] + 1 if self.positions else self.start + len(self.tokens)

    def position_list(self) -> list[int]:
        return self.positions if self.positions is not None else list(range(self.start, self.end))


class JoinSource(Protocol):
    """Where items joining a step under way come from; the runner asks before each layer but the first."""

    def take(self, layer: int) -> list[StepItem]:
        """Items that join before `layer`: whole prompts, logits "last", no pooled features."""
        ...


class NoJoins:
    """The join source of a step that nothing joins."""

    def take(self, layer: int) -> list[StepItem]:
        return []


NO_JOINS = NoJoins()
