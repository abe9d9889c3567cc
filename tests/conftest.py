"""Shared fixtures: the embedded model (fp32, loaded once) and tiny random models of each family; at the
end of the run, the fuzz summary line (tests/fuzzutil.py) when fuzz tests ran. Servers started in this
process freeze what exists at their start out of the garbage collector; each test ends unfrozen."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from rtserver.engine.model import LoadedModel, load_model


@pytest.fixture(autouse=True)
def _unfreeze_after() -> Iterator[None]:
    """A server's start freezes the process's objects (web/app.py); later tests' garbage must still be
    collected."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def smol() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct in float32 (equality tests need fp32)."""
    return load_model("embedded", dtype="float32", threads=2)


@pytest.fixture(scope="session")
def tiny_qwen2(smol) -> LoadedModel:
    """A randomly initialised 2-layer Qwen2 model (q/k/v biases, GQA) with a real tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    tok = smol.tokenizer
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    model = Qwen2ForCausalLM(cfg).eval().requires_grad_(False)
    # Random biases are zero-initialised; make them count so the bias path is really exercised.
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.bias.normal_(0, 0.5)
    model.generation_config.eos_token_id = tok.eos_token_id
    return LoadedModel(model=model, tokenizer=tok, name="tiny-qwen2", dtype=torch.float32, threads=2)


def _tiny(model, tok, name: str) -> LoadedModel:
    model = model.eval().requires_grad_(False)
    model.generation_config.eos_token_id = tok.eos_token_id
    return LoadedModel(model=model, tokenizer=tok, name=name, dtype=torch.float32, threads=2)


def _ids(tok) -> dict:
    return {
        "vocab_size": len(tok),
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.bos_token_id,
        "pad_token_id": tok.eos_token_id,
    }


def _perturb_norms(model, scale: float = 0.3) -> None:
    """Norm weights start at one value; random ones make the norms' arithmetic count."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * scale)


@pytest.fixture(scope="session")
def tiny_qwen3(smol) -> LoadedModel:
    """A random 3-layer Qwen3 model: per-head q/k RMS norms, GQA, head size apart from hidden / heads."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    tok = smol.tokenizer
    cfg = Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        **_ids(tok),
    )
    model = Qwen3ForCausalLM(cfg)
    _perturb_norms(model)
    return _tiny(model, tok, "tiny-qwen3")


@pytest.fixture(scope="session")
def tiny_gemma3(smol) -> LoadedModel:
    """A random 7-layer Gemma 3 text model: five sliding-window layers of 16 tokens, a global one, one
    more sliding; local and global RoPE bases, GeGLU, sandwich norms, scaled embeddings."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(2)
    tok = smol.tokenizer
    cfg = Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=16,
        max_position_embeddings=2048,
        **_ids(tok),
    )
    model = Gemma3ForCausalLM(cfg)
    _perturb_norms(model)
    return _tiny(model, tok, "tiny-gemma3")


@pytest.fixture(scope="session")
def tiny_llama3(smol) -> LoadedModel:
    """A random 2-layer Llama with Llama 3's RoPE scaling (low frequencies stretched)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    tok = smol.tokenizer
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        **_ids(tok),
    )
    return _tiny(LlamaForCausalLM(cfg), tok, "tiny-llama3")


@pytest.fixture(scope="session")
def tiny_smollm3(smol) -> LoadedModel:
    """A random 4-layer SmolLM3: Llama's layer, the fourth without RoPE."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    torch.manual_seed(4)
    tok = smol.tokenizer
    cfg = SmolLM3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        no_rope_layer_interval=4,
        **_ids(tok),
    )
    assert cfg.no_rope_layers == [1, 1, 1, 0]
    model = SmolLM3ForCausalLM(cfg)
    with torch.no_grad():  # peaked attention, so that where RoPE is left out shows in the logits
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20.0)
            layer.self_attn.k_proj.weight.mul_(20.0)
    return _tiny(model, tok, "tiny-smollm3")


def pytest_terminal_summary(terminalreporter):
    """The fuzz modules' counts, once for the run (and $RTSERVER_REPORT_DIR/fuzz.json)."""
    fuzzutil = sys.modules.get(f"{__package__}.fuzzutil")
    line = fuzzutil.write_summary() if fuzzutil is not None else None
    if line:
        terminalreporter.write_line(line)


def chat_prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def reference_greedy(loaded: LoadedModel, prompt_ids: list[int], n: int) -> list[int]:
    """Plain transformers generate, greedy, exactly n new tokens: the ground truth."""
    out = loaded.model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=loaded.tokenizer.eos_token_id,
    )
    return out[0, len(prompt_ids) :].tolist()


@contextmanager
def activation_bits(kernel, bits: int) -> Iterator[None]:
    """The kernel's integer paths round activations to `bits` inside the block; its width before, after."""
    before = kernel.activation_bits()
    kernel.set_activation_bits(bits)
    try:
        yield
    finally:  # 32: big steps in float32, which the default 16 gives without VNNI
        kernel.set_activation_bits(before if before in (8, 16) else 16)
