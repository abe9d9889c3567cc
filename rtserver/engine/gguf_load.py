"""A GGUF file → a transformers config and model, read natively (no transformers GGUF loader).

The config comes from llama.cpp's metadata keys, the tensors by their GGUF names straight into an
uninitialised model, each dequantized with gguf-py on its own, so nothing but the model is built.
Values equal transformers' own GGUF loading (Llama's q/k rows unpermuted, Gemma's norms less one).
Where the runner multiplies with the file's blocks, `block_decoder` gives the same parameters in
plain modules: serving then never imports transformers' modelling code, a tenth of the process.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from .families import UnsupportedModel, family_of
from .gguf_file import GGUFFile

log = logging.getLogger("rtserver.gguf")

# llama.cpp architecture → transformers model type
MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
    "smollm3": "smollm3",
}
# architectures (named as their transformers model types) whose q/k rows the converter interleaves
PERMUTED_QK = ("llama", "smollm3")

# llama.cpp metadata key (after "<arch>.") → transformers config field
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base": "rope_theta",
}
_TOKEN_IDS = {
    "bos_token_id": "bos",
    "eos_token_id": "eos",
    "pad_token_id": "padding",
    "unk_token_id": "unknown",
}

# transformers parameter (inside model.layers.N) → GGUF tensor (inside blk.N), per family
_COMMON = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER_TENSORS = {
    "llama": {**_COMMON, "post_attention_layernorm": "ffn_norm"},
    "gemma3": {
        **_COMMON,
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
}
_TOP_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def architecture(g: GGUFFile) -> str:
    arch = str(g.field("general.architecture", ""))
    if arch not in MODEL_TYPES:
        supported = ", ".join(MODEL_TYPES)
        why = f"GGUF architecture '{arch}' is not supported (supported: {supported})"
        raise UnsupportedModel(why)
    return arch


def gguf_config(g: GGUFFile) -> Any:
    """The transformers config a GGUF file's metadata describes."""
    from transformers import AutoConfig

    arch = architecture(g)
    fields: dict[str, Any] = {}
    for key, name in _CONFIG_KEYS.items():
        value = g.field(f"{arch}.{key}")
        if value is not None:
            fields[name] = value.item() if isinstance(value, np.generic) else value
    for name, key in _TOKEN_IDS.items():
        value = g.field(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            fields[name] = int(value)
    fields["vocab_size"] = g.tensors["token_embd.weight"].shape[0]
    fields["tie_word_embeddings"] = "output.weight" not in g.tensors
    scaling = g.field(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise UnsupportedModel(f"RoPE scaling '{scaling}' is not supported (linear is)")
        fields["rope_parameters"] = {
            "rope_type": "linear",
            "factor": float(g.field(f"{arch}.rope.scaling.factor")),
            "rope_theta": fields.pop("rope_theta", 10000.0),
        }
    if arch == "gemma3":
        # llama.cpp scales Gemma 3's scores by the head size and alternates five local layers with
        # one global layer; the local RoPE base is Gemma's fixed 10000.
        fields["query_pre_attn_scalar"] = fields.get("head_dim", 256)
        local_base = g.field("gemma3.rope.freq_base_swa")
        if local_base is not None and "rope_parameters" not in fields:
            fields["rope_parameters"] = {
                "full_attention": {"rope_type": "default", "rope_theta": fields.pop("rope_theta", 1e6)},
                "sliding_attention": {"rope_type": "default", "rope_theta": float(local_base)},
            }
    if arch == "smollm3":
        fields["no_rope_layer_interval"] = 4  # llama.cpp's fixed step: every fourth layer has no RoPE
    return AutoConfig.for_model(MODEL_TYPES[arch], **fields)


def _tensor_name(arch: str, hf_name: str) -> str | None:
    """The GGUF tensor holding a transformers parameter, None where the file has no such tensor."""
    base, _, kind = hf_name.rpartition(".")
    if base in _TOP_TENSORS:
        return f"{_TOP_TENSORS[base]}.{kind}"
    parts = base.split(".")
    if parts[:2] != ["model", "layers"]:
        return None
    table = _LAYER_TENSORS["gemma3" if arch == "gemma3" else "llama"]
    inner = table.get(".".join(parts[3:]))
    return None if inner is None else f"blk.{parts[2]}.{inner}.{kind}"


def dequantized(g: GGUFFile, name: str) -> np.ndarray:
    """A tensor as float32, with gguf-py's arithmetic."""
    info = g.tensors[name]
    raw = g.raw(name)
    if info.qtype == GGMLQuantizationType.F32:
        return np.array(raw, dtype=np.float32)
    return np.asarray(dequantize(raw, info.qtype), dtype=np.float32).reshape(info.shape)


def unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores Llama's q/k rows interleaved for its RoPE; transformers' order is halves."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dense_tensor(g: GGUFFile, arch: str, config: Any, name: str) -> torch.Tensor:
    """The file's tensor `name` as float32, as transformers holds it."""
    w = dequantized(g, name)
    if arch in PERMUTED_QK and (".attn_q." in name or ".attn_k." in name):
        heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
        w = unpermute_qk(w, heads)
    if arch == "gemma3" and "norm" in name:
        w = w - np.float32(1.0)  # the converter stored 1 + w
    return torch.from_numpy(np.ascontiguousarray(w))


def dense_model(g: GGUFFile, config: Any) -> Any:
    """The float32 transformers model of a GGUF file's tensors."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    arch = architecture(g)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    params = dict(model.named_parameters())
    missing = []
    with torch.no_grad():
        for hf_name, param in params.items():
            name = _tensor_name(arch, hf_name)
            if name is None or name not in g.tensors:
                missing.append(hf_name)
                continue
            w = _dense_tensor(g, arch, config, name)
            if tuple(w.shape) != tuple(param.shape):
                wants = tuple(param.shape)
                raise UnsupportedModel(f"tensor {name} is {tuple(w.shape)}, the model wants {wants}")
            param.copy_(w)
    tied = config.tie_word_embeddings and missing == ["lm_head.weight"]
    if missing and not tied:
        raise UnsupportedModel(f"no tensors for {', '.join(missing[:4])}")
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    if "rope_freqs.weight" in g.tensors:
        _scale_rope(model, dequantized(g, "rope_freqs.weight"))
    return model.eval().requires_grad_(False)


def _scale_rope(model: Any, factors: np.ndarray) -> None:
    """Llama 3.1's RoPE scaling, which llama.cpp ships as per-frequency divisors (rope_freqs)."""
    rotary = model.model.rotary_emb
    inv = rotary.inv_freq / torch.from_numpy(factors).to(rotary.inv_freq.dtype)
    rotary.inv_freq.copy_(inv)
    if hasattr(rotary, "original_inv_freq"):
        rotary.original_inv_freq = inv.clone()


class _Linear(torch.nn.Module):
    """A linear's parameters under transformers' names. A linear kept in blocks has an empty weight."""

    def __init__(self, out_features: int, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features = out_features
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)


class _Weight(torch.nn.Module):
    """A module holding one weight: a norm's, the embedding's or the output head's."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)


class Rotary(torch.nn.Module):
    """transformers' default and linear RoPE: the same inverse frequencies and the same float
    operations for cos and sin, so the same tables."""

    def __init__(self, config: Any, params: dict[str, Any]):
        super().__init__()
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        if params["rope_type"] == "linear":
            inv_freq = inv_freq / params["factor"]
        elif params["rope_type"] != "default":
            raise UnsupportedModel(f"RoPE type '{params['rope_type']}' is not supported")
        self.inv_freq = inv_freq
        self.original_inv_freq = inv_freq.clone()

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class LayerTypeRotary(torch.nn.Module):
    """Gemma 3's RoPE: one base per layer type (sliding or full attention)."""

    def __init__(self, config: Any):
        super().__init__()
        kinds = set(config.layer_types)
        self.by_type = {kind: Rotary(config, config.rope_parameters[kind]) for kind in kinds}

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.by_type[layer_type](x, position_ids)  # type: ignore[no-any-return]


class BlockDecoder(torch.nn.Module):
    """What the runner reads of a transformers model, for a file it multiplies with in blocks: the
    config, `model.embed_tokens`, `model.norm`, `model.layers[i]` with their linears and norms under
    transformers' names, `model.rotary_emb` and `lm_head`. It cannot run a forward pass itself."""

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.model = torch.nn.Module()
        eos = getattr(config, "eos_token_id", None)
        self.generation_config = SimpleNamespace(eos_token_id=eos)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32


def _layer_shapes(config: Any, arch: str) -> dict[str, tuple[int, ...]]:
    """Each decoder layer's parameter shapes, by name inside the layer, as transformers builds them."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {
        "input_layernorm": (hidden,),
        "post_attention_layernorm": (hidden,),
        "self_attn.q_proj": (q, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, q),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    if family_of(config).qk_norm:
        shapes |= {"self_attn.q_norm": (head_dim,), "self_attn.k_norm": (head_dim,)}
    if arch == "gemma3":
        shapes |= {"pre_feedforward_layernorm": (hidden,), "post_feedforward_layernorm": (hidden,)}
    return shapes


def block_decoder(g: GGUFFile, config: Any, blocks: frozenset[str]) -> BlockDecoder:
    """The decoder's parameters in plain modules; those named in `blocks` stay empty (the runner
    multiplies with their blocks), the rest are dequantized as `dense_model` does. A missing tensor
    or one of the wrong shape is refused, as there."""
    arch = architecture(g)
    table = _LAYER_TENSORS["gemma3" if arch == "gemma3" else "llama"]
    model = BlockDecoder(config)

    def param(hf_name: str, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in g.tensors:
            raise UnsupportedModel(f"no tensors for {hf_name}")
        if g.tensors[name].shape != shape:
            raise UnsupportedModel(f"tensor {name} is {g.tensors[name].shape}, the model wants {shape}")
        return torch.empty(0) if hf_name in blocks else _dense_tensor(g, arch, config, name)

    def linear(hf_base: str, name: str, shape: tuple[int, ...]) -> _Linear:
        weight = param(f"{hf_base}.weight", f"{name}.weight", shape)
        has_bias = f"{name}.bias" in g.tensors
        bias = param(f"{hf_base}.bias", f"{name}.bias", shape[:1]) if has_bias else None
        return _Linear(shape[0], weight, bias)

    def top(hf_base: str, shape: tuple[int, ...]) -> _Weight:
        return _Weight(param(f"{hf_base}.weight", f"{_TOP_TENSORS[hf_base]}.weight", shape))

    inner, hidden = model.model, config.hidden_size
    layers = torch.nn.ModuleList()
    head = (config.vocab_size, hidden)
    inner.embed_tokens = top("model.embed_tokens", head)
    inner.norm = top("model.norm", (hidden,))
    shapes = _layer_shapes(config, arch)
    for i in range(config.num_hidden_layers):
        layer = torch.nn.Module()
        layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
        for sub, shape in shapes.items():
            name, hf_base = f"blk.{i}.{table[sub]}", f"model.layers.{i}.{sub}"
            owner_name, _, leaf = sub.rpartition(".")
            owner = getattr(layer, owner_name) if owner_name else layer
            if leaf.endswith("_proj"):
                owner.add_module(leaf, linear(hf_base, name, shape))
            else:
                owner.add_module(leaf, _Weight(param(f"{hf_base}.weight", f"{name}.weight", shape)))
        layers.append(layer)
    inner.layers = layers
    by_type = getattr(config, "layer_types", None) and config.layer_types[0] in config.rope_parameters
    inner.rotary_emb = LayerTypeRotary(config) if by_type else Rotary(config, config.rope_parameters)
    if "rope_freqs.weight" in g.tensors:
        _scale_rope(model, dequantized(g, "rope_freqs.weight"))
    if config.tie_word_embeddings:
        model.lm_head = inner.embed_tokens
    else:
        model.lm_head = top("lm_head", head)
    return model
