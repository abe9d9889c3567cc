"""The model shapes random test files are made in: each a config.json as its family publishes one.

| shape       | architecture      | hidden | layers | heads/KV | head_dim | ffn  | vocab  | trait            |
|-------------|-------------------|--------|--------|----------|----------|------|--------|------------------|
| qwen3-0.6b  | Qwen3ForCausalLM  | 1024   | 28     | 16/8     | 128      | 3072 | 151936 | Qwen3-0.6B's     |
| llama3.2-1b | LlamaForCausalLM  | 2048   | 16     | 32/8     | 64       | 8192 | 128256 | Llama-3.2-1B's   |
| qwen2.5-1.5b | Qwen2ForCausalLM | 1536   | 28     | 12/2     | 128      | 8960 | 151936 | Qwen2.5-1.5B's   |
| llama-tiny  | LlamaForCausalLM  | 256    | 3      | 4/2      | 64       | 512  | 49152  | llama3 rope      |
| qwen2-tiny  | Qwen2ForCausalLM  | 256    | 3      | 4/2      | 64       | 768  | 49216  | q/k/v biases     |
| qwen3-tiny  | Qwen3ForCausalLM  | 256    | 3      | 4/2      | 128      | 768  | 49280  | q/k norms        |
| gemma3-tiny | Gemma3ForCausalLM | 256    | 7      | 4/1      | 256      | 512  | 49152  | 5 local+1 global |
| smollm3-tiny | SmolLM3ForCausalLM | 256  | 4      | 4/2      | 64       | 512  | 49152  | 4th: no RoPE |

The full-size shapes are their families' published config.json (bfloat16 weights, tied embeddings),
so their files have the real bytes a token reads, the output head of a real vocabulary included. The
tiny shapes keep each family's traits at widths that are multiples of 256, so the K-quants
(256-wide blocks) apply to every linear. A vocab past the tokenizer's 49152 ids gets the converter's
padding tokens. Token ids (bos, eos, pad) come from the shared tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Shape:
    """A named model shape: its config.json and whether it is small enough for CI."""

    name: str
    config: dict[str, Any]
    tiny: bool

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])


QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

LLAMA_TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 4,
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "use_cache": True,
    "vocab_size": 49152,
}

QWEN2_TINY = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 768,
    "max_position_embeddings": 32768,
    "max_window_layers": 3,
    "num_attention_heads": 4,
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 49216,  # past the tokenizer's 49152: the converter's padding tokens fill the rest
}

LLAMA3_2_1B = {  # Llama-3.2-1B(-Instruct)'s config.json; ids come from the shared tokenizer
    **LLAMA_TINY,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}

QWEN2_5_1_5B = {  # Qwen2.5-1.5B-Instruct's config.json
    **QWEN2_TINY,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "max_window_layers": 21,
    "num_attention_heads": 12,
    "num_hidden_layers": 28,
    "num_key_value_heads": 2,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}

QWEN3_TINY = {
    **QWEN3_0_6B,
    "hidden_size": 256,
    "intermediate_size": 768,
    "max_window_layers": 3,
    "num_attention_heads": 4,
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "torch_dtype": "float32",
    "vocab_size": 49280,
}

_GEMMA3_LAYERS = 7  # five sliding, the sixth global, then sliding again: the pattern wraps once

GEMMA3_TINY = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "head_dim": 256,  # wider than hidden / heads, as in Gemma 3 270M
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "layer_types": [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(_GEMMA3_LAYERS)
    ],
    "max_position_embeddings": 32768,
    "num_attention_heads": 4,
    "num_hidden_layers": _GEMMA3_LAYERS,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256,  # = head_dim, as in Gemma 3 270M and 1B (llama.cpp assumes it)
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 16,  # small, so prompts of a few dozen tokens cross it
    "torch_dtype": "float32",
    "use_bidirectional_attention": False,
    "use_cache": True,
    "vocab_size": 49152,  # Gemma's converter cuts the embedding to the tokenizer's size anyway
}

SMOLLM3_TINY = {
    "architectures": ["SmolLM3ForCausalLM"],
    "model_type": "smollm3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "max_position_embeddings": 65536,
    "mlp_bias": False,
    "no_rope_layer_interval": 4,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 5000000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 49152,
}

SHAPES: dict[str, Shape] = {
    shape.name: shape
    for shape in (
        Shape("qwen3-0.6b", QWEN3_0_6B, tiny=False),
        Shape("llama3.2-1b", LLAMA3_2_1B, tiny=False),
        Shape("qwen2.5-1.5b", QWEN2_5_1_5B, tiny=False),
        Shape("llama-tiny", LLAMA_TINY, tiny=True),
        Shape("qwen2-tiny", QWEN2_TINY, tiny=True),
        Shape("qwen3-tiny", QWEN3_TINY, tiny=True),
        Shape("gemma3-tiny", GEMMA3_TINY, tiny=True),
        Shape("smollm3-tiny", SMOLLM3_TINY, tiny=True),
    )
}

TINY = [name for name, shape in SHAPES.items() if shape.tiny]
