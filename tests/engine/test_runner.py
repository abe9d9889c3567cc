"""The lean forward against transformers' own forward, and the float16 / int8 linears against float32."""

from __future__ import annotations

import pytest
import torch

from rtserver.engine.attention import decode_groups
from rtserver.engine.backend import SamplingParams
from rtserver.engine.kv import KVCacheManager
from rtserver.engine.linear import stored_linear
from rtserver.engine.plan import StepItem
from rtserver.engine.runner import ModelRunner
from rtserver.engine.sampler import Sampler, sampling_candidates
from rtserver.engine.sequence import Sequence

from ..conftest import chat_prompt


def kv_pool(cfg, budget_bytes: int) -> KVCacheManager:
    """A float32 KV pool for a model config, blocks of 16 tokens."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layers, kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    return KVCacheManager(layers, kv_heads, head_dim, torch.float32, budget_bytes, 16)


def test_prefill_logits_match_transformers(tiny_qwen2):
    model, tok = tiny_qwen2.model, tiny_qwen2.tokenizer
    cfg = model.config
    kv = kv_pool(cfg, 1 << 20)
    runner = ModelRunner(model, kv, 512)
    ids = tok.encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False)
    seq = Sequence(ids, SamplingParams(), eos_token_ids=set())
    seq.kv, _ = kv.acquire(ids, len(ids) + 1)
    (ours,) = runner.forward([StepItem(seq, seq.kv, 0, ids, "all")])
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_decode_rows_of_very_different_lengths_match_transformers(tiny_qwen2):
    """A long context decoding beside short ones gets its own attention call; every row is still exact."""
    model, tok = tiny_qwen2.model, tiny_qwen2.tokenizer
    cfg = model.config
    kv = kv_pool(cfg, 4 << 20)
    runner = ModelRunner(model, kv, 2048)
    torch.manual_seed(1)
    prompts = [torch.randint(0, len(tok), (n,)).tolist() for n in (700, 9, 12, 5)]
    seqs = []
    for ids in prompts:
        seq = Sequence(ids, SamplingParams(), eos_token_ids=set())
        seq.kv, _ = kv.acquire(ids, len(ids))
        runner.forward([StepItem(seq, seq.kv, 0, ids[:-1], "none")])  # everything but the last token
        seqs.append(seq)
    decode = [StepItem(s, s.kv, len(ids) - 1, ids[-1:], "last") for s, ids in zip(seqs, prompts)]
    assert sorted(map(len, decode_groups(decode))) == [1, 3]
    ours = runner.forward(decode)
    with torch.no_grad():
        for got, ids in zip(ours, prompts):
            theirs = model(torch.tensor([ids])).logits[0, -1:].float()
            torch.testing.assert_close(got, theirs, atol=1e-4, rtol=1e-4)


def test_a_prompt_joining_a_step_mid_way_gets_the_logits_of_its_own_forward(tiny_qwen2):
    """Rows that join before the last layer catch up on the layers already done, alone, then go on with
    the step: every row's logits equal transformers' forward of its own sequence."""
    model, tok = tiny_qwen2.model, tiny_qwen2.tokenizer
    cfg = model.config
    kv = kv_pool(cfg, 4 << 20)
    runner = ModelRunner(model, kv, 512)
    torch.manual_seed(2)
    prompts = [torch.randint(0, len(tok), (n,)).tolist() for n in (6, 30, 11)]
    seqs = []
    for ids in prompts:
        seq = Sequence(ids, SamplingParams(), eos_token_ids=set())
        seq.kv, _ = kv.acquire(ids, len(ids) + 1)
        seqs.append(seq)
    for seq, ids in zip(seqs[:2], prompts):
        runner.forward([StepItem(seq, seq.kv, 0, ids[:-1], "none")])
    items = [StepItem(s, s.kv, len(ids) - 1, ids[-1:], "last") for s, ids in zip(seqs[:2], prompts)]
    joining = StepItem(seqs[2], seqs[2].kv, 0, prompts[2], "last")
    asked = []

    class Joins:
        def take(self, layer: int) -> list[StepItem]:
            asked.append(layer)
            return [joining] if layer == cfg.num_hidden_layers - 1 else []

    fw = runner.run(items, Joins())
    assert asked == list(range(1, cfg.num_hidden_layers)) and fw.joined == [joining]
    assert len(items) == 2 and len(fw.logits) == 3  # the plan stays the caller's; joiners come back
    with torch.no_grad():
        for got, ids in zip(fw.logits, prompts):
            theirs = model(torch.tensor([ids])).logits[0, -1:].float()
            torch.testing.assert_close(got, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("storage, tolerance", [("float16", 1e-3), ("int8", 0.03)])
def test_stored_linear_is_close_to_float32(storage, tolerance):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64) * 0.05, torch.randn(96) * 0.1
    x = torch.randn(8, 64)
    exact = torch.nn.functional.linear(x, weight, bias)
    approx = stored_linear(weight, bias, storage)(x)
    rel = (approx - exact).norm() / exact.norm()
    assert 0 < rel < tolerance, f"{storage} relative error {rel:.5f}"


def test_float16_weights_give_float32_answers_on_the_embedded_model(smol):
    """float16 storage changes each linear by ~1e-4 relative: greedy answers stay those of float32."""
    tok = smol.tokenizer
    prompts = [
        chat_prompt(tok, t)
        for t in ("Tell me a short fact about the number 7.", "What is the capital of France?")
    ]
    answers = {}
    for storage in (None, "float16"):
        cfg = smol.model.config
        kv = kv_pool(cfg, 8 << 20)
        runner = ModelRunner(smol.model, kv, 512, weight_storage=storage)
        outputs = []
        for ids in prompts:
            seq = Sequence(ids, SamplingParams(), eos_token_ids=set())
            seq.kv, _ = kv.acquire(ids, len(ids) + 16)
            start, step = 0, ids
            for _ in range(16):
                (logits,) = runner.forward([StepItem(seq, seq.kv, start, step, "last")])
                start += len(step)
                step = [int(logits[-1].argmax())]
                outputs.append(step[0])
        answers[storage] = outputs
    assert answers["float16"] == answers[None]


def reference_sampling_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled step draws from, spelled out over the whole sorted vocabulary:
    temperature, then top-k, then top-p (the token that crosses it kept)."""
    row = row / p.temperature
    if 0 < p.top_k < row.numel():
        row[row < torch.topk(row, p.top_k).values[-1]] = float("-inf")
    if p.top_p < 1.0:
        vals, order = torch.sort(row, descending=True)
        probs = torch.softmax(vals, -1)
        row[order[probs.cumsum(-1) - probs >= p.top_p]] = float("-inf")
    return torch.softmax(row, -1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.999),  # a nucleus wider than the first look (64 tokens)
        SamplingParams(temperature=1.3, top_k=40),
        SamplingParams(temperature=0.5, top_k=100, top_p=0.5),
        SamplingParams(temperature=1.0),
    ],
)
def test_sampling_candidates_are_the_whole_vocabulary_distribution(params):
    """Looking for the nucleus among the best logits only gives the same tokens and probabilities as
    filtering the sorted vocabulary."""
    torch.manual_seed(3)
    for scale in (1.0, 4.0):
        row = torch.randn(5000) * scale
        want = reference_sampling_probs(row.clone(), params)
        tokens, weights = sampling_candidates(row.clone(), params)
        got = torch.zeros_like(want)
        got[tokens] = weights / weights.sum()
        assert set(tokens.tolist()) == set(torch.nonzero(want).flatten().tolist())
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_sampled_tokens_follow_the_distribution_and_the_seed(tiny_qwen2):
    """Draws land only on kept tokens, about as often as their probability says, and a seed repeats them."""
    sampler = Sampler()
    torch.manual_seed(0)
    logits = torch.randn(1, 200) * 2
    params = SamplingParams(temperature=0.8, top_p=0.8, seed=11)
    probs = reference_sampling_probs(logits[0].clone(), params)

    def draws(n: int) -> list[int]:
        seq = Sequence([1, 2], params, eos_token_ids=set())
        return [sampler.sample([seq], logits)[0] for _ in range(n)]

    picks = draws(4000)
    assert picks[:50] == draws(50)
    counts = torch.bincount(torch.tensor(picks), minlength=200).float() / len(picks)
    assert counts[probs == 0].sum() == 0
    assert (counts - probs).abs().max() < 0.03


def test_a_batch_of_mixed_decoding_params_samples_as_each_row_alone(tiny_qwen2):
    """Rows sampled together (different temperatures, top-k, top-p, penalties, greedy beside them)
    draw the same tokens as each row sampled on its own with the same seed."""
    torch.manual_seed(5)
    logits = torch.randn(6, 300) * 3
    params = [
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.3, top_k=5, seed=2),
        SamplingParams(temperature=0.7, top_p=0.9, seed=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=100, top_p=0.5, repetition_penalty=1.5, seed=4),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
    ]

    def seqs() -> list[Sequence]:
        return [Sequence([1, 2, 7], p, eos_token_ids=set()) for p in params]

    batch, alone = seqs(), seqs()
    sampler = Sampler()
    for _ in range(20):
        together = sampler.sample(batch, logits)
        each = [sampler.sample([s], logits[i : i + 1])[0] for i, s in enumerate(alone)]
        assert together == each
