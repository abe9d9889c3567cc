"""Each family's GGUF files, made as users' files are made (random weights in the family's shape,
converted and quantized by the pinned llama.cpp): read natively, the float32 engine equals transformers'
float32 forward of the same weights token for token, and dtype gguf on the quantized files answers
as float32 on the same file."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rtserver.config import EngineSettings
from rtserver.engine.backend import SamplingParams
from rtserver.engine.core import Engine
from rtserver.engine.model import LoadedModel, load_model

from ..components import slow_tests_on
from ..conftest import reference_greedy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not slow_tests_on(), reason="slow: set RTSERVER_SLOW_TESTS=1"),
]

SHAPES = ["llama-tiny", "qwen2-tiny", "qwen3-tiny", "gemma3-tiny", "smollm3-tiny"]
TEXTS = [
    "Tell me a short fact about the number 7.",
    "Hi!",
    "Write a haiku about autumn leaves falling on a quiet lake at dusk, please.",
    "What is the capital of France?",
    "Count from one to five.",
    "Why is the sky blue?",
    "Name three colours.",
    "My order has not arrived yet and I am getting worried.",
]
NEW_TOKENS = 32


def _prompts(tok) -> list[list[int]]:
    return [tok(t).input_ids for t in TEXTS]


def _greedy(
    loaded: LoadedModel, prompts: list[list[int]], kv_dtype: str = "auto", activation_bits: int = 0
) -> list[list[int]]:
    async def run() -> list[list[int]]:
        settings = EngineSettings(
            prefill_chunk_tokens=16, kv_budget_mb=64, kv_dtype=kv_dtype, activation_bits=activation_bits
        )
        engine = Engine(loaded, settings)
        engine.start()
        try:
            params = SamplingParams(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
            first = [engine.generate(p, params) for p in prompts[:3]]
            await asyncio.sleep(0.05)  # the rest arrive while the first decode
            streams = first + [engine.generate(p, params) for p in prompts[3:]]
            return [(await s.result()).token_ids for s in streams]
        finally:
            await engine.stop()

    return asyncio.run(run())


@pytest.mark.parametrize("shape", SHAPES)
def test_a_family_file_in_float32_equals_transformers_on_the_same_weights(shape):
    from transformers import AutoModelForCausalLM

    from rtbench.model_files import random_folder, random_gguf

    loaded = load_model(str(random_gguf(shape, "F32")), dtype="float32", threads=2)
    folder = random_folder(shape)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = LoadedModel(reference, loaded.tokenizer, "reference", torch.float32, 2)
    prompts = _prompts(loaded.tokenizer)
    assert _greedy(loaded, prompts) == [reference_greedy(ref, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
def test_a_quantized_family_file_on_its_blocks_answers_as_float32(shape, qtype):
    from rtbench.model_files import random_gguf

    path = str(random_gguf(shape, qtype))
    on_blocks, dense = load_model(path, dtype="gguf", threads=2), load_model(path, dtype="float32", threads=2)
    assert on_blocks.blocks and not dense.blocks
    prompts = _prompts(dense.tokenizer)
    # float32 KV and 16-bit activations: this compares the blocks' arithmetic (16-bit KV and 8-bit
    # activations are judged elsewhere)
    got, want = _greedy(on_blocks, prompts, "float32", activation_bits=16), _greedy(dense, prompts)
    same = sum(a == b for a, b in zip(got, want))
    assert same >= 7, f"{same} of {len(prompts)} greedy answers equal float32's"
