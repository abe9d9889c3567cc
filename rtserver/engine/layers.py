"""The decoder's weights as the runner reads them, built once from a transformers model.

Each decoder layer keeps its norms (families.py) and four linears (q/k/v and gate/up fused), each in
the weight format picked here once (linear.py): the GGUF blocks where the loader gave them, else the
dense weight stored per the `weight_storage` setting. Serving then drops the model's own weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .families import Family, LayerNorms, RMSNorm, layer_norms, layer_windows
from .linear import BlockEmbedding, BlockLinear, DenseEmbedding, Linear, stored_linear
from .quant import BlockWeight, Kernel, cat

EMBED = "model.embed_tokens.weight"


@dataclass
class DecoderLayer:
    norms: LayerNorms
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    window: int  # sliding attention window in tokens, 0 for the whole context
    rope: int  # which RoPE table the layer reads

    @property
    def linears(self) -> tuple[Linear, Linear, Linear, Linear]:
        return self.qkv, self.o, self.gate_up, self.down

    def release(self) -> None:
        """Serving: each linear becomes the one kept once the model's weights go."""
        self.qkv, self.o, self.gate_up, self.down = (lin.release() for lin in self.linears)


class Weights:
    """Embedding, decoder layers, final norm and output head of a model, in the runner's formats.
    `blocks` (with the `kernel`): weights given as GGUF blocks, by transformers parameter name; those
    use only them, and their dense parameters are never read. With `drop_as_built` (serving) a layer's
    linears leave `blocks` as they are built."""

    def __init__(
        self,
        model: Any,
        family: Family,
        storage: str | None,
        blocks: dict[str, BlockWeight],
        kernel: Kernel | None,
        rope_of_layer: list[int],
        drop_as_built: bool = False,
    ):
        cfg, inner = model.config, model.model
        self.model, self.storage, self._blocks, self._kernel = model, storage, blocks, kernel
        self._drop_as_built = drop_as_built
        eps: float = cfg.rms_norm_eps
        self.embed = (
            BlockEmbedding(blocks[EMBED], model.dtype)
            if EMBED in blocks
            else DenseEmbedding(inner.embed_tokens.weight)
        )
        self.norm = RMSNorm(inner.norm.weight, eps, family.gemma_norms)
        # The output head stays dense under float16 storage: fbgemm pads narrow rows (576 wide here) to
        # a larger block, so the packed head is no smaller than the dense one, which is usually the
        # embedding itself and held anyway.
        head = EMBED if getattr(cfg, "tie_word_embeddings", False) else "lm_head.weight"
        self.lm_head = (
            BlockLinear(blocks[head], None, _kernel_of(kernel))
            if head in blocks
            else stored_linear(model.lm_head.weight, None, "int8" if storage == "int8" else None)
        )
        windows = layer_windows(cfg)
        self.layers: list[DecoderLayer] = []
        for li, layer in enumerate(inner.layers):
            att, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                DecoderLayer(
                    norms=layer_norms(family, layer, eps),
                    qkv=self._linear(li, ("q_proj", "k_proj", "v_proj"), att),
                    o=self._linear(li, ("o_proj",), att),
                    gate_up=self._linear(li, ("gate_proj", "up_proj"), mlp),
                    down=self._linear(li, ("down_proj",), mlp),
                    window=windows[li],
                    rope=rope_of_layer[li],
                )
            )
            if drop_as_built and storage is not None:
                drop_parameters(layer)  # now, not after the loop: never both copies of every layer

    def _linear(self, li: int, names: tuple[str, ...], module: Any) -> Linear:
        """One linear of layer `li` over the submodules `names` of `module` (several: fused side by
        side), on its blocks where all of them have blocks."""
        subs = [getattr(module, n) for n in names]
        where = "self_attn" if names[0].endswith(("q_proj", "o_proj")) else "mlp"
        keys = [f"model.layers.{li}.{where}.{n}.weight" for n in names]
        bias = _cat_bias(*subs) if len(subs) > 1 else subs[0].bias
        if all(k in self._blocks for k in keys):
            fused = cat([self._blocks[k] for k in keys])
            if self._drop_as_built:  # the parts fused by a copy go now: never the whole model twice
                for k in keys:
                    del self._blocks[k]
            return BlockLinear(fused, bias, _kernel_of(self._kernel))
        weight = _fuse(*subs, share=self.storage is None) if len(subs) > 1 else subs[0].weight
        return stored_linear(weight, bias, self.storage)

    def release(self) -> None:
        """Serving only (the transformers model cannot run afterwards): drop the model's own weights.
        int8 / float16 storage: its dense linear weights are dead weight (with `drop_as_built` each
        layer's go as soon as its packed copies exist). float32: the linears move to oneDNN-packed
        copies, one layer at a time, so memory never holds both copies of more than one layer. We keep
        our own references to the tensors still read (embedding, norms, a dense output head)."""
        if self.storage is None and self.model.dtype != torch.float32:
            return
        for L, layer in zip(self.layers, self.model.model.layers):
            if self.storage is None:
                L.release()
            drop_parameters(layer)
        drop_parameters(self.model)


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat(
        [
            b if b is not None else torch.zeros(lin.out_features, dtype=lin.weight.dtype)
            for b, lin in zip(biases, linears)
        ]
    )


def _fuse(*linears: torch.nn.Linear, share: bool = True) -> torch.Tensor:
    """One weight for several linears over the same input. With `share` the modules keep views into
    it, so the transformers model still works (tests compare against it) and no weight is held twice;
    without (int8, float16: the fused copy only feeds the packing) the modules are left alone."""
    fused = torch.cat([lin.weight for lin in linears]).contiguous()
    if not share:
        return fused
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(fused[row : row + n], requires_grad=False)
        row += n
    return fused


def drop_parameters(module: torch.nn.Module) -> None:
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            if param.numel():
                setattr(sub, name, torch.nn.Parameter(torch.empty(0, dtype=param.dtype), requires_grad=False))


def _kernel_of(kernel: Kernel | None) -> Kernel:
    """The kernel a block linear multiplies with: a loader gives blocks only with a built kernel."""
    if kernel is None:
        raise ValueError("GGUF blocks need the quantized kernel")
    return kernel
