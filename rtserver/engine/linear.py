"""Linear layers, one class per weight format, chosen once where the runner builds its layers.

Each computes y = x @ W.T + b its own way: dense in the model dtype, oneDNN-packed float32, float16 or
int8 through fbgemm, or a GGUF file's blocks through the kernel. They share a small interface: the
call, a few output columns (label scoring), the weight as the fused decode layer takes it, and the
linear that serving keeps once the model's own weights are dropped.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from .quant import BlockWeight, Kernel, panels_only

# per part of a block weight: format, quants, scales, panels unpacked once (or an empty tensor)
FusedArgs = tuple[list[str], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]
_NO_PANELS = torch.empty(0, dtype=torch.int8)

# Once the transformers weights are released (serving), float32 linears run from oneDNN-packed copies:
# the weight is reordered once instead of on every call (F.linear reorders it each time), which makes
# the GEMMs at the scheduler's step sizes faster. Results differ from F.linear only in float rounding.
ONEDNN_LINEAR = True


class Linear:
    """What every weight format offers the runner."""

    out_features: int
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def columns(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Output columns `index` in float32. By default the whole product, then the columns."""
        return self(x).float()[:, index]

    def fused_args(self) -> FusedArgs | None:
        """The weight as the kernel's FusedLayer takes it (per part: format, two tensors), or None
        where it cannot."""
        return None

    def release(self) -> Linear:
        """Serving: the linear to keep once the model's own weights are dropped."""
        return self


class DenseLinear(Linear):
    """The weight in the model dtype, through F.linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def columns(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Those rows of the weight only, not the whole matmul."""
        return F.linear(x, self.weight[index]).float()

    def release(self) -> Linear:
        """A oneDNN-packed copy where oneDNN takes the weight (float32), else this linear."""
        packed = _onednn_pack(self.weight) if ONEDNN_LINEAR else None
        return self if packed is None else OneDNNLinear(packed, self.bias, self.out_features)


class OneDNNLinear(Linear):
    """A float32 weight reordered once into oneDNN's blocked layout."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int):
        self.packed, self.bias, self.out_features = packed, bias, out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out


class Float16Linear(Linear):
    """float16 weights, float32 math (fbgemm converts them on the fly): fewer bytes to stream per
    step, outputs equal up to rounding."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.out_features = weight.shape[0]
        self.packed = torch.ops.quantized.linear_prepack_fp16(
            weight.detach().float(), None if bias is None else bias.float()
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.quantized.linear_dynamic_fp16(x, self.packed)
        return out


class Int8Linear(Linear):
    """Per-output-channel int8 weights, activations quantized on the fly per batch (fbgemm's dynamic
    linear): a quarter of the bytes, integer SIMD, answers change noticeably. Its rounding depends on
    the whole batch, so `columns` keeps the default (the whole product)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.out_features = weight.shape[0]
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "quantized tensor creation is deprecated": still the API
            qw = torch.quantize_per_channel(
                w, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8
            )
            self.packed = torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.float())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # reduce_range: 7-bit activations, so AVX2 u8*s8 pair sums cannot saturate int16 (no VNNI here)
        out: torch.Tensor = torch.ops.quantized.linear_dynamic(x, self.packed, True)
        return out


class BlockLinear(Linear):
    """A GGUF file's blocks through the kernel at every step size; many-row steps unpack a panel of
    rows at a time (the kernel's choice), or read the panels `keep_panels` unpacked once. No dense
    weight exists."""

    def __init__(self, blocks: BlockWeight, bias: torch.Tensor | None, kernel: Kernel):
        self.blocks, self.bias, self.kernel = blocks, bias, kernel
        self.out_features = blocks.shape[0]
        self.panels = [_NO_PANELS] * len(blocks.args[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel.blocks_mm(x.float().contiguous(), *self.blocks.args, self.panels)
        return (y if self.bias is None else y + self.bias).to(x.dtype)

    def panel_bytes(self) -> int:
        """What `keep_panels` would hold: about a byte a weight and its scales as float32 (0 without
        VNNI, where the kernel keeps none)."""
        formats, qs, _ = self.blocks.args
        width = self.blocks.shape[1]
        return sum(self.kernel.kept_bytes(f, q.shape[0], width) for f, q in zip(formats, qs))

    def keep_only_panels(self) -> None:
        """Parts whose panels take about their blocks' bytes (Q8_0) keep only those, read
        at every step size: many-row steps skip unpacking them, at no cost in memory."""
        before = self.blocks.args[0]
        self.blocks = panels_only(self.kernel, self.blocks)
        # in place: the runner's fused decode layers hold this list; a part turned panels keeps no others
        self.panels[:] = [
            p if f == g else _NO_PANELS for f, g, p in zip(before, self.blocks.args[0], self.panels)
        ]

    def keep_panels(self) -> None:
        """Unpack the weight's panels once (int8), so many-row steps widen them instead of decoding and
        transposing the blocks every step."""
        formats, qs, scales = self.blocks.args
        width = self.blocks.shape[1]
        # in place: the runner's fused decode layers hold this list
        self.panels[:] = [self.kernel.unpack_panels(f, q, s, width) for f, q, s in zip(formats, qs, scales)]

    def columns(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Those rows dequantized, exact float32."""
        return F.linear(x.float(), self.blocks.rows(index))

    def fused_args(self) -> FusedArgs:
        return (*self.blocks.args, self.panels)


STORAGE: dict[str | None, type[DenseLinear] | type[Float16Linear] | type[Int8Linear]] = {
    None: DenseLinear,
    "float16": Float16Linear,
    "int8": Int8Linear,
}


def stored_linear(weight: torch.Tensor, bias: torch.Tensor | None, storage: str | None) -> Linear:
    """A dense weight stored per the `storage` setting: None (the model dtype), "float16" or "int8"."""
    if storage not in STORAGE:
        raise ValueError(f"unknown weight storage {storage!r}")
    return STORAGE[storage](weight, bias)


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight reordered once into oneDNN's blocked layout (float32 only), or None where unavailable
    (or where a probe disagrees with F.linear)."""
    if weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return None
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)
        probe = torch.linspace(-1, 1, 2 * weight.shape[1]).view(2, -1)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        if not torch.allclose(got, F.linear(probe, weight.detach()), rtol=1e-4, atol=1e-4):
            return None
        return packed
    except (RuntimeError, AttributeError):
        return None


class DenseEmbedding:
    """Token embeddings looked up in a dense table."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class BlockEmbedding:
    """Token embeddings dequantized from the embedding's GGUF blocks, row by row."""

    def __init__(self, blocks: BlockWeight, dtype: torch.dtype):
        self.blocks, self.dtype = blocks, dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.blocks.rows(ids).to(self.dtype)
