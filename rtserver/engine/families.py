"""Model families the runner knows, and how each one's decoder layer reads its transformers weights.

A family is a few switches on one decoder layer: the norm's arithmetic, per-head q/k norms, norms
around attention and MLP outputs, the MLP's activation, a scaled embedding, sliding-window layers.
Each matches transformers' own modules for that family, so the runner stays equal to their forward.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


class UnsupportedModel(ValueError):
    pass


class RMSNorm:
    """RMS norm with float32 statistics. Llama-style multiplies the weight after casting back to the
    model dtype; Gemma-style multiplies by (1 + weight) in float32 first, as transformers does."""

    def __init__(self, weight: torch.Tensor, eps: float, gemma: bool = False):
        self.weight = weight
        self.eps = eps
        self.gemma = gemma
        self.scale = 1.0 + weight.float() if gemma else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (xf * self.scale).to(x.dtype)
        return self.scale * xf.to(x.dtype)


class NoNorm(RMSNorm):
    """The norm a family does not have: the identity."""

    def __init__(self) -> None:
        super().__init__(torch.empty(0), 0.0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x


NO_NORM = NoNorm()


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


@dataclass(frozen=True)
class Family:
    """What sets a family's decoder layer apart from Llama's."""

    name: str
    gemma_norms: bool = False  # RMSNorm weights as (1 + w), applied before the cast back
    qk_norm: bool = False  # an RMS norm over each q and k head before RoPE
    sandwich_norms: bool = False  # norms on the attention and MLP outputs before the residual adds
    activation: str = "silu"  # of the gated MLP: silu or gelu_tanh
    scaled_embedding: bool = False  # embeddings times sqrt(hidden size)

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) if self.activation == "silu" else _gelu_tanh(gate)


LLAMA = Family("llama")
QWEN3 = Family("qwen3", qk_norm=True)
GEMMA3 = Family(
    "gemma3",
    gemma_norms=True,
    qk_norm=True,
    sandwich_norms=True,
    activation="gelu_tanh",
    scaled_embedding=True,
)
FAMILIES: dict[str, Family] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": QWEN3,
    "gemma3_text": GEMMA3,
    "smollm3": LLAMA,  # Llama's layer; some layers without RoPE (rope_tables)
}


def family_of(cfg: Any) -> Family:
    """The family of a transformers config, or a refusal naming what is supported."""
    family = FAMILIES.get(cfg.model_type)
    if family is None:
        raise UnsupportedModel(
            f"model type '{cfg.model_type}' is not supported (supported: {', '.join(FAMILIES)})"
        )
    if getattr(cfg, "mlp_bias", False):
        raise UnsupportedModel("MLP biases are not supported")
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, cap, None) is not None:
            raise UnsupportedModel(f"{cfg.model_type}: {cap} is not supported")
    activation = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    wanted = "gelu_pytorch_tanh" if family.activation == "gelu_tanh" else "silu"
    if activation != wanted:
        raise UnsupportedModel(f"{cfg.model_type}: activation {activation} is not supported ({wanted} is)")
    return family


@dataclass
class LayerNorms:
    """A decoder layer's norms, by where they sit; a family's missing ones are NO_NORM."""

    attn_in: RMSNorm
    mlp_in: RMSNorm
    q: RMSNorm = NO_NORM
    k: RMSNorm = NO_NORM
    attn_out: RMSNorm = NO_NORM
    mlp_out: RMSNorm = NO_NORM


def layer_norms(family: Family, layer: Any, eps: float) -> LayerNorms:
    """The norms of one transformers decoder layer (Llama's post_attention_layernorm is its MLP's
    input norm; Gemma's is the attention output's, and pre_feedforward_layernorm the MLP's input)."""

    def norm(module: Any) -> RMSNorm:
        return RMSNorm(module.weight, eps, family.gemma_norms)

    att = layer.self_attn
    qk = (norm(att.q_norm), norm(att.k_norm)) if family.qk_norm else (NO_NORM, NO_NORM)
    if family.sandwich_norms:
        return LayerNorms(
            attn_in=norm(layer.input_layernorm),
            mlp_in=norm(layer.pre_feedforward_layernorm),
            q=qk[0],
            k=qk[1],
            attn_out=norm(layer.post_attention_layernorm),
            mlp_out=norm(layer.post_feedforward_layernorm),
        )
    return LayerNorms(norm(layer.input_layernorm), norm(layer.post_attention_layernorm), *qk)


def attention_scale(cfg: Any, head_dim: int) -> float:
    """Gemma scales scores by query_pre_attn_scalar, the others by the head size."""
    scale: float = float(getattr(cfg, "query_pre_attn_scalar", None) or head_dim) ** -0.5
    return scale


def layer_windows(cfg: Any) -> list[int]:
    """Per layer, its sliding attention window in tokens (0: the whole context)."""
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None) or 0
    if not getattr(cfg, "use_sliding_window", True):
        window = 0  # Qwen2 and SmolLM3 name sliding layers they only use when this is on
    types = getattr(cfg, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else 0 for t in types]
    if cfg.model_type == "mistral":
        return [window] * n
    return [0] * n


def rope_tables(
    cfg: Any, rotary: Any, positions: int, dtype: torch.dtype
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
    """The (cos, sin) tables by layer type, and each layer's index into them: from the model's own
    rotary module, so scaling variants (Llama 3, linear, Gemma's local base) come out identical.
    SmolLM3's layers without RoPE (`no_rope_layers[i] == 0`) get the identity: cos 1, sin 0."""
    pos = torch.arange(positions)[None]
    probe = torch.zeros(1, dtype=dtype)
    if "layer_type" not in inspect.signature(rotary.forward).parameters:
        cos, sin = rotary(probe, pos)
        tables, index = [(cos[0], sin[0])], [0] * cfg.num_hidden_layers
    else:
        kinds = sorted(set(cfg.layer_types))
        tables = []
        for kind in kinds:
            cos, sin = rotary(probe, pos, kind)
            tables.append((cos[0], sin[0]))
        index = [kinds.index(t) for t in cfg.layer_types]
    uses_rope = getattr(cfg, "no_rope_layers", None)
    if uses_rope and not all(uses_rope):
        cos = tables[0][0]
        tables.append((torch.ones_like(cos), torch.zeros_like(cos)))
        index = [i if uses_rope[li] else len(tables) - 1 for li, i in enumerate(index)]
    return tables, index
