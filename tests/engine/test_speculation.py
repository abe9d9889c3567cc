"""Prompt-lookup speculation: the drafter's lookups and draft lengths; greedy output with drafts equals
plain decoding token for token (float32 against transformers; on GGUF blocks against the same engine
without drafts, JSON schemas and the copilot tasks included); seeded sampling gives the same text; the
sampled distribution is unchanged (a chi-square test on a tiny model's exact probabilities); no drafts
above the threshold."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rtserver.config import EngineSettings
from rtserver.engine.backend import OutputFormat, SamplingParams
from rtserver.engine.core import Engine
from rtserver.engine.model import LoadedModel, load_model
from rtserver.engine.sequence import PRIOR_RATE, Sequence
from rtserver.engine.speculation import Drafter, Speculation, lookup

from ..components import slow_tests_on
from ..conftest import chat_prompt, reference_greedy

# Texts a reply copies from: an order number, an address, the customer's words.
COPY_TEXTS = [
    "Repeat my order number back to me exactly: AB-58213-XQ-7741. Then confirm it again.",
    "Customer: Hi, my order AB-1234 has not arrived. Agent: Let me check order AB-1234. Customer: It was "
    "two blue mugs shipped to 12 Elm Street, Springfield. Summarize this conversation.",
    "Copy this list exactly: apples, pears, plums, apples, pears, plums, apples, pears, plums.",
]
SUMMARY = {
    "type": "object",
    "properties": {
        "issue": {"type": "string", "maxLength": 120},
        "order_number": {"anyOf": [{"type": "string", "maxLength": 40}, {"type": "null"}]},
    },
    "required": ["issue", "order_number"],
    "additionalProperties": False,
}


def test_lookup_takes_what_followed_the_latest_longest_match():
    t = np.array([5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 6, 7])
    assert lookup(t, 3, 2, 4) == [3, 4, 6]  # [6, 7] last occurred at 6..7: what followed it
    t = np.array([1, 2, 3, 9, 9, 2, 3, 8, 8, 1, 2, 3])
    assert lookup(t, 2, 2, 4) == [9, 9]  # [1, 2, 3] beats the later [2, 3]
    assert lookup(t, 2, 4, 4) == []  # no earlier [3, 1, 2, 3] ... nor [9, 1, 2, 3]
    assert lookup(np.array([4, 4, 4, 4]), 5, 2, 3) == [4]  # only what exists before the tail
    assert lookup(np.array([1, 2, 3, 4]), 3, 2, 4) == []
    assert lookup(np.array([7]), 3, 1, 4) == []
    assert lookup(np.array([3, 1, 2, 3]), 2, 1, 1) == [1, 2]  # one-token tails where asked


def test_draft_length_weighs_kept_rate_against_row_cost():
    free, dear = Speculation(draft_tokens=4, row_cost=0.0), Speculation(draft_tokens=4, row_cost=5.0)
    assert free.draft_length(0.5, 9) == 4 and free.draft_length(0.5, 2) == 2  # within the room left
    assert dear.draft_length(0.95, 9) == 0
    s = Speculation(draft_tokens=4, row_cost=0.3)
    assert s.draft_length(0.0, 4) == 0
    assert s.draft_length(0.95, 4) == 4
    assert 0 < s.draft_length(0.6, 4) < 4
    # in a step of more decodes each draft row costs more of the step: fewer drafts pay
    assert s.draft_length(0.6, 4, running=8) < s.draft_length(0.6, 4, running=1)


def test_a_sequence_learns_its_kept_rate_and_tries_again():
    d = Drafter(Speculation(draft_tokens=4, row_cost=0.3))
    seq = Sequence([5, 6, 7, 5, 6], SamplingParams(), eos_token_ids=set())
    assert seq.draft_rate == PRIOR_RATE
    for _ in range(12):
        d.learn(seq, 0, 3)  # every first draft rejected
    assert seq.draft_rate < 0.05 and d.propose(seq, 4) == []
    for _ in range(60):  # steps without drafts move the rate back until a draft is tried again
        if d.propose(seq, 4):
            break
    else:
        raise AssertionError("a sequence whose drafts were rejected never drafts again")
    d.learn(seq, 3, 3)
    assert seq.draft_rate > 0.3
    assert (
        Drafter(Speculation(row_cost=0.0)).propose(
            Sequence([5, 6, 7, 5, 6], SamplingParams(speculate=False), eos_token_ids=set()), 4
        )
        == []
    )


async def _generate(
    loaded: LoadedModel,
    prompts: list[list[int]],
    params: SamplingParams,
    max_live: int,
    together: int = 1,
    drafter: Drafter | None = None,
) -> tuple[list[list[int]], Engine]:
    """Each prompt's tokens, `together` at a time, on an engine drafting for up to `max_live` sequences.
    Its rows count as free, so each draft is made: what a row costs is timed at start-up, and a busy
    machine's timing must not decide whether these tests draft. `drafter` replaces the lookup."""
    engine = Engine(loaded, EngineSettings(kv_budget_mb=128, speculate_max_live=max_live, draft_tokens=4))
    free_rows(engine)
    if drafter is not None:
        drafter.speculation = engine.scheduler.drafter.speculation
        engine.scheduler.drafter = drafter
    engine.start()
    try:
        out: list[list[int]] = []
        for at in range(0, len(prompts), together):
            streams = [engine.generate(p, params) for p in prompts[at : at + together]]
            out += [(await s.result()).token_ids for s in streams]
        return out, engine
    finally:
        await engine.stop()


def free_rows(engine: Engine) -> None:
    """The engine's drafter as configured, with a draft's row at no cost: it drafts wherever it can."""
    spec = engine.scheduler.drafter.speculation
    engine.scheduler.drafter = Drafter(dataclasses.replace(spec, row_cost=0.0))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, min_new_tokens=n)


async def test_float32_greedy_with_drafts_equals_transformers(smol):
    prompts = [chat_prompt(smol.tokenizer, t) for t in COPY_TEXTS[:2]]
    got, engine = await _generate(smol, prompts, greedy(32), max_live=2, together=2)
    assert got == [reference_greedy(smol, p, 32) for p in prompts]
    stats = engine.stats()
    assert stats["draft_tokens_accepted"] > 0 and stats["draft_tokens"] >= stats["draft_tokens_accepted"]


@pytest.fixture(scope="module")
def smol_blocks() -> LoadedModel:
    return load_model("embedded", dtype="gguf", threads=2)


@pytest.mark.parametrize(
    "params",
    [
        greedy(48),
        SamplingParams(max_new_tokens=48, temperature=0.8, top_p=0.95, seed=11),
        SamplingParams(max_new_tokens=48, temperature=0.7, repetition_penalty=1.1, top_k=40, seed=3),
        SamplingParams(max_new_tokens=96, output=OutputFormat.json_schema(SUMMARY)),
        SamplingParams(max_new_tokens=96, temperature=0.7, seed=5, output=OutputFormat.json_schema(SUMMARY)),
    ],
    ids=["greedy", "sampled", "penalised", "json", "json-sampled"],
)
async def test_on_blocks_drafts_change_no_token(smol_blocks, params):
    """The kernel's decode rows give a drafted token the logits its own decode step would, so every
    pick is the same: greedy, seeded sampling (one draw per token, in order), penalties and grammars."""
    prompts = [chat_prompt(smol_blocks.tokenizer, t) for t in COPY_TEXTS[:2]]
    plain, _ = await _generate(smol_blocks, prompts, params, max_live=0, together=2)
    drafted, engine = await _generate(smol_blocks, prompts, params, max_live=2, together=2)
    assert drafted == plain
    assert engine.stats()["draft_tokens_accepted"] > 0
    if params.output.kind == "json_schema":
        for ids in drafted:
            json.loads(smol_blocks.tokenizer.decode(ids, skip_special_tokens=True))


PLUGINS = str(Path(__file__).resolve().parents[2] / "plugins")
TRANSCRIPT = (
    "Customer: Hi, this is Dana Kowalski. My order DR-51144 for the Lumen desk lamp arrived damaged.\n"
    "Bot: I'm sorry to hear that. Could you give me your order number and e-mail?\n"
    "Customer: The order number is DR-51144 and my e-mail is dana.kowalski3@example.com."
)


async def test_the_copilot_tasks_answer_the_same_with_drafts(smol_blocks):
    """summarize and extract as the agents call them (their JSON schemas, greedy), drafts on and off."""
    from rtserver.config import Settings, TaskSettings
    from rtserver.tasks.registry import load_registry

    texts = []
    for max_live in (0, 2):
        engine = Engine(smol_blocks, EngineSettings(kv_budget_mb=128, speculate_max_live=max_live))
        free_rows(engine)
        engine.start()
        try:
            registry, errors = load_registry(
                Settings(tasks=TaskSettings(plugin_dirs=[PLUGINS])), smol_blocks.tokenizer
            )
            assert errors == [] and await registry.prepare_outputs(lambda name, e=engine: ("local", e)) == []
            texts.append(
                [(await registry.run(engine, t, {"text": TRANSCRIPT})).text for t in ("summarize", "extract")]
            )
            if max_live:
                assert engine.stats()["draft_tokens_accepted"] > 0
        finally:
            await engine.stop()
    assert texts[0] == texts[1]
    assert "DR-51144" in texts[1][1]  # the extraction copies the order number


async def test_no_drafts_above_the_threshold(smol_blocks):
    prompts = [chat_prompt(smol_blocks.tokenizer, t) for t in COPY_TEXTS]
    _, crowded = await _generate(smol_blocks, prompts, greedy(24), max_live=2, together=3)
    assert crowded.stats()["draft_tokens"] == 0  # three in step from first to last token
    _, alone = await _generate(smol_blocks, prompts, greedy(24), max_live=2, together=1)
    assert alone.stats()["draft_tokens"] > 0


def _next_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """The model's float32 next-token logits after `ids` (transformers' forward)."""
    with torch.inference_mode():
        return loaded.model(torch.tensor([ids])).logits[0, -1].float()


async def test_sampled_drafts_keep_the_distribution(tiny_qwen2):
    """The prompt ends as it went on before: `a b` came before `d1 d2 d3`. The first token comes from
    the prompt's step; when it is d1, the next step checks d2 and d3 as drafts. Over 800 seeds the first
    three tokens must follow the model's own probabilities (transformers' float32 forward): a draft is
    kept with its probability, and a rejection draws from the rest."""
    tok = tiny_qwen2.tokenizer
    a, b = tok(" order").input_ids[0], tok(" number").input_ids[0]
    filler = tok(" the parcel left the depot on time and").input_ids
    # The drafts are the model's likeliest tokens there, so kept often, and rejected often at a
    # temperature that makes them about even. The prompt holds them: look until they agree.
    drafts = [a, a, a]
    for _ in range(8):
        prompt = [*filler, a, b, *drafts, *filler, a, b]
        logits = []
        for _ in range(3):
            logits.append(_next_logits(tiny_qwen2, prompt + [int(lg.argmax()) for lg in logits]))
        best = [int(lg.argmax()) for lg in logits]
        if best == drafts:
            break
        drafts = best
    d1, d2, d3 = drafts
    assert lookup(np.array([*prompt, d1]), 4, 2, 4)[:2] == [d2, d3]

    def classes(t: float) -> np.ndarray:
        """Chances of: all three kept; d1 and d2, then another; d1, then another; another first."""
        q1, q2, q3 = (float(torch.softmax(lg / t, -1)[d]) for lg, d in zip(logits, drafts))
        return np.array([q1 * q2 * q3, q1 * q2 * (1 - q3), q1 * (1 - q2), 1 - q1])

    temperature = max((0.05 * i for i in range(1, 60)), key=lambda t: classes(t).min())
    want = classes(temperature)
    assert want.min() > 0.02, f"the test prompt's probabilities {want} leave a class too rare to test"
    engine = Engine(tiny_qwen2, EngineSettings(kv_budget_mb=64))
    # 16 at a time, every one drafting (rows free): the rule under test is the sampler's, not when to draft
    engine.scheduler.drafter = Drafter(Speculation(max_live=16, draft_tokens=4, max_rows=64, row_cost=0.0))
    engine.start()
    counts = np.zeros(4)
    try:
        for seed in range(0, 800, 16):
            params = [
                SamplingParams(max_new_tokens=4, min_new_tokens=4, temperature=temperature, seed=seed + i)
                for i in range(16)
            ]
            streams = [engine.generate(prompt, p) for p in params]
            for stream in streams:
                t1, t2, t3, _ = (await stream.result()).token_ids
                counts[
                    0 if (t1, t2, t3) == (d1, d2, d3) else 1 if (t1, t2) == (d1, d2) else 2 if t1 == d1 else 3
                ] += 1
        assert engine.stats()["draft_tokens"] >= counts[:3].sum() * 2  # each run past d1 checked two
    finally:
        await engine.stop()
    expected = want * counts.sum()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3, (counts, expected)  # 3 degrees of freedom: p = 0.001


@pytest.mark.slow
@pytest.mark.skipif(not slow_tests_on(), reason="slow: set RTSERVER_SLOW_TESTS=1")
def test_sliding_window_layers_on_blocks_change_no_token():
    """Gemma 3's sliding-window layers (a window of 16 here): a drafted row's window ends at its own
    position, as its decode step's would."""
    from rtbench.model_files import random_gguf

    loaded = load_model(str(random_gguf("gemma3-tiny", "Q4_K_M")), dtype="gguf", threads=2)
    ids = loaded.tokenizer(
        "one two three four five six seven eight nine ten one two three four five"
    ).input_ids
    prompts = [ids, ids[3:], ids[5:]]
    plain, _ = asyncio.run(_generate(loaded, prompts, greedy(40), max_live=0))
    oracle = _Oracle({tuple(p): out for p, out in zip(prompts, plain)}, loaded.model.config.vocab_size)
    drafted, engine = asyncio.run(_generate(loaded, prompts, greedy(40), max_live=2, drafter=oracle))
    assert drafted == plain
    stats = engine.stats()
    assert stats["draft_tokens_accepted"] > 0 and stats["draft_tokens"] > stats["draft_tokens_accepted"]


class _Oracle(Drafter):
    """Drafts the plain run's own next tokens, every third time with the last one wrong: kept and
    rejected drafts are both checked, wherever the random model's greedy path goes."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], vocab: int):
        super().__init__(Speculation(row_cost=0.0))  # _generate gives it the engine's
        self.answers, self.vocab, self.calls = answers, vocab, 0

    def propose(self, seq: Sequence, room: int, running: int = 1) -> list[int]:
        done = seq.num_tokens - len(seq.prompt_ids)
        drafts = self.answers[tuple(seq.prompt_ids)][done : done + min(room, 4)]
        self.calls += 1
        if self.calls % 3 == 0 and drafts:
            drafts[-1] = (drafts[-1] + 1) % self.vocab
        return drafts
