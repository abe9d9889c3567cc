"""Admitting: which waiting sequences take a running place, and whom a more urgent one displaces.

`Queues` holds the waiting queue and the running batch under one lock. `Admitter` moves waiting
sequences into the batch when their KV fits, the most urgent first. `Preemption` makes room for a
customer: it pauses a less urgent generation, which keeps its KV, or evicts that KV to the cache.
`StepJoins` admits prompts that arrive mid-step into the step under way.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import EngineSettings
from .backend import Priority
from .kv import KVCacheManager, OutOfKVMemory
from .plan import StepItem
from .sequence import Phase, Sequence

# less urgent work than customers' may evict idle KV while it holds under 1/EVICT_SHARE of the pool
EVICT_SHARE = 16


@dataclass
class SchedulerLimits:
    max_running: int
    max_waiting: int
    prefill_chunk_tokens: int
    max_sequence_tokens: int
    skip_ahead_s: float = 10.0  # how long a waiting sequence short of KV lets later ones go first

    @classmethod
    def from_settings(cls, s: EngineSettings, max_positions: int | None = None) -> SchedulerLimits:
        """The [engine] settings; a sequence also stays within the model's positions."""
        longest = (
            s.max_sequence_tokens if max_positions is None else min(s.max_sequence_tokens, max_positions)
        )
        return cls(s.max_running, s.max_waiting, s.prefill_chunk_tokens, longest, s.skip_ahead_s)


@dataclass
class Queues:
    """The waiting queue and the running batch, and the lock over both."""

    kv: KVCacheManager
    limits: SchedulerLimits
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def places(self) -> dict[bool, int]:
        """Free running places, for generations (False) and label-scoring calls (True) apart.

        A scoring call only prefills and never decodes. So a burst of auto-task calls never keeps
        the next chat turn out of the batch, nor chats the calls. Each kind has `max_running` places.
        """
        scoring = sum(1 for s in self.running if s.candidates is not None)
        limit = self.limits.max_running
        return {False: limit - (len(self.running) - scoring), True: limit - scoring}

    def may_skip(self, seq: Sequence, now: float) -> bool:
        """Whether later waiting sequences may go before `seq`, whose KV does not fit now.

        A small request is not stuck behind a big one, as in vLLM's and TGI's schedulers. Only for
        `skip_ahead_s` after its arrival: then running sequences free blocks for it, so it never starves.
        """
        return now - seq.submitted_at < self.limits.skip_ahead_s


class Preemption:
    """Room for a more urgent sequence: a less urgent running generation goes back to waiting."""

    def __init__(self, queues: Queues):
        self.queues = queues
        self.paused = 0  # generations paused for a more urgent one

    def victim(self, priority: int) -> Sequence | None:
        """The least urgent, latest admitted running generation less urgent than `priority`."""
        victims = [s for s in self.queues.running if s.candidates is None and s.priority > priority]
        return max(victims, key=lambda s: (s.priority, s.admitted_at or 0.0), default=None)

    def pause(self, priority: int) -> bool:
        """Move `victim(priority)` back to waiting; it keeps its KV and computed tokens.

        False: none to pause.
        """
        victim = self.victim(priority)
        if victim is None:
            return False
        self.queues.running.remove(victim)
        self.queues.waiting.appendleft(victim)
        self.paused += 1
        return True

    def evict(self, priority: int) -> bool:
        """Pause `victim(priority)` and put its KV in the cache, under a key of its own.

        The cached KV is evictable, like an idle session's. The victim resumes from what is still
        cached and computes the rest again. False: none to pause.
        """
        victim = self.victim(priority)
        if victim is None:
            return False
        assert victim.kv is not None
        q = self.queues
        q.running.remove(victim)
        victim.kv.token_ids = victim.all_ids[: victim.num_computed]
        victim.resume_key = victim.session_key if victim.session_key is not None else ("paused", victim.id)
        q.kv.release(victim.kv, victim.resume_key)
        victim.kv = None
        victim.phase = Phase.PREFILL  # what the cache lost is computed again, then it decodes on
        q.waiting.appendleft(victim)
        self.paused += 1
        return True


class Admitter:
    """Waiting sequences into the running batch, the most urgent first, while their KV fits."""

    def __init__(self, queues: Queues, preemption: Preemption):
        self.queues = queues
        self.preemption = preemption
        self.urgent = Priority.CUSTOMER  # the most urgent priority with work, as of the last admission

    def admit(self, cancelled: Callable[[Sequence], None]) -> None:
        """Admit in priority order (arrival order within one); cancelled ones go to `cancelled`.

        A generation without a place pauses a less urgent running one. One whose KV does not fit
        lets the later ones that fit go first (see `Queues.may_skip`).
        """
        q = self.queues
        with q.cond:
            now = time.perf_counter()
            places = q.places()
            # only the most urgent work may evict what idle sessions keep in the cache
            self.urgent = min((s.priority for s in (*q.running, *q.waiting)), default=Priority.CUSTOMER)
            for seq in sorted(q.waiting, key=lambda s: s.priority):
                if seq.cancelled:
                    q.waiting.remove(seq)
                    cancelled(seq)
                    continue
                scoring = seq.candidates is not None
                if places[scoring] <= 0 and not (not scoring and self.preemption.pause(seq.priority)):
                    continue
                places[scoring] = max(places[scoring], 1)
                if not self.admit_one(seq) and not (
                    not scoring and self.preemption.evict(seq.priority) and self.admit_one(seq)
                ):
                    if q.may_skip(seq, now):
                        continue
                    break  # the later ones wait with it for running sequences to free blocks
                places[scoring] -= 1

    def may_evict(self, seq: Sequence) -> bool:
        """Whether `seq` may evict idle KV to fit.

        The most urgent work may. Less urgent work may while what such work holds stays under a
        share of the pool: under steady customer load no block is ever free, and it would wait
        until the customers stop.
        """
        if seq.priority <= self.urgent:
            return True
        q = self.queues
        held = sum(len(s.kv.blocks) for s in q.running if s.kv is not None and s.priority > Priority.CUSTOMER)
        return held < q.kv.total_blocks // EVICT_SHARE

    def admit_one(self, seq: Sequence) -> bool:
        """Move a waiting sequence to running if its KV fits.

        The caller holds the lock and has checked there is a running place. A paused sequence
        already holds its KV and goes on where it stopped.
        """
        q = self.queues
        if seq.kv is not None:
            q.waiting.remove(seq)
            q.running.append(seq)
            return True
        resumed = seq.resume_key is not None  # paused for KV: what is still cached, then the rest again
        ids = seq.all_ids if resumed else seq.prompt_ids
        try:
            seq.kv, reused = q.kv.acquire(
                ids,
                seq.capacity_tokens,
                seq.resume_key if resumed else seq.session_key,
                None if resumed else seq.features_from,
                0 if resumed else seq.shared_tokens,
                evict=self.may_evict(seq),
                root=0 if resumed else seq.cache_root,
                fork=None if resumed else seq.fork_session,
            )
        except OutOfKVMemory:
            return False
        q.waiting.remove(seq)
        seq.num_computed = reused
        seq.kv.token_ids = ids[:reused]
        block = seq.inserted
        if block is not None and block[0] >= reused and block not in seq.kv.inserted:
            seq.kv.inserted.append(block)  # the next turn may leave it out (KVCacheManager._from_session)
        if resumed:
            seq.resume_key = None
        else:
            seq.usage.cached_tokens = reused
            seq.phase = Phase.PREFILL
            seq.admitted_at = time.perf_counter()
        q.running.append(seq)
        return True


class StepJoins:
    """The join source of one step: prompts arriving mid-step that fit what is left of its budget.

    Their first token then comes out with this step's tokens instead of a whole step later.
    Generation prompts join in queue order; scoring calls wait for the next step. A customer
    prompt too long for this step keeps later customers' from joining; it is still admitted, for
    the next step. Less urgent prompts may also take what is left of the plan's floor for them.
    """

    def __init__(
        self,
        admission: Admitter,
        budget: int = 0,
        floor: int = 0,
        check: Callable[[list[StepItem]], None] | None = None,
    ):
        self.admission = admission
        self.budget = budget  # prefill tokens the step may still take
        self.floor = floor  # those that only less urgent work may take (see Scheduler.plan)
        self.check = check  # tests inject failures: the joiners' catch-up is a model forward too
        self.joined: list[StepItem] = []  # what joined, in order

    def take(self, layer: int) -> list[StepItem]:
        items: list[StepItem] = []
        q = self.admission.queues
        if not q.waiting or self.budget + self.floor <= 0:  # the common case, unlocked
            return items
        with q.cond:
            places = q.places()[False]
            blocked = False  # a customer's prompt too long for this step: later ones wait behind it
            for seq in sorted(q.waiting, key=lambda s: s.priority):
                if seq.candidates is not None or seq.kv is not None or seq.resume_key is not None:
                    continue  # scoring calls have places of their own, paused ones resume next step
                if seq.cancelled or seq.features_from is not None or seq.splices or places <= 0:
                    break
                customer = seq.priority == Priority.CUSTOMER
                if customer and blocked:
                    continue
                if not self.admission.admit_one(seq):
                    if q.may_skip(seq, time.perf_counter()):
                        continue
                    break
                places -= 1
                assert seq.kv is not None
                remaining = len(seq.prompt_ids) - seq.num_computed
                if remaining > self.budget + (0 if customer else self.floor):
                    if customer:  # admitted: its prefill starts next step
                        blocked = True
                        continue
                    break
                if not customer:
                    self.floor -= max(0, remaining - self.budget)
                self.budget = max(0, self.budget - remaining)
                items.append(
                    StepItem(seq, seq.kv, seq.num_computed, seq.prompt_ids[seq.num_computed :], "last")
                )
        if items:
            if self.check is not None:
                self.check(items)
            self.joined += items
            # Once per step: the joiners' catch-up is a pass of its own over the layers done, so a
            # burst of arrivals catches up together (the rest wait for the next step, already admitted).
            self.budget = self.floor = 0
        return items
