"""The one scheduler: each step's sequences, admission, cancellation, and the step loop.

Each step is one batched forward. It holds a decode token per running sequence plus a bounded prefill chunk.
So a long prompt delays running streams by one chunk at most. A scoring call's longer labels run in label
rounds within the same budget. Sequences join at any step. A prompt arriving
mid-step joins the step under way (`admit.StepJoins`). A bounded queue refuses work at once (`Overloaded`).
One worker thread runs `step()`. `submit` and `cancel` are thread-safe.

Priorities: customers come first, then agent assist, then background work. The more urgent sequences are
admitted and prefilled first. Prompts other than customers' take at most a quarter of a step's prefill
budget. A customer waiting for a running place pauses a less urgent generation. It keeps its KV and resumes
where it stopped. A customer short of KV pauses one whose KV then waits in the cache (evictable). It resumes
from what is still there. Only the most urgent work evicts what idle sessions keep in the cache. A waiting
sequence's KV may not fit. Then later ones that fit go first for a bounded time
(`SchedulerLimits.skip_ahead_s`). After that they wait behind it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .admit import Admitter, Preemption, Queues, SchedulerLimits, StepJoins
from .backend import FinishReason, Overloaded, Priority, RequestTooLarge, SequenceResult
from .grammar import ConstraintError
from .kv import KVCacheManager
from .labels import rounds_of
from .plan import NO_JOINS, JoinSource, StepItem
from .sequence import Phase, Sequence
from .speculation import OFF, Drafter, Speculation
from .step import StepOutput

log = logging.getLogger("rtserver.scheduler")

SPLICE_WAIT_S = 2.0  # the longest a prompt waits for a segment's KV before computing the segment itself

# what a step reports of a sequence: a sampled token id, or its final result
StepEvent = tuple[Sequence, int | SequenceResult]


class Runner(Protocol):
    def execute(self, items: list[StepItem], joins: JoinSource = NO_JOINS) -> StepOutput: ...


@dataclass
class StepStats:
    decode_tokens: int
    prefill_tokens: int
    seconds: float


class Scheduler:
    def __init__(
        self,
        runner: Runner,
        kv: KVCacheManager,
        limits: SchedulerLimits,
        on_events: Callable[[list[StepEvent]], None] | None = None,
        speculation: Speculation = OFF,
    ):
        self.runner = runner
        self.drafter = Drafter(speculation)
        self.limits = limits
        self.on_events = on_events or (lambda events: None)
        self.queues = Queues(kv, limits)
        self.preemption = Preemption(self.queues)
        self.admission = Admitter(self.queues, self.preemption)
        self._cond = self.queues.cond
        self._stop = False
        self.steps = 0
        self.tokens_generated = 0
        self.tokens_prefilled = 0
        self.drafted = 0  # draft tokens checked (speculation.py), and those the sampler kept
        self.accepted = 0
        self.joined = 0  # sequences that joined a step under way (admit.StepJoins)
        # per priority, of the generations that produced a token: count, seconds queued, seconds to it
        self.latency: dict[Priority, list[float]] = {p: [0, 0.0, 0.0] for p in Priority}
        self._joins = StepJoins(self.admission)  # the join source of the step under way (see `plan`)
        self.last_step: StepStats | None = None
        self.fault_hook: Callable[[list[StepItem]], None] | None = None  # tests inject step failures

    @property
    def kv(self) -> KVCacheManager:
        return self.queues.kv

    @kv.setter
    def kv(self, kv: KVCacheManager) -> None:
        self.queues.kv = kv  # tests give an engine a smaller pool after it is built

    @property
    def waiting(self) -> deque[Sequence]:
        return self.queues.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.queues.running

    @property
    def paused(self) -> int:
        """Generations paused for a more urgent one (admit.Preemption)."""
        return self.preemption.paused

    # -- called from any thread -----------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        if seq.capacity_tokens > self.limits.max_sequence_tokens:
            raise RequestTooLarge(
                f"prompt ({len(seq.prompt_ids)} tokens) plus max_new_tokens "
                f"exceeds the {self.limits.max_sequence_tokens}-token limit"
            )
        if self.kv.blocks_for(seq.capacity_tokens) > self.kv.total_blocks:
            raise RequestTooLarge(
                f"request needs {seq.capacity_tokens} tokens of KV, more than the whole KV budget holds"
            )
        with self._cond:
            # Free running slots count as room too: those sequences are admitted at the next step.
            room = self.limits.max_waiting + max(0, self.limits.max_running - len(self.running))
            if len(self.waiting) >= room:
                raise Overloaded(f"{len(self.running)} running and {len(self.waiting)} waiting")
            self.waiting.append(seq)
            self._cond.notify()

    def spare(self) -> int:
        """How many more sequences the queue takes now."""
        with self._cond:
            room = self.limits.max_waiting + max(0, self.limits.max_running - len(self.running))
            return room - len(self.waiting)

    def cancel(self, seq: Sequence) -> None:
        with self._cond:
            seq.cancelled = True
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- the worker thread ----------------------------------------------------------------------
    def run_forever(self) -> None:
        while True:
            with self._cond:
                if self._stop:
                    break
                idle = not self.has_work
            # idle: the pool's next blocks are touched now, outside the queue's lock, so that steps do not
            # page-fault on them
            if idle and not self.kv.prefault():
                with self._cond:
                    while not self._stop and not self.has_work:
                        self._cond.wait()
            elif not idle:
                self.step()
        self._fail_all(FinishReason.CANCELLED, "server shutting down")

    def _fail_all(self, reason: FinishReason, message: str) -> None:
        events: list[StepEvent] = []
        with self._cond:
            doomed = list(self.running) + list(self.waiting)
            self.running.clear()
            self.waiting.clear()
        for seq in doomed:
            self._finish(seq, reason, events, error=message)
        self.on_events(events)

    def _finish(
        self, seq: Sequence, reason: FinishReason, events: list[StepEvent], error: str | None = None
    ) -> None:
        if seq.is_finished:
            return
        seq.finish_reason = seq.finish_reason or reason
        if error is not None:
            seq.finish_reason = reason
            seq.error = error
        seq.phase = Phase.FINISHED
        seq.finished_at = time.perf_counter()
        if seq.first_token_at is not None:
            figures = self.latency[seq.priority]
            figures[0] += 1
            figures[1] += (seq.admitted_at or seq.first_token_at) - seq.submitted_at
            figures[2] += seq.first_token_at - seq.submitted_at
        if seq.kv is None and seq.resume_key not in (None, seq.session_key):
            self.kv.drop_session(seq.resume_key)  # paused for KV and never resumed
        if seq.kv is not None:
            # A cancelled or failed turn keeps only KV that is known good (its computed tokens).
            seq.kv.token_ids = seq.all_ids[: seq.num_computed]
            self.kv.release(
                seq.kv, seq.session_key if error is None or reason is FinishReason.CANCELLED else None
            )
            seq.kv = None
        events.append((seq, seq.result()))

    def _admit(self, events: list[StepEvent]) -> None:
        """Waiting sequences into the running batch (admit.py); the cancelled ones end here."""
        self.admission.admit(lambda seq: self._finish(seq, FinishReason.CANCELLED, events))

    def plan(self, events: list[StepEvent]) -> list[StepItem]:
        """Admit what fits and drop what was cancelled. Then lay out this step's tokens."""
        for seq in [s for s in self.running if s.cancelled]:
            self.running.remove(seq)
            self._finish(seq, FinishReason.CANCELLED, events)
        self._admit(events)
        items = self._decodes()
        budget = self.limits.prefill_chunk_tokens
        # The more urgent prompts take the prefill budget first, and within a priority generation
        # prompts before scoring ones (task calls, auto-tasks): a burst of sentiment tags never delays
        # the first token of a reply someone is waiting for.
        # A scoring call's label rounds count against the same budget as prompts.
        prefilling = [s for s in self.running if s.phase in (Phase.PREFILL, Phase.LABELS)]
        prefilling.sort(key=lambda s: (s.priority, s.candidates is not None))  # stable: arrival order
        # Work for agents and the background takes a quarter of the budget at most, customers there or
        # not: a step stays short, so a customer's message that comes during it waits little. It has an
        # eighth more of its own, so that under steady customer load an assist call whose prompt is
        # mostly cached (a conversation's own KV) still gets its few tokens through in one step.
        spare = budget // 4
        floor = budget // 8
        for seq in prefilling:
            customer = seq.priority == Priority.CUSTOMER
            room = budget if customer else min(max(budget, 0) + floor, spare)
            if room <= 0:
                if customer:
                    continue  # the less urgent may still have their floor
                break
            item = _label_round(seq) if seq.phase is Phase.LABELS else self._prompt_chunk(seq, room)
            if item is None:
                continue  # it waits for a segment's KV
            n = len(item.tokens)
            if n > room:
                continue  # a label round runs whole, in a step with room for it
            if not customer:
                spare -= n
                floor -= max(0, n - max(budget, 0))
            budget -= n
            items.append(item)
        # what sequences joining mid-step may still prefill, and what the less urgent may take beyond it
        self._joins = StepJoins(self.admission, max(0, budget), max(0, floor), self.fault_hook)
        return items

    def _decodes(self) -> list[StepItem]:
        """A decode item per generating sequence: its last token, and drafts after it in a small step."""
        items: list[StepItem] = []
        decoding = [seq for seq in self.running if seq.phase is Phase.DECODE]
        spec = self.drafter.speculation
        spare = spec.max_rows - len(decoding) if spec.drafts_in(len(self.running)) else 0
        for seq in decoding:
            assert seq.kv is not None  # running sequences hold KV from admission until they finish
            # drafts stay within the sequence's token limit and KV: its run ends there at the latest
            room = min(spare, seq.params.max_new_tokens - len(seq.output_ids) - 1)
            drafts = self.drafter.propose(seq, room, len(decoding)) if room > 0 else []
            spare -= len(drafts)
            tokens = [seq.output_ids[-1], *drafts]
            logits = "all" if drafts else "last"
            items.append(StepItem(seq, seq.kv, seq.num_computed, tokens, logits, drafts=len(drafts)))
        return items

    def step(self) -> None:
        events: list[StepEvent] = []
        items = self.plan(events)
        if not items:
            self.on_events(events)
            if not events:
                time.sleep(0.001)  # waiting work that does not fit yet; let running ones finish
            return
        started = time.perf_counter()
        joins = self._joins
        try:
            out = self._execute(items, joins)
        except Exception:
            # Isolate the culprit: run each sequence's part of the step alone (rewriting the same KV
            # slots), so one bad sequence fails alone and the others go on.
            items += joins.joined
            log.warning("step failed for sequences %s; retrying them one by one", [it.seq.id for it in items])
            for it in items:
                self._run_guarded([it], events)
        else:
            items = out.items
            self._run_guarded(items, events, out)
        self.joined += len(joins.joined)
        self.steps += 1
        self.last_step = StepStats(
            sum(1 for it in items if it.seq.phase is Phase.DECODE),
            sum(len(it.tokens) for it in items),
            time.perf_counter() - started,
        )
        self.on_events(events)

    def _execute(self, items: list[StepItem], joins: JoinSource = NO_JOINS) -> StepOutput:
        if self.fault_hook is not None:
            self.fault_hook(items)
        return self.runner.execute(items, joins)

    def _run_guarded(
        self, items: list[StepItem], events: list[StepEvent], out: StepOutput | None = None
    ) -> None:
        """Execute (unless `out` is given) and apply `items`. A failure fails their sequences only, never
        the scheduler.
        """
        try:
            self._apply(out if out is not None else self._execute(items), events)
        except Exception as exc:
            log.exception("step failed for sequences %s", [it.seq.id for it in items])
            for it in items:
                if it.seq in self.running:
                    self.running.remove(it.seq)
                self._finish(
                    it.seq,
                    FinishReason.ERROR,
                    events,
                    error=f"internal error in model step ({type(exc).__name__})",
                )

    def _apply(self, out: StepOutput, events: list[StepEvent]) -> None:
        """The one place a step's output reaches its sequences. It carries computed positions, pooled
        features, label scores and sampled token ids. It also carries each sequence's own failures.
        """
        for i, it in enumerate(out.items):
            seq = it.seq
            if it.label is not None:
                self._apply_round(seq, it.label, out.rounds[i], out.errors[i], events)
                continue
            if it.drafts:
                self._apply_run(it, out.runs[i], out.errors[i], events)
                continue
            it.kv.token_ids.extend(seq.all_ids[seq.num_computed : it.end])  # spliced ids too
            seq.num_computed = it.end
            if seq.phase is Phase.PREFILL:
                self.tokens_prefilled += len(it.tokens)
                seq.usage.prefilled_tokens += len(it.tokens)
                # later prompts that start so share it (in its scope, if it has one)
                self.kv.register_prefix(it.kv, seq.shared_tokens, seq.cache_root)
            f = out.features[i]
            if f is not None:
                seq.pooled.add(f)
            error = out.errors[i]
            if error is not None:
                self._fail_alone(seq, events, *error)
            elif (scores := out.scores[i]) is not None:
                if f is not None:
                    seq.features = seq.pooled.vector(f)
                self._first_scores(seq, scores, events)
            elif (token := out.tokens[i]) is not None:
                seq.phase = Phase.DECODE
                self._append(seq, token, events)

    def _first_scores(self, seq: Sequence, scores: list[float], events: list[StepEvent]) -> None:
        """A scoring prompt is computed: done, or its longer candidates go on in label rounds."""
        assert seq.candidates is not None
        seq.scores = scores
        seq.label_rounds = rounds_of(seq.candidates)
        if seq.label_rounds:
            seq.phase = Phase.LABELS
        else:
            self.running.remove(seq)
            self._finish(seq, FinishReason.LENGTH, events)

    def _apply_round(
        self,
        seq: Sequence,
        label: int,
        value: float | None,
        error: tuple[str, Exception] | None,
        events: list[StepEvent],
    ) -> None:
        """One label round's log-probability added to its candidate's score."""
        if error is not None:
            self._fail_alone(seq, events, *error)
            return
        assert seq.scores is not None and value is not None
        seq.scores[label] += value
        seq.label_rounds.remove(label)
        if not seq.label_rounds:
            self.running.remove(seq)
            self._finish(seq, FinishReason.LENGTH, events)

    def _apply_run(
        self,
        it: StepItem,
        run: list[int] | None,
        error: tuple[str, Exception] | None,
        events: list[StepEvent],
    ) -> None:
        """A decode with drafts: the drafts the sampler kept, then its own next token. The kept drafts' K/V
        was computed in this step; the rest of the item's K/V is left to be written over."""
        seq = it.seq
        if error is not None:
            self._fail_alone(seq, events, *error)
            return
        assert run is not None and seq.kv is not None
        self.drafted += it.drafts
        self.accepted += len(run) - 1
        self.drafter.learn(seq, len(run) - 1, it.drafts)
        seq.kv.token_ids.append(it.tokens[0])
        seq.num_computed = it.start + 1
        for j, token in enumerate(run):
            self._append(seq, token, events)
            if seq.is_finished:
                return
            if j < len(run) - 1:  # a kept draft: computed
                seq.kv.token_ids.append(token)
                seq.num_computed += 1

    def _append(self, seq: Sequence, token: int, events: list[StepEvent]) -> None:
        try:
            seq.append_token(token)
        except ConstraintError as exc:
            self._fail_alone(seq, events, "structured output", exc)
            return
        self.tokens_generated += 1
        events.append((seq, token))
        if seq.finish_reason is not None:
            self.running.remove(seq)
            self._finish(seq, seq.finish_reason, events)

    def _fail_alone(self, seq: Sequence, events: list[StepEvent], stage: str, exc: BaseException) -> None:
        """End one sequence whose own work after the forward raised. The step's others go on."""
        log.error("sequence %s failed in %s", seq.id, stage, exc_info=exc)
        if seq in self.running:
            self.running.remove(seq)
        self._finish(
            seq, FinishReason.ERROR, events, error=f"internal error in {stage} ({type(exc).__name__})"
        )

    def _prompt_chunk(self, seq: Sequence, room: int) -> StepItem | None:
        """The next at most `room` tokens of a prompt (a resumed generation's: its output too). Segments on
        the way are spliced in, so the item's positions may have gaps. None: nothing to compute yet, its
        next segment's KV is still being computed.
        """
        if not seq.splices:
            return _prompt_chunk(seq, room)
        assert seq.kv is not None
        ids, end = seq.all_ids, seq.num_tokens
        pos, positions = seq.num_computed, list[int]()
        pieces: list[tuple[int, int, torch.Tensor]] = []  # segments to copy in: at, from, slots
        while pos < end and len(positions) < room:
            splice = seq.splices.get(pos)
            if splice is not None and splice.producer is not None and not splice.producer.is_finished:
                if self._may_wait(seq, splice.producer):
                    break
                del seq.splices[pos]  # waiting could hold places its producer needs: computed here instead
                splice = None
            slots = (
                None
                if splice is None
                else self.kv.segment_slots(splice.key, ids[: splice.src], ids[pos : splice.end])
            )
            if splice is not None and slots is not None:
                pieces.append((pos, splice.src, slots))
                pos = splice.end
                if not positions:  # nothing computed before it: the sequence's KV now reaches past it
                    seq.kv.token_ids.extend(ids[seq.num_computed : pos])
                    seq.num_computed = pos
                continue
            seq.splices.pop(pos, None)  # none, or its entry is gone: computed
            positions.append(pos)
            pos += 1
        if pieces:
            self.kv.splice(seq.kv, pieces)
        if not positions:
            return None
        tokens = [ids[p] for p in positions]
        logits = "last" if pos == end else "none"
        gaps = positions[-1] - positions[0] + 1 != len(positions)
        return StepItem(seq, seq.kv, positions[0], tokens, logits, positions=positions if gaps else None)

    @staticmethod
    def _may_wait(seq: Sequence, producer: Sequence) -> bool:
        """Whether a sequence may wait for a segment's producer: while it runs, for a bounded time."""
        waited = time.perf_counter() - (seq.admitted_at or seq.submitted_at)
        return producer.phase is not Phase.WAITING and waited < SPLICE_WAIT_S


def _prompt_chunk(seq: Sequence, room: int) -> StepItem:
    """The next at most `room` tokens of a prompt (a resumed generation's: its output too)."""
    assert seq.kv is not None
    remaining = seq.num_tokens - seq.num_computed
    n = min(remaining, room)
    done = n == remaining
    tokens = seq.all_ids[seq.num_computed : seq.num_computed + n]
    logits, columns = ("last", seq.score_columns) if done else ("none", None)
    return StepItem(seq, seq.kv, seq.num_computed, tokens, logits, columns, seq.features_from)


def _label_round(seq: Sequence) -> StepItem:
    """The next label round: a longer candidate teacher-forced past the prompt."""
    assert seq.kv is not None and seq.candidates is not None
    label = seq.label_rounds[0]
    return StepItem(seq, seq.kv, seq.num_computed, seq.candidates[label][:-1], "all", label=label)
