"""The lean forward against transformers' own forward, and the int8 linear against float32."""

from __future__ import annotations

import torch

from rtserver.kv import KVCacheManager
from rtserver.runner import Linear, ModelRunner, StepItem, _decode_groups
from rtserver.sequence import SamplingParams, Sequence


def test_prefill_logits_match_transformers(tiny_qwen2):
    model, tok = tiny_qwen2.model, tiny_qwen2.tokenizer
    cfg = model.config
    kv = KVCacheManager(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
                        torch.float32, 1 << 20, 16)
    runner = ModelRunner(model, kv, 512)
    ids = tok.encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False)
    seq = Sequence(ids, SamplingParams(), tokenizer=tok, eos_token_ids=set())
    seq.kv, _ = kv.acquire(ids, len(ids) + 1)
    (ours,) = runner.forward([StepItem(seq, seq.kv, 0, ids, "all")])
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_decode_rows_of_very_different_lengths_match_transformers(tiny_qwen2):
    """A long context decoding beside short ones gets its own attention call; every row is still exact."""
    model, tok = tiny_qwen2.model, tiny_qwen2.tokenizer
    cfg = model.config
    kv = KVCacheManager(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
                        torch.float32, 4 << 20, 16)
    runner = ModelRunner(model, kv, 2048)
    torch.manual_seed(1)
    prompts = [torch.randint(0, len(tok), (n,)).tolist() for n in (700, 9, 12, 5)]
    seqs = []
    for ids in prompts:
        seq = Sequence(ids, SamplingParams(), tokenizer=tok, eos_token_ids=set())
        seq.kv, _ = kv.acquire(ids, len(ids))
        runner.forward([StepItem(seq, seq.kv, 0, ids[:-1], "none")])  # everything but the last token
        seqs.append(seq)
    decode = [StepItem(s, s.kv, len(ids) - 1, ids[-1:], "last") for s, ids in zip(seqs, prompts)]
    assert sorted(map(len, _decode_groups(decode))) == [1, 3]
    ours = runner.forward(decode)
    with torch.no_grad():
        for got, ids in zip(ours, prompts):
            theirs = model(torch.tensor([ids])).logits[0, -1:].float()
            torch.testing.assert_close(got, theirs, atol=1e-4, rtol=1e-4)


def test_int8_linear_is_close_to_float32():
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64) * 0.05, torch.randn(96) * 0.1
    x = torch.randn(8, 64)
    exact = torch.nn.functional.linear(x, weight, bias)
    approx = Linear(weight, bias, int8=True)(x)
    rel = (approx - exact).norm() / exact.norm()
    assert rel < 0.03, f"int8 relative error {rel:.3f}"
