"""Sequence state: one piece of model work (a chat turn, a task call) from submission to its end.

A sequence owns its prompt, decoding parameters, KV handle, output constraint and generated token
ids; it ends on an EOS id, a complete structured output or its token limit. Text and stop strings
are the output side's (detokenizer.py).
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import torch

from .backend import FinishReason, SamplingParams, SequenceResult, Usage
from .features import PooledFeatures
from .grammar import FREE, Constraint
from .kv import KVHandle, SegmentKey

PRIOR_RATE = 0.6  # a sequence's kept-draft rate before its first drafts are checked (speculation.py)


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    LABELS = "labels"  # prompt computed; its longer candidates teacher-forced, one a step
    FINISHED = "finished"


_ids = itertools.count(1)


@dataclass
class Splice:
    """A prompt segment whose KV is copied from its own entry, computed once (see backend.Inserted)."""

    end: int  # the segment is positions [its start, end)
    key: SegmentKey
    src: int  # where the segment's ids start in that entry: after the prompt's public tokens
    producer: Sequence | None = None  # the sequence computing the entry, until it ends


class Sequence:
    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        eos_token_ids: set[int],
        session_key: Hashable | None = None,
        candidates: list[list[int]] | None = None,
        public_tokens: int = 0,
        prefix_scope: int | None = None,
        fork_session: Hashable | None = None,
    ):
        if not prompt_ids:
            raise ValueError("empty prompt")
        whole = isinstance(public_tokens, int) and not isinstance(public_tokens, bool)
        if not (whole and 0 <= public_tokens <= len(prompt_ids)):
            raise ValueError(f"public_tokens = {public_tokens!r}: the prompt has {len(prompt_ids)} tokens")
        self.id = next(_ids)
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.eos_token_ids |= set(params.stop_token_ids)
        self.session_key = session_key
        self.priority = params.priority
        # leading prompt tokens the server wrote: the only ones shared with other sessions' prompts
        self.public_tokens = public_tokens
        # A scope of its own (one call's samples): the whole prompt is shared, only within the scope.
        self.cache_root = 0 if prefix_scope is None else hash(("scope", prefix_scope)) or 1
        self.shared_tokens = public_tokens if prefix_scope is None else len(prompt_ids)
        self.fork_session = fork_session  # a conversation whose KV its prompt may start from (assist)
        self.inserted: tuple[int, int] | None = None  # a block held for this turn only (backend.Inserted)
        self.splices: dict[int, Splice] = {}  # by start position: segments whose KV is copied in
        self.constraint: Constraint = FREE  # the tokens its output format allows (grammar.py)
        self.candidates = candidates  # label scoring: score these continuations, generate nothing
        # Label scoring that only needs scores up to a constant shared by all candidates: the logits of
        # these token ids (the candidates' first tokens) instead of a log-softmax over the vocabulary.
        self.score_columns: list[int] | None = None
        # Hidden-state features of a scoring prompt (a learned head's input): the final hidden state at
        # the prompt's last token and the pool layers' means over positions from `features_from` on.
        self.features_from: int | None = None
        self.pooled = PooledFeatures()  # their parts, gathered over the prompt's chunks
        self.features: list[float] | None = None
        self.phase = Phase.WAITING
        self.kv: KVHandle | None = None
        self.resume_key: Hashable | None = None  # paused for KV: where its KV waits in the cache
        self.num_computed = 0  # prompt/output positions whose KV is in the cache
        self.output_ids: list[int] = []
        self.usage = Usage(prompt_tokens=len(prompt_ids))
        self.cancelled = False
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.scores: list[float] | None = None
        self.label_rounds: list[int] = []  # candidates still to teacher-force (Phase.LABELS)
        self._generator: torch.Generator | None = None  # see generator()
        self.draft_rate = PRIOR_RATE  # how often its drafts are kept (speculation.Drafter.learn)
        self._array = np.empty(0, dtype=np.int64)  # see token_array()
        self._in_array = 0
        self.submitted_at = time.perf_counter()
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    # -- the token list the model sees --------------------------------------------------------
    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_array(self) -> np.ndarray:
        """The prompt and output ids as one array, grown as tokens come: the drafter reads it each step."""
        n = self.num_tokens
        if self._in_array > n:
            self._in_array = 0  # output taken back: fill again
        if n > len(self._array):
            grown = np.empty(max(n, 2 * len(self._array), 64), dtype=np.int64)
            grown[: self._in_array] = self._array[: self._in_array]
            self._array = grown
        if self._in_array < len(self.prompt_ids):
            self._array[: len(self.prompt_ids)] = self.prompt_ids
            self._in_array = len(self.prompt_ids)
        if self._in_array < n:
            self._array[self._in_array : n] = self.output_ids[self._in_array - len(self.prompt_ids) :]
            self._in_array = n
        return self._array[:n]

    @property
    def capacity_tokens(self) -> int:
        if self.candidates is not None:  # room to teacher-force the longest candidate after the prompt
            return len(self.prompt_ids) + max(len(c) for c in self.candidates) - 1
        return len(self.prompt_ids) + self.params.max_new_tokens

    @property
    def is_finished(self) -> bool:
        return self.phase is Phase.FINISHED

    def generator(self) -> torch.Generator | None:
        """Where the sampler draws from when a seed is given (its state advances with each draw). Made
        at the first draw, so a seed torch refuses fails that draw: this sequence alone."""
        if self.params.seed is not None and self._generator is None:
            self._generator = torch.Generator().manual_seed(self.params.seed)
        return self._generator

    # -- output -------------------------------------------------------------------------------
    def append_token(self, token_id: int) -> None:
        """Record a generated token; an EOS id, a complete structured output or the token limit sets
        the finish reason. Raises ConstraintError for a token its grammar does not allow."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.output_ids.append(token_id)
        self.usage.generated_tokens = len(self.output_ids)
        if token_id in self.eos_token_ids or self.constraint.advance(token_id):
            self.finish_reason = FinishReason.EOS
        elif len(self.output_ids) >= self.params.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH

    def result(self) -> SequenceResult:
        end = self.finished_at or time.perf_counter()
        start = self.submitted_at
        return SequenceResult(
            text="",  # the output side's (Detokenizer)
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason or FinishReason.ERROR,
            usage=self.usage,
            queued_ms=((self.admitted_at or end) - start) * 1000,
            ttft_ms=None if self.first_token_at is None else (self.first_token_at - start) * 1000,
            total_ms=(end - start) * 1000,
            error=self.error,
            scores=self.scores,
            features=self.features,
            priority=self.priority,
        )
