"""The lean forward against transformers' own forward, and the int8 linear against float32."""

from __future__ import annotations

import torch

from rtserver.kv import KVCacheManager
from rtserver.runner import Linear, ModelRunner, StepItem
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


def test_int8_linear_is_close_to_float32():
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64) * 0.05, torch.randn(96) * 0.1
    x = torch.randn(8, 64)
    exact = torch.nn.functional.linear(x, weight, bias)
    approx = Linear(weight, bias, int8=True)(x)
    rel = (approx - exact).norm() / exact.norm()
    assert rel < 0.03, f"int8 relative error {rel:.3f}"
