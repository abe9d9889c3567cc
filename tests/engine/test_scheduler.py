"""Scheduler logic without a model: a fake runner returns fixed logits, as vLLM tests its scheduler."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from rtserver.config import EngineSettings
from rtserver.engine.backend import FinishReason, Overloaded, Priority, RequestTooLarge, SamplingParams
from rtserver.engine.kv import KVCacheManager, SegmentKey
from rtserver.engine.plan import NO_JOINS, JoinSource, StepItem
from rtserver.engine.sampler import Sampler
from rtserver.engine.scheduler import Scheduler, SchedulerLimits
from rtserver.engine.sequence import Phase, Sequence, Splice
from rtserver.engine.speculation import Drafter, Speculation
from rtserver.engine.step import Forward, StepRunner

VOCAB = 32


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


class FakeRunner:
    """Always predicts token (position % VOCAB); records every step's plan. Label scoring is the real
    one (StepRunner's LabelScorer), over this fake forward; sampling is greedy (`Argmax`)."""

    def __init__(self):
        self.steps: list[list[tuple[int, int, int]]] = []  # (seq id, start, n tokens)
        # What "another thread" does while a step runs, before the layer it is keyed by (submit, cancel).
        self.during_step: dict[int, Callable[[], object]] = {}

    def run(self, items: list[StepItem], joins: JoinSource = NO_JOINS) -> Forward:
        planned = len(items)
        items = list(items)
        for layer, happens in sorted(self.during_step.items()) if joins is not NO_JOINS else ():
            happens()
            items.extend(joins.take(layer))  # the real runner asks before every layer but the first
        self.steps.append([(it.seq.id, it.start, len(it.tokens)) for it in items])
        out = []
        for it in items:
            if it.logits == "none":
                out.append(None)
                continue
            n = len(it.tokens) if it.logits == "all" else 1
            logits = torch.zeros(n, VOCAB)
            for r in range(n):
                logits[r, (it.start + len(it.tokens) - n + r + 1) % VOCAB] = 1.0
            out.append(logits)
        return Forward(out, [None] * len(out), items[planned:])

    def forward(self, items: list[StepItem]) -> list[torch.Tensor | None]:
        return self.run(items).logits


class Argmax:
    def sample(self, seqs, logits):
        return [int(row.argmax()) for row in logits]


def with_limits(**changes) -> SchedulerLimits:
    """The default [engine] limits with `changes`."""
    return dataclasses.replace(SchedulerLimits.from_settings(EngineSettings()), **changes)


def make(limits=None, blocks=64, block_tokens=4):
    kv = KVCacheManager(
        num_layers=1,
        kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        budget_bytes=(blocks + 1) * block_tokens * 2 * 2 * 4,
        block_tokens=block_tokens,
    )
    runner = FakeRunner()
    events = []
    sched = Scheduler(
        StepRunner(runner, Argmax()),
        kv,
        limits or with_limits(max_running=4, max_waiting=4, prefill_chunk_tokens=8),
        events.extend,
    )
    return sched, runner, kv, events


def seq(n_prompt, n_new, start=100):
    return Sequence(
        list(range(start, start + n_prompt)),
        SamplingParams(max_new_tokens=n_new),
        eos_token_ids=set(),
    )


def scoring_seq(n_prompt, start):
    """A label-scoring call: scores two one-token labels after its prompt, generates nothing."""
    return Sequence(
        list(range(start, start + n_prompt)),
        SamplingParams(max_new_tokens=1),
        eos_token_ids=set(),
        candidates=[[5], [7]],
    )


def run_until_idle(sched, limit=200):
    for _ in range(limit):
        if not sched.has_work:
            return
        sched.step()
    raise AssertionError("scheduler did not finish")


def test_long_prompt_is_chunked_and_decodes_keep_running():
    sched, runner, kv, _ = make()
    short = seq(3, 10)
    sched.submit(short)
    sched.step()  # short prefilled in one step
    long = seq(30, 2, start=200)
    sched.submit(long)
    run_until_idle(sched)
    for step in runner.steps:
        assert sum(n for _, _, n in step) <= 8 + 1  # chunk budget + one decode token
    # while the long prompt prefilled (4 chunks), the short sequence decoded in every one of those steps
    long_steps = [s for s in runner.steps if any(sid == long.id for sid, _, _ in s)]
    assert len([s for s in long_steps if any(sid == short.id for sid, _, _ in s)]) >= 3
    assert short.result().finish_reason is FinishReason.LENGTH and len(short.output_ids) == 10


def test_sequences_join_at_any_step_without_waiting_for_a_batch():
    sched, runner, _, _ = make()
    a = seq(4, 6)
    sched.submit(a)
    sched.step()
    sched.step()
    b = seq(4, 3, start=300)
    sched.submit(b)
    sched.step()
    assert {sid for sid, _, _ in runner.steps[-1]} == {a.id, b.id}
    run_until_idle(sched)
    assert len(a.output_ids) == 6 and len(b.output_ids) == 3


def test_a_prompt_arriving_during_a_step_joins_that_step():
    """Its first token comes out with the step under way, not one step later."""
    sched, runner, _, _ = make()
    a = seq(4, 6)
    sched.submit(a)
    sched.step()  # a prefilled, decoding from now on
    b = seq(3, 2, start=300)
    runner.during_step = {1: lambda: sched.submit(b)}
    sched.step()
    runner.during_step = {}
    assert runner.steps[-1] == [(a.id, 4, 1), (b.id, 0, 3)]
    assert b.output_ids == [3] and len(a.output_ids) == 2  # the fake predicts the next position
    assert sched.joined == 1
    run_until_idle(sched)
    assert a.output_ids == [4, 5, 6, 7, 8, 9] and b.output_ids == [3, 4]


def test_one_catch_up_per_step():
    """Arrivals join once per step, together: a later one waits for the next step."""
    sched, runner, _, _ = make()
    a = seq(4, 6)
    sched.submit(a)
    sched.step()
    b, c, d = seq(2, 2, start=300), seq(2, 2, start=400), seq(2, 2, start=500)
    runner.during_step = {2: lambda: [sched.submit(b), sched.submit(c)], 5: lambda: sched.submit(d)}
    sched.step()
    runner.during_step = {}
    assert runner.steps[-1] == [(a.id, 4, 1), (b.id, 0, 2), (c.id, 0, 2)]
    assert d in sched.waiting and sched.joined == 2
    sched.step()
    assert (d.id, 0, 2) in runner.steps[-1]


def test_joining_keeps_queue_order_limits_and_the_prefill_budget():
    """Only generation prompts from the front of the queue join, within the step's prefill budget and
    max_running; a scoring call stops the joining, and a prompt too long for what is left of the budget
    is admitted for the next step instead."""
    sched, runner, _, _ = make(with_limits(max_running=3, max_waiting=8, prefill_chunk_tokens=8))
    a = seq(4, 10)
    sched.submit(a)
    sched.step()
    fits, too_long, later = seq(5, 2, start=200), seq(6, 2, start=300), seq(2, 2, start=400)
    runner.during_step = {1: lambda: [sched.submit(s) for s in (fits, too_long, later)]}
    sched.step()
    runner.during_step = {}
    assert runner.steps[-1] == [(a.id, 4, 1), (fits.id, 0, 5)]  # 5 of 8 budget tokens; 6 more do not fit
    assert too_long in sched.running and later in sched.waiting  # max_running 3: later waits
    sched.step()
    assert (too_long.id, 0, 6) in runner.steps[-1]
    scoring = scoring_seq(4, start=600)
    run_until_idle(sched)
    sched.submit(a2 := seq(3, 4, start=700))
    sched.step()
    chat = seq(2, 2, start=800)
    runner.during_step = {1: lambda: [sched.submit(s) for s in (scoring, chat)]}
    sched.step()
    runner.during_step = {}
    # the scoring call waits for the next step; the chat behind it joins
    assert runner.steps[-1] == [(a2.id, 3, 1), (chat.id, 0, 2)] and scoring in sched.waiting
    run_until_idle(sched)
    assert scoring.scores is not None and len(a2.output_ids) == 4


def test_scoring_calls_have_running_places_of_their_own():
    """A burst of label-scoring calls (auto-tasks) never keeps a chat out of the batch, nor the reverse."""
    sched, runner, _, _ = make(with_limits(max_running=2, max_waiting=8, prefill_chunk_tokens=64))
    chats = [seq(3, 6, start=100 * i) for i in range(3)]
    scoring = [scoring_seq(4, start=1000 + 10 * i) for i in range(3)]
    for s in scoring + chats:  # the calls first
        sched.submit(s)
    sched.step()
    first = {sid for sid, _, _ in runner.steps[0]}
    assert first == {scoring[0].id, scoring[1].id, chats[0].id, chats[1].id}
    run_until_idle(sched)
    assert all(s.scores is not None for s in scoring) and all(len(c.output_ids) == 6 for c in chats)


def test_max_running_and_bounded_queue():
    sched, runner, _, _ = make(with_limits(max_running=2, max_waiting=2, prefill_chunk_tokens=64))
    seqs = [seq(2, 5, start=10 * i) for i in range(4)]
    for s in seqs:
        sched.submit(s)
    with pytest.raises(Overloaded):
        sched.submit(seq(2, 5))
    sched.step()
    assert len(sched.running) == 2 and len(sched.waiting) == 2
    run_until_idle(sched)
    assert all(len(s.output_ids) == 5 for s in seqs)
    assert max(len(step) for step in runner.steps) <= 2


def test_request_larger_than_limits_is_refused_at_once():
    sched, _, _, _ = make(with_limits(max_sequence_tokens=16))
    with pytest.raises(RequestTooLarge):
        sched.submit(seq(10, 10))


def test_waits_for_kv_room_then_runs():
    sched, runner, kv, _ = make(blocks=6, block_tokens=4)  # 24 tokens of KV
    a, b = seq(8, 8), seq(8, 8, start=500)  # 16 tokens each: only one fits at a time
    sched.submit(a)
    sched.submit(b)
    sched.step()
    assert a.phase is not Phase.WAITING and b.phase is Phase.WAITING
    run_until_idle(sched)
    assert len(a.output_ids) == 8 and len(b.output_ids) == 8
    assert kv.used_blocks == len(kv.prefix_blocks)


def test_cancel_leaves_at_next_step_and_frees_kv():
    sched, runner, kv, events = make()
    a, b = seq(4, 50), seq(4, 50, start=700)
    sched.submit(a)
    sched.submit(b)
    sched.step()
    sched.step()
    sched.cancel(a)
    sched.step()
    assert a.id not in {sid for sid, _, _ in runner.steps[-1]}
    assert a.result().finish_reason is FinishReason.CANCELLED
    sched.cancel(b)
    run_until_idle(sched)
    kv.clear_prefix_cache()
    assert kv.used_blocks == 0


def test_step_exception_fails_that_step_only_and_keeps_serving():
    sched, runner, kv, events = make()
    a = seq(4, 3)
    sched.submit(a)
    sched.fault_hook = lambda items: (_ for _ in ()).throw(RuntimeError("boom"))
    sched.step()
    assert a.result().finish_reason is FinishReason.ERROR and "internal" in a.error
    sched.fault_hook = None
    b = seq(4, 3, start=900)
    sched.submit(b)
    run_until_idle(sched)
    assert b.result().finish_reason is FinishReason.LENGTH
    kv.clear_prefix_cache()
    assert kv.used_blocks == 0


def test_step_exception_is_isolated_to_the_sequence_that_raises():
    sched, runner, kv, events = make()
    calm, victim = seq(4, 5), seq(4, 5, start=900)
    sched.submit(calm)
    sched.step()  # calm decodes from here on, so the victim's steps include calm's rows

    def explode(items):
        if any(it.seq is victim for it in items):
            raise RuntimeError("boom")

    sched.fault_hook = explode
    sched.submit(victim)
    run_until_idle(sched)
    assert victim.result().finish_reason is FinishReason.ERROR and "internal" in victim.error
    assert calm.result().finish_reason is FinishReason.LENGTH and len(calm.output_ids) == 5
    kv.clear_prefix_cache()
    assert kv.used_blocks == 0


def test_a_sequence_that_raises_while_joining_a_step_fails_alone():
    sched, runner, kv, events = make()
    calm, victim = seq(4, 5), seq(4, 5, start=900)
    sched.submit(calm)
    sched.step()

    def explode(items):
        if any(it.seq is victim for it in items):
            raise RuntimeError("boom")

    sched.fault_hook = explode
    runner.during_step = {1: lambda: sched.submit(victim)}
    sched.step()
    runner.during_step = {}
    run_until_idle(sched)
    assert victim.result().finish_reason is FinishReason.ERROR and "internal" in victim.error
    assert calm.result().finish_reason is FinishReason.LENGTH and len(calm.output_ids) == 5
    kv.clear_prefix_cache()
    assert kv.used_blocks == 0


def test_label_scoring_runs_without_a_decode_loop():
    sched, runner, kv, _ = make()
    s = Sequence(
        list(range(5)),
        SamplingParams(max_new_tokens=1),
        eos_token_ids=set(),
        candidates=[[5], [7], [5, 6, 7]],
    )
    sched.submit(s)
    run_until_idle(sched)
    lp = torch.log_softmax(torch.tensor([0.0] * 5 + [1.0] + [0.0] * (VOCAB - 6)), -1)
    assert s.scores[0] == pytest.approx(float(lp[5]))
    assert s.scores[1] == pytest.approx(float(lp[0]))  # any zero-logit token
    assert s.scores[2] == pytest.approx(3 * float(lp[5]))  # each next token is the predicted one
    # one forward for the prompt, one teacher-forced forward for the multi-token candidate, no decoding
    assert runner.steps == [[(s.id, 0, 5)], [(s.id, 5, 2)]]


def test_label_rounds_are_planned_items_within_the_prefill_budget():
    """A longer label's round waits for room in the budget, then shares a step with other work."""
    sched, runner, kv, _ = make()  # prefill chunk budget: 8 tokens per step
    s = Sequence(
        list(range(5)), SamplingParams(max_new_tokens=1), eos_token_ids=set(), candidates=[[5], [7, 8, 9, 10]]
    )
    sched.submit(s)
    sched.step()  # its prompt
    chat = seq(10, 2, start=500)
    sched.submit(chat)
    sched.step()  # the chat's prompt takes the whole budget: the round (3 tokens) waits
    sched.step()
    assert runner.steps[1:3] == [[(chat.id, 0, 8)], [(chat.id, 8, 2), (s.id, 5, 3)]]
    run_until_idle(sched)
    assert s.result().finish_reason is FinishReason.LENGTH and len(chat.output_ids) == 2
    kv.clear_prefix_cache()
    assert kv.used_blocks == 0


def test_generation_prompts_take_the_prefill_budget_before_scoring_ones():
    sched, runner, kv, _ = make()  # prefill chunk budget: 8 tokens per step
    scoring = [scoring_seq(6, start=200 + 10 * i) for i in range(2)]
    chat = seq(6, 2, start=500)
    for s in scoring + [chat]:  # the chat arrives last
        sched.submit(s)
    sched.step()
    assert runner.steps[0][0] == (chat.id, 0, 6)  # its whole prompt first, then the budget's rest
    assert runner.steps[0][1] == (scoring[0].id, 0, 2)
    run_until_idle(sched)
    assert all(s.scores is not None for s in scoring) and len(chat.output_ids) == 2


def prioritised(n_prompt, n_new, start, priority):
    return Sequence(
        list(range(start, start + n_prompt)),
        SamplingParams(max_new_tokens=n_new, priority=priority),
        eos_token_ids=set(),
    )


def test_customers_are_admitted_and_prefilled_before_assist_and_background():
    sched, runner, _, _ = make()  # 4 running places, an 8-token prefill chunk
    background = prioritised(6, 2, 100, Priority.BACKGROUND)
    assist = prioritised(6, 2, 200, Priority.ASSIST)
    customer = prioritised(6, 2, 300, Priority.CUSTOMER)
    for s in (background, assist, customer):  # the customer arrives last
        sched.submit(s)
    sched.step()
    # the customer's whole prompt first; the less urgent ones share a quarter of the chunk (2 tokens)
    assert runner.steps[0] == [(customer.id, 0, 6), (assist.id, 0, 2)]
    run_until_idle(sched)
    assert all(len(s.output_ids) == 2 for s in (background, assist, customer))


def test_a_customer_without_a_place_pauses_an_assist_generation_which_resumes_with_its_kv():
    sched, runner, kv, events = make(with_limits(max_running=2, max_waiting=4, prefill_chunk_tokens=8))
    assists = [prioritised(4, 12, 100 + 10 * i, Priority.ASSIST) for i in range(2)]
    for s in assists:
        sched.submit(s)
    for _ in range(3):
        sched.step()
    late = assists[1]
    done_before = list(late.output_ids)
    computed = late.num_computed
    customer = prioritised(4, 3, 300, Priority.CUSTOMER)
    sched.submit(customer)
    sched.step()
    assert sched.paused == 1 and late not in sched.running and customer in sched.running
    assert late.kv is not None and late.num_computed == computed  # paused with its KV
    run_until_idle(sched)
    assert len(customer.output_ids) == 3 and all(len(s.output_ids) == 12 for s in assists)
    # it went on where it stopped: its positions were never computed twice
    starts = [start for step in runner.steps for sid, start, n in step if sid == late.id]
    assert starts == sorted(set(starts)) and late.output_ids[: len(done_before)] == done_before


def test_a_paused_sequence_that_is_cancelled_frees_its_kv():
    sched, _, kv, _ = make(with_limits(max_running=1, max_waiting=4, prefill_chunk_tokens=8))
    assist = prioritised(4, 20, 100, Priority.ASSIST)
    sched.submit(assist)
    sched.step()
    sched.step()
    sched.submit(prioritised(4, 20, 300, Priority.CUSTOMER))
    sched.step()
    assert assist in sched.waiting and assist.kv is not None
    sched.cancel(assist)
    run_until_idle(sched)
    assert assist.result().finish_reason is FinishReason.CANCELLED and assist.kv is None


def test_a_customer_short_of_kv_pauses_an_assist_generation_which_resumes_from_the_cache():
    """8 blocks of 4 tokens: a running assist generation holds 6, a customer needs 3. The assist one
    is paused, its KV put in the cache; the customer runs; the assist one then resumes from what is
    still cached and ends with the very tokens it would have had alone."""
    alone_sched, _, _, _ = make(blocks=8, block_tokens=4)
    alone = prioritised(12, 12, 100, Priority.ASSIST)
    alone_sched.submit(alone)
    run_until_idle(alone_sched)

    sched, runner, kv, _ = make(blocks=8, block_tokens=4)
    assist = prioritised(12, 12, 100, Priority.ASSIST)
    sched.submit(assist)
    for _ in range(4):
        sched.step()
    customer = prioritised(8, 4, 300, Priority.CUSTOMER)
    sched.submit(customer)
    sched.step()
    assert sched.paused == 1 and assist not in sched.running and assist.kv is None
    assert customer in sched.running
    run_until_idle(sched)
    assert len(customer.output_ids) == 4
    assert assist.output_ids == alone.output_ids and assist.finish_reason is FinishReason.LENGTH
    assert ("paused", assist.id) not in kv.sessions  # taken back at its resume


def test_a_sequence_paused_for_kv_and_cancelled_leaves_nothing_cached():
    sched, _, kv, _ = make(blocks=8, block_tokens=4)
    assist = prioritised(12, 20, 100, Priority.ASSIST)
    sched.submit(assist)
    sched.step()
    sched.submit(prioritised(8, 12, 300, Priority.CUSTOMER))
    sched.step()
    assert assist.resume_key == ("paused", assist.id) and assist.resume_key in kv.sessions
    sched.cancel(assist)
    run_until_idle(sched)
    assert assist.result().finish_reason is FinishReason.CANCELLED
    assert ("paused", assist.id) not in kv.sessions


def test_under_steady_customer_prefill_an_assist_prompt_still_gets_its_floor():
    """A customer's long prompt takes the whole 32-token chunk step after step; an assist call's
    short prompt still gets an eighth more of its own (4 tokens) in each of those steps."""
    sched, runner, _, _ = make(with_limits(max_running=4, max_waiting=4, prefill_chunk_tokens=32))
    customer = prioritised(160, 2, 300, Priority.CUSTOMER)
    assist = prioritised(6, 2, 100, Priority.ASSIST)
    sched.submit(customer)
    sched.submit(assist)
    sched.step()
    sched.step()
    assert runner.steps[0] == [(customer.id, 0, 32), (assist.id, 0, 4)]
    assert runner.steps[1] == [(customer.id, 32, 32), (assist.id, 4, 2)]
    assert assist.output_ids and customer.num_computed == 64  # its first token, the customer's pace
    run_until_idle(sched)


def test_assist_may_evict_idle_sessions_while_it_holds_under_its_share():
    """64 blocks, every one held by a running customer or idle sessions. An assist call may evict idle
    KV while assist work holds under 1/16 of the pool (4 blocks), so it runs beside the customer; a
    second one, with that share held, waits for the first to end rather than evict more."""
    sched, runner, kv, _ = make(with_limits(max_running=8, max_waiting=16, prefill_chunk_tokens=64))
    for i in range(12):  # 12 idle sessions of 4 blocks each
        idle = Sequence(
            list(range(1000 + 20 * i, 1012 + 20 * i)),
            SamplingParams(max_new_tokens=4),
            eos_token_ids=set(),
            session_key=f"s{i}",
        )
        sched.submit(idle)
    run_until_idle(sched)
    customer = prioritised(4, 60, 300, Priority.CUSTOMER)  # 16 blocks while it runs
    sched.submit(customer)
    sched.step()
    assert kv.free_blocks == 0 and len(kv.sessions) == 12
    first = prioritised(8, 8, 100, Priority.ASSIST)  # 4 blocks
    second = prioritised(4, 4, 200, Priority.ASSIST)
    sched.submit(first)
    sched.submit(second)
    sched.step()
    assert first in sched.running and second in sched.waiting and kv.evictions == 1
    while first in sched.running:
        sched.step()
    sched.step()
    assert second in sched.running and customer in sched.running
    run_until_idle(sched)


class CopyingMover:
    """Moves rows as they are: the fake model has no RoPE."""

    def shift_keys(self, k, shift):
        return k.clone()

    def move_rows(self, k, v, src, dst, shift):
        k[:, dst], v[:, dst] = k[:, src], v[:, src]


def test_a_cached_segment_is_copied_in_and_the_step_computes_around_it():
    sched, runner, kv, events = make()
    kv.mover = CopyingMover()
    key = SegmentKey(1)
    entry, _ = kv.acquire([100, 101, 52, 53, 54], 8, session_key=key)
    entry.token_ids = [100, 101, 52, 53, 54]  # as if computed: the public tokens, then the segment
    kv.release(entry, key)
    main = Sequence([100, 101, 52, 53, 54, 105, 106], SamplingParams(max_new_tokens=1), eos_token_ids=set())
    main.splices[2] = Splice(5, key, 2)
    sched.submit(main)
    sched.step()
    assert runner.steps[0] == [(main.id, 0, 4)]  # 100 101 and 105 106: positions 0 1 5 6
    assert kv.spliced_hits == 3 and main.num_computed == 7 and main.output_ids


def test_a_segment_whose_sequence_cannot_run_is_computed_in_place():
    """The prompt holds the only running place: waiting for the segment's own sequence would hold it
    forever."""
    sched, runner, kv, events = make(with_limits(max_running=1, max_waiting=4, prefill_chunk_tokens=8))
    kv.mover = CopyingMover()
    main = seq(10, 2)
    main.splices[3] = Splice(7, SegmentKey(2), 2, producer=seq(6, 1, start=300))  # never admitted
    sched.submit(main)
    sched.step()
    assert runner.steps[0] == [(main.id, 0, 8)] and 3 not in main.splices


def _drafting(speculation: Speculation):
    """A scheduler over the fake model with the real sampler, drafting as `speculation` says."""
    sched, runner, kv, events = make(with_limits(max_running=4, max_waiting=4, prefill_chunk_tokens=64))
    sched.runner = StepRunner(runner, Sampler())
    sched.drafter = Drafter(speculation)
    return sched, runner, kv


@pytest.mark.parametrize("skip", [False, True])
def test_drafts_save_steps_and_leave_the_kv_as_plain_decoding_does(skip):
    """The fake model's next token is its position + 1 (mod VOCAB). A prompt counting up from 0 has the
    output's tails earlier, followed by what the model says: every draft is kept. A prompt that skips
    every fifth number has them followed by a skip now and then: some drafts are rejected."""
    prompt = [(p + (p // 4 if skip else 0)) % VOCAB for p in range(40)]
    outputs, steps, counts = [], [], []
    for spec in (Speculation(max_live=0), Speculation(max_live=2, draft_tokens=3, row_cost=0.0)):
        sched, runner, kv = _drafting(spec)
        s = Sequence(prompt, SamplingParams(max_new_tokens=24), eos_token_ids=set(), session_key="chat")
        sched.submit(s)
        run_until_idle(sched)
        outputs.append(s.output_ids)
        steps.append(len(runner.steps))
        counts.append((sched.drafted, sched.accepted))
        # the KV kept for the next turn holds exactly the tokens computed, in order
        assert kv.sessions["chat"].token_ids == s.all_ids[: s.num_tokens - 1]
    assert outputs[0] == outputs[1] == [(40 + i) % VOCAB for i in range(24)]
    drafted, kept = counts[1]
    if skip:
        assert 0 < kept < drafted
    else:
        assert kept == drafted > 0 and steps[1] < steps[0] / 2
