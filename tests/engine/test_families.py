"""Each model family's layer code through `Engine` equals transformers' float32 forward token for
token: batched, prompts joining mid-stream, chunked prefill, the prefix cache on. Unknown families are
refused by name."""

from __future__ import annotations

import pytest
import torch

from rtserver.config import EngineSettings
from rtserver.engine.core import Engine
from rtserver.engine.families import UnsupportedModel
from rtserver.engine.model import LoadedModel
from rtserver.engine.plan import StepItem
from rtserver.engine.runner import ModelRunner
from rtserver.engine.sequence import Sequence

from ..conftest import chat_prompt, reference_greedy
from .test_engine import greedy, public_header
from .test_runner import kv_pool

TEXTS = [
    "Tell me a short fact about the number 7.",
    "Hi!",
    "Write a haiku about autumn leaves falling on a quiet lake at dusk, please.",
    "What is the capital of France? Answer in one sentence.",
    "Count from one to five.",
    "Why is the sky blue?",
    "Name three colours.",
    "My order has not arrived yet and I am getting worried about it.",
]
NEW_TOKENS = 32


@pytest.fixture(params=["tiny_qwen3", "tiny_gemma3", "tiny_llama3", "tiny_qwen2", "tiny_smollm3"])
def family_model(request) -> LoadedModel:
    return request.getfixturevalue(request.param)


@pytest.mark.asyncio
async def test_every_family_equals_transformers_float32_token_for_token(family_model):
    tok = family_model.tokenizer
    prompts = [chat_prompt(tok, t) for t in TEXTS]
    header = public_header(tok)
    # 16-token chunks: prompts cross chunk boundaries and Gemma's 16-token window alike
    engine = Engine(family_model, EngineSettings(prefill_chunk_tokens=16, kv_budget_mb=64))
    engine.start()
    try:
        first = [engine.generate(p, greedy(NEW_TOKENS), public_tokens=header) for p in prompts[:3]]
        seen = 0
        async for _ in first[0]:
            seen += 1
            if seen == 4:  # the rest arrive while the first three decode
                break
        late = [engine.generate(p, greedy(NEW_TOKENS), public_tokens=header) for p in prompts[3:]]
        outputs = [(await s.result()).token_ids for s in first + late]
        assert engine.kv.prefix_hits > 0
    finally:
        await engine.stop()
    for prompt, out in zip(prompts, outputs):
        assert out == reference_greedy(family_model, prompt, NEW_TOKENS)


def _runner_follows_the_config(loaded: LoadedModel, ids: list[int], changed: dict) -> None:
    """Transformers' logits at the prompt's end differ once the config's `changed` fields are set on
    the same weights, and the runner's equal the model's own (it reads those fields as transformers)."""
    model = loaded.model
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0, -1]
        other = type(model)(type(model.config).from_dict({**model.config.to_dict(), **changed})).eval()
        other.load_state_dict(model.state_dict())
        changed_logits = other(torch.tensor([ids])).logits[0, -1]
    assert not torch.allclose(expected, changed_logits, atol=1e-3)
    kv = kv_pool(model.config, 16 << 20)
    runner = ModelRunner(model, kv, 512)
    seq = Sequence(ids, greedy(1), eos_token_ids=set())
    seq.kv, _ = kv.acquire(ids, len(ids) + 1)
    [got] = runner.forward([StepItem(seq, seq.kv, 0, ids, "last")])
    assert got is not None
    torch.testing.assert_close(got[0], expected, rtol=1e-4, atol=1e-4)


def test_sliding_layers_see_only_their_window(tiny_gemma3):
    """A prompt longer than the window: the engine's logits at its end equal transformers', and differ
    from what the same weights give with every layer attending to the whole context."""
    cfg = tiny_gemma3.model.config
    ids = chat_prompt(tiny_gemma3.tokenizer, TEXTS[2])
    assert len(ids) > 2 * cfg.sliding_window
    _runner_follows_the_config(tiny_gemma3, ids, {"layer_types": ["full_attention"] * cfg.num_hidden_layers})


def test_smollm3_layers_without_rope_get_none(tiny_smollm3):
    """SmolLM3's fourth layer has no RoPE: the runner's logits equal transformers', and differ from the
    same weights with RoPE on every layer."""
    cfg = tiny_smollm3.model.config
    ids = chat_prompt(tiny_smollm3.tokenizer, TEXTS[2])
    _runner_follows_the_config(tiny_smollm3, ids, {"no_rope_layers": [1] * cfg.num_hidden_layers})


def test_an_unknown_family_is_refused_by_name(smol):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    refusal = r"model type 'gpt2' is not supported \(supported: llama, .*qwen3"
    with pytest.raises(UnsupportedModel, match=refusal):
        ModelRunner(model, None, 64)  # type: ignore[arg-type]
