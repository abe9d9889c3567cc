"""Weights kept in a GGUF file's own quantized blocks, and the kernel that multiplies with them.

Batch-1 decoding streams every weight once per step. So fewer bytes a weight mean faster steps. No block is
stored wider than the file has it. Q4_1 and Q8_0 are split into quants and float16 scales. That is the
kernel's tuned layout, with the same bytes. Q5_1 and Q5_0 are split too, as Q5_1S (Q4_1's nibbles and a mask
of fifth bits). Q4_0 runs as Q4_1. All of these are exact. Every other block type keeps the file's raw rows.
Q4_K and Q6_K, most of a Q4_K_M file, have decode passes of their own, as do IQ4_XS and IQ4_NL. A mixed
file runs each tensor in its own type. With VNNI, Q8_0 weights end as the kernel's int8 panels alone
(PanelWeight). Those take about their blocks' bytes. The C++ kernel is built once per CPU and cached. The
tests compare it with its pure-torch twin. Results equal the float32 engine's on the dequantized weights, up
to rounding.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from .gguf_file import GGUFFile
from .gguf_load import PERMUTED_QK

log = logging.getLogger("rtserver.quant")

BLOCK = 32
# bytes of one block's quants and its float16 scale fields, per format of the split layout. Q5_1S is no
# GGUF type: a row's Q4_1 nibbles, then its blocks' 32-bit masks of fifth bits.
FORMATS = {"Q4_1": (16, 2), "Q8_0": (32, 1), "Q5_1S": (20, 2)}
# block types the kernel reads as the file's raw rows (engine/kernels/blocks.h)
RAW_TYPES = ("Q4_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
SUPPORTED_TYPES = ("Q4_1", "Q8_0", *RAW_TYPES)
KERNEL_DIR = Path(__file__).parent / "kernels"
KERNEL_SOURCE = KERNEL_DIR / "bindings.cpp"
_NO_TENSOR = torch.empty(0)

# GGUF tensor name (within a block) → the transformers Llama/Qwen2 parameter it becomes
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass
class QuantizedWeight:
    """A [out_features, in_features] weight as blocks of 32 along each row. `qs` holds the quants ([out, in
    / 32 * quant bytes], uint8). `scales` holds the fields ([out, in / 32, fields], float16).
    """

    format: str  # "Q4_1" | "Q8_0" | "Q5_1S"
    qs: torch.Tensor
    scales: torch.Tensor
    shipped: str = ""  # the file's block type, where it differs (Q4_0 runs as Q4_1, Q5_1 as Q5_1S, …)

    def __post_init__(self) -> None:
        self.shipped = self.shipped or self.format

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] // FORMATS[self.format][0] * BLOCK

    @property
    def args(self) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
        """How the kernel's functions take a weight. Per part: its format, quants and scales."""
        return [self.format], [self.qs], [self.scales]

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + self.scales.numel() * self.scales.element_size()

    @staticmethod
    def cat(weights: list[BlockWeight]) -> BlockWeight:
        """Several weights over the same input as one, rows stacked, as the runner fuses q/k/v. One weight
        where they share a type, else a StackedWeight of the parts.
        """
        return cat(weights)

    def quants(self) -> torch.Tensor:
        """The integer quants, unpacked: [out, in / 32, 32]. Q4_1 0..15 and Q5_1S 0..31 come as uint8. Q8_0
        comes as int8.
        """
        n, k = self.shape
        nb = k // BLOCK
        if self.format == "Q8_0":
            return self.qs.view(torch.int8).view(n, nb, BLOCK)
        b = self.qs[:, : nb * 16].reshape(n, nb, 16)
        low = torch.cat([b & 15, b >> 4], dim=-1)
        if self.format != "Q5_1S":
            return low
        masks = self.qs[:, nb * 16 :].reshape(n, nb, 4)  # bit j (byte j // 8): weight j's fifth bit
        bits = (masks.repeat_interleave(8, dim=-1) >> torch.arange(8, dtype=torch.uint8).repeat(4)) & 1
        return low | (bits << 4)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of the float32 weight, with `dequantize`'s arithmetic. Used for an embedding lookup
        or a few output-head rows.
        """
        return QuantizedWeight(self.format, self.qs[index], self.scales[index]).dequantize()

    def dequantize(self) -> torch.Tensor:
        """The float32 weight, with the GGUF reader's arithmetic."""
        n, k = self.shape
        s = self.scales.float()
        q = self.quants().float()
        if self.format == "Q8_0":
            return (s[..., :1] * q).view(n, k)
        return (s[..., :1] * q + s[..., 1:2]).view(n, k)


@dataclass
class RawWeight:
    """A [out_features, in_features] weight as raw rows of blocks (uint8 [out, row bytes]). The rows are the
    file's, of any type of RAW_TYPES. gguf-py knows each type's block size.
    """

    format: str
    data: torch.Tensor
    shipped: str = ""  # the file's block type, where it differs

    def __post_init__(self) -> None:
        if self.format not in RAW_TYPES:
            supported = ", ".join(SUPPORTED_TYPES)
            raise ValueError(f"block type {self.format} is not supported (supported: {supported})")
        self.shipped = self.shipped or self.format

    @property
    def shape(self) -> tuple[int, int]:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        weights, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[self.format]]
        return self.data.shape[0], self.data.shape[1] // nbytes * weights

    @property
    def args(self) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
        return [self.format], [self.data], [_NO_TENSOR]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        return RawWeight(self.format, self.data[index]).dequantize()

    def dequantize(self) -> torch.Tensor:
        """The float32 weight: gguf-py's own dequantization."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        out = dequantize(self.data.numpy(), GGMLQuantizationType[self.format])
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).view(self.shape)


# formats kept only as the kernel's int8 panels (no blocks), by the layout each is made from: their
# panels take about their blocks' bytes, and many-row steps then never unpack
PANELS_OF = {"Q8_0": "Q8_0P"}
PANEL_GROUP = {"Q8_0P": 32}  # weights a float32 scale


@dataclass
class PanelWeight:
    """A [out_features, in_features] weight as the kernel's panels of 32 rows only, [out / 32, panel bytes].
    A panel holds its quants first: pairs of columns interleaved across its rows (int8, for 16-bit
    activations), or quads + 128 (uint8, 8-bit). Then come each scale group's 32 scales. The kernel
    reads them at every step size.
    """

    format: str  # a value of PANELS_OF
    data: torch.Tensor
    width: int
    shipped: str

    @staticmethod
    def of(kernel: Kernel, w: QuantizedWeight | RawWeight) -> PanelWeight:
        """`w` unpacked into panels by the kernel. `w` has a format of PANELS_OF, rows a multiple of 32."""
        (fmt,), (qs,), (scales,) = w.args
        to = PANELS_OF[fmt]
        return PanelWeight(to, kernel.panels_of(to, fmt, qs, scales, w.shape[1]), w.shape[1], w.shipped)

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0] * 32, self.width

    @property
    def args(self) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
        return [self.format], [self.data], [_NO_TENSOR]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` as float32. Each quant times its scale, as the blocks it came from dequantize."""
        k, group = self.width, PANEL_GROUP[self.format]
        flat = index.reshape(-1)
        panel, col = flat // 32, flat % 32
        if self.data.dtype == torch.uint8:
            # 8-bit activations' quads: [half][k / 4][16 rows][4 quants + 128]
            quads = self.data[:, : 32 * k].view(-1, 2, k // 4, 16, 4)
            q = quads[panel, col // 16, :, col % 16, :].reshape(-1, k).int() - 128
        else:
            # 16-bit activations' pairs: [half][k / 2][16 rows][2 quants]
            pairs = self.data[:, : 32 * k].view(-1, 2, k // 2, 16, 2)
            q = pairs[panel, col // 16, :, col % 16, :].reshape(-1, k)
        scales = self.data[:, 32 * k :].view(torch.float32).view(-1, k // group, 32)
        d = scales[panel, :, col].repeat_interleave(group, dim=1)
        return (d * q.float()).view(*index.shape, k)

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.shape[0]))


@dataclass
class StackedWeight:
    """Weights of different block types over the same input, rows stacked. An example is a Q4_K_M layer's
    q/k in Q5_0 with v in Q8_0. The kernel runs them part by part, outputs side by side.
    """

    parts: list[Part]

    @property
    def format(self) -> str:
        return "+".join(p.format for p in self.parts)

    @property
    def shipped(self) -> str:
        return "+".join(p.shipped for p in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def args(self) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
        formats, a, b = [], [], []
        for p in self.parts:
            f, x, y = p.args
            formats += f
            a += x
            b += y
        return formats, a, b

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        out = torch.empty(index.numel(), self.shape[1])
        start = 0
        for p in self.parts:
            inside = (index >= start) & (index < start + p.shape[0])
            if inside.any():
                out[inside] = p.rows(index[inside] - start)
            start += p.shape[0]
        return out.view(*index.shape, self.shape[1])

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


Part = QuantizedWeight | RawWeight | PanelWeight
BlockWeight = Part | StackedWeight


def panels_only(kernel: Kernel, w: BlockWeight) -> BlockWeight:
    """`w` with each part that PANELS_OF names kept only as panels. Such parts have rows a multiple of 32."""
    parts = w.parts if isinstance(w, StackedWeight) else [w]
    new = [
        PanelWeight.of(kernel, p)
        if isinstance(p, QuantizedWeight | RawWeight) and p.format in PANELS_OF and p.shape[0] % 32 == 0
        else p
        for p in parts
    ]
    return new[0] if len(new) == 1 else StackedWeight(new)


def cat(weights: list[BlockWeight]) -> BlockWeight:
    """Several weights over the same input as one, rows stacked. Runs of one type are joined into one weight
    (a copy). A mix becomes a StackedWeight.
    """
    if len({w.shape[1] for w in weights}) != 1:
        raise ValueError(f"cannot stack weights of widths {sorted({w.shape[1] for w in weights})}")
    if len(weights) == 1:
        return weights[0]  # nothing to fuse: no copy (memory at start-up)
    parts: list[Part] = []
    for w in weights:
        parts += w.parts if isinstance(w, StackedWeight) else [w]
    runs: list[list[Part]] = []
    for p in parts:
        if runs and type(runs[-1][0]) is type(p) and runs[-1][0].format == p.format:
            runs[-1].append(p)
        else:
            runs.append([p])
    joined = [_join(run) for run in runs]
    return joined[0] if len(joined) == 1 else StackedWeight(joined)


def _join(run: list[Part]) -> Part:
    first = run[0]
    if len(run) == 1:
        return first
    shipped = "+".join(sorted({w.shipped for w in run}))
    if isinstance(first, QuantizedWeight):
        split = [w for w in run if isinstance(w, QuantizedWeight)]
        qs, scales = torch.cat([w.qs for w in split]), torch.cat([w.scales for w in split])
        return QuantizedWeight(first.format, qs, scales, shipped)
    if isinstance(first, PanelWeight):
        panels = [w for w in run if isinstance(w, PanelWeight)]
        return PanelWeight(first.format, torch.cat([w.data for w in panels]), first.width, shipped)
    raws = [w for w in run if isinstance(w, RawWeight)]
    return RawWeight(first.format, torch.cat([w.data for w in raws]), shipped)


def read_gguf_weights(path: Path, model_type: str, n_heads: int, n_kv_heads: int) -> dict[str, BlockWeight]:
    """The quantized linear weights of a GGUF file, under their transformers names. Every type of
    SUPPORTED_TYPES is included. Other tensors (float, IQ1/IQ2/IQ3) are left out; the runner keeps those
    dense.
    """
    return weights_from_file(GGUFFile(path), model_type, n_heads, n_kv_heads)


def weights_from_file(g: GGUFFile, model_type: str, n_heads: int, n_kv_heads: int) -> dict[str, BlockWeight]:
    """read_gguf_weights on an open gguf_file.GGUFFile; only the tensors kept are read."""
    out: dict[str, BlockWeight] = {}
    for t in g.tensors.values():
        fmt = t.qtype.name
        parts = t.name.split(".")
        if fmt not in SUPPORTED_TYPES:
            continue
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in _LAYER_NAMES:
            name = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
        else:
            continue
        raw = g.raw(t.name)  # [rows, blocks * bytes per block]
        rows = raw.shape[0]
        if model_type in PERMUTED_QK and parts[-2] in ("attn_q", "attn_k"):
            # llama.cpp stores q/k rows permuted for its RoPE layout; transformers undoes it on load
            heads = n_heads if parts[-2] == "attn_q" else n_kv_heads
            raw = raw.reshape(heads, rows // heads // 2, 2, raw.shape[1]).swapaxes(1, 2).reshape(rows, -1)
        out[name] = _from_rows(fmt, np.ascontiguousarray(raw))
    return out


def _from_rows(fmt: str, raw: np.ndarray) -> QuantizedWeight | RawWeight:
    """A weight of type `fmt` from its raw rows. Q4_1 / Q8_0 are split into quants and scales. Q4_0 goes as
    Q4_1, Q5_0 and Q5_1 as Q5_1S. Every other type keeps its raw rows.
    """
    if fmt == "Q4_0":
        return _q4_0_as_q4_1(raw)
    if fmt in ("Q5_0", "Q5_1"):
        return _q5_as_q5_1s(fmt, raw)
    if fmt not in FORMATS:
        return RawWeight(fmt, torch.from_numpy(raw))  # the caller's own array (read from the file)
    qbytes, fields = FORMATS[fmt]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 2 * fields + qbytes)
    scales = np.ascontiguousarray(blocks[..., : 2 * fields]).view(np.float16)
    qs = np.ascontiguousarray(blocks[..., 2 * fields :]).reshape(rows, -1)
    return QuantizedWeight(fmt, torch.from_numpy(qs), torch.from_numpy(scales.copy()))


def _q4_0_as_q4_1(raw: np.ndarray) -> QuantizedWeight | RawWeight:
    """Q4_0's d (q - 8) is Q4_1's d q + m with m = -8 d, exactly. Both sides are exact in float32, and
    -8 d in float16 is too. So Q4_0 takes the faster split path. A d that -8 d would overflow stays raw.
    """
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 18)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)
    if not _scales_fit(d, 8):
        return RawWeight("Q4_0", torch.from_numpy(raw))
    scales = np.concatenate([d, (d * np.float16(-8)).astype(np.float16)], axis=-1)
    qs = np.ascontiguousarray(blocks[..., 2:]).reshape(rows, -1)
    return QuantizedWeight("Q4_1", torch.from_numpy(qs), torch.from_numpy(scales), shipped="Q4_0")


def _scales_fit(d: np.ndarray, shift: int) -> bool:
    """Whether every d is finite and -shift d still fits float16. Then it is exact there."""
    return bool(np.isfinite(d).all()) and float(np.abs(d).max(initial=0)) * shift <= 64000


def _q5_as_q5_1s(fmt: str, raw: np.ndarray) -> QuantizedWeight:
    """Q5_1 rows as Q5_1S. A Q5_1 row holds d, m, a 32-bit mask of fifth bits, and Q4_1's nibbles. Q5_1S has
    the same bytes, the nibbles first and the masks after them. So the kernel reads the nibbles as Q4_1's.
    Q5_0's d (q - 16) is Q5_1's d q + m with m = -16 d, exactly. This is as Q4_0's is Q4_1's. A d too large
    for that runs as Q8_0 (q - 16 a byte each, also exact).
    """
    rows, fields = raw.shape[0], 2 if fmt == "Q5_1" else 1
    blocks = raw.reshape(rows, -1, 2 * fields + 20)
    halves = np.ascontiguousarray(blocks[..., : 2 * fields]).view(np.float16)
    masks, nibbles = blocks[..., 2 * fields : 2 * fields + 4], blocks[..., 2 * fields + 4 :]
    if fmt == "Q5_0" and not _scales_fit(halves, 16):
        return _q5_0_as_q8_0(halves, masks, nibbles)
    if fmt == "Q5_0":
        halves = np.concatenate([halves, (halves * np.float16(-16)).astype(np.float16)], axis=-1)
    qs = np.concatenate([nibbles.reshape(rows, -1), masks.reshape(rows, -1)], axis=1)
    return QuantizedWeight("Q5_1S", torch.from_numpy(qs), torch.from_numpy(halves.copy()), shipped=fmt)


def _q5_0_as_q8_0(d: np.ndarray, masks: np.ndarray, nibbles: np.ndarray) -> QuantizedWeight:
    """Q5_0's d (q - 16) as Q8_0's d q8, exactly. Here q8 = q - 16 in [-16, 15]."""
    # bit j of the little-endian mask (bit j % 8 of byte j // 8): weight j's fifth bit
    high = (np.repeat(masks, 8, axis=-1) >> np.tile(np.arange(8, dtype=np.uint8), 4)) & 1
    low = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)  # weights 0-15, then 16-31
    q8 = ((low | (high << 4)).astype(np.int16) - 16).astype(np.int8)
    qs = q8.view(np.uint8).reshape(d.shape[0], -1)
    return QuantizedWeight("Q8_0", torch.from_numpy(qs), torch.from_numpy(d.copy()), shipped="Q5_0")


FIXED_POINT_MAX = 32512.0  # 127 * 256: a block's largest activation still splits into two int8 limbs
BYTE_ACTIVATION_MAX = 127.0  # 8-bit activations (engine.activation_bits = 8), as Q8_0 rows


def fixed_point_reference(x: torch.Tensor, bits: int = 16) -> torch.Tensor:
    """x rounded as the kernel's integer path rounds it. Each block of 32 goes to the nearest multiple of
    max|block| / 32512: 16-bit fixed point, within 1.5e-5 of the block's largest value. At 8 bits it goes
    to the nearest multiple of max|block| / 127, as Q8_0 rows.
    """
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    # tensor / tensor: correctly rounded, as the kernel's float division (torch's scalar / tensor
    # multiplies by a reciprocal, an ulp off at times, which moves a value sitting on .5)
    top = FIXED_POINT_MAX if bits == 16 else BYTE_ACTIVATION_MAX
    inv = torch.where(amax > 0, torch.full_like(amax, top) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv).clamp(-top, top) * (FIXED_POINT_MAX / top)
    return (q * (amax / torch.full_like(amax, FIXED_POINT_MAX))).reshape(m, k)


def reference_matmul(
    x: torch.Tensor, w: BlockWeight, fixed_point: bool = False, bits: int = 16, exact_mins: bool = True
) -> torch.Tensor:
    """x @ W.T through the dequantized float32 weight. The kernel must equal it up to float rounding.
    `fixed_point`: the kernel's integer path, in float64. The scaled quants meet the fixed-point
    activations (`bits` of them). Q4_1's min meets the exact activation sums (16 bits on VNNI), or with
    `exact_mins` False the rounded ones (every integer path at 8 bits).
    """
    if not fixed_point or not isinstance(w, QuantizedWeight):
        return F.linear(x.float(), w.dequantize())
    n, k = w.shape
    xf = fixed_point_reference(x, bits).double()
    if w.format == "Q8_0" or not exact_mins:
        return F.linear(xf, w.dequantize().double()).float()
    s = w.scales.double()
    sums = x.double().view(x.shape[0], k // BLOCK, BLOCK).sum(-1)
    return (F.linear(xf, (s[..., :1] * w.quants().double()).view(n, k)) + sums @ s[..., 1].T).float()


# GGUF file types (general.file_type) whose 8-bit activations held issue 51's judge, on VNNI's dots and on
# AVX2's byte dots alike: mean KLD and top-1 disagreement against the float32 path at most llama.cpp's on
# the same file (docs/benchmarks.md). Q4_1 missed it by a few positions; other types are unmeasured.
EIGHT_BIT_FILE_TYPES = frozenset({15})  # MOSTLY_Q4_K_M


def activation_bits_for(setting: int, kernel: Kernel, file_type: int | None) -> tuple[int, str]:
    """`engine.activation_bits` for this kernel and file (0: auto), and why."""
    if setting:
        return setting, "engine.activation_bits"
    if not (kernel.byte_dots or kernel.fixed_point_activations):
        return 16, "auto: this CPU has no integer dots"
    if file_type in EIGHT_BIT_FILE_TYPES:
        return 8, "auto: this file type held the KL judge at 8 bits"
    return 16, "auto: this file type has not held the KL judge at 8 bits"


# -- the kernel --------------------------------------------------------------------------------------
class Kernel(Protocol):
    """The compiled kernel module as the engine calls it (kernels/bindings.cpp). Every function takes
    contiguous tensors and checks them. It lets go of the GIL while it runs.
    """

    fixed_point_activations: bool  # VNNI: integer dots over 16-bit fixed-point activations
    byte_dots: bool  # AVX2 alone: at 8-bit activations every step runs on byte dots
    decode_passes: list[str]  # block types decoded by passes of their own (kquant_dots.h, kquant_avx2.h)
    FusedLayer: Callable[..., object]  # one decoder layer's weights and switches, checked once

    def q4_1_mm(self, x: torch.Tensor, qs: torch.Tensor, dm: torch.Tensor) -> torch.Tensor: ...
    def q8_0_mm(self, x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor: ...
    def blocks_mm(
        self,
        x: torch.Tensor,
        formats: list[str],
        a: list[torch.Tensor],
        b: list[torch.Tensor],
        panels: list[torch.Tensor] = ...,
    ) -> torch.Tensor: ...
    def unpack_panels(self, format: str, qs: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor: ...
    def panels_of(
        self, to: str, format: str, qs: torch.Tensor, scales: torch.Tensor, k: int
    ) -> torch.Tensor: ...
    def kept_bytes(self, format: str, n: int, k: int) -> int: ...
    def set_panel_rows(self, rows: int) -> None: ...
    def set_activation_bits(self, bits: int) -> None: ...
    def activation_bits(self) -> int: ...
    def dequantize_blocks(self, format: str, qs: torch.Tensor, k: int) -> torch.Tensor: ...
    def decode_attention(self, *args: object) -> torch.Tensor: ...
    def prefill_attention(self, *args: object) -> torch.Tensor: ...
    def move_rows(self, *args: object) -> None: ...
    def layer_forward(self, layer: object, *args: object) -> torch.Tensor: ...
    def release_scratch(self) -> None: ...
    def bind_pool(self, threads: int) -> None: ...
    def pool_stats(self) -> dict[str, int]: ...


_lock = threading.Lock()
_kernel: Kernel | None = None
_kernel_error: str | None = None


def cpu_key() -> str:
    """Names the instruction sets the kernel is compiled for. A cache built on another CPU is not used."""
    try:
        flags = next(
            (
                line.split(":", 1)[1].split()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("flags")
            ),
            [],
        )
    except OSError:
        flags = []
    simd = sorted(f for f in flags if f.startswith(("avx", "fma", "f16c")))
    src = b"".join(p.read_bytes() for p in sorted(KERNEL_DIR.iterdir()) if p.suffix in (".cpp", ".h"))
    what = " ".join([*simd, torch.__version__, platform.machine()]).encode()
    h = hashlib.sha256(src + what)
    return h.hexdigest()[:16]


def load_kernel(cache_dir: Path) -> Kernel | None:
    """The compiled kernel module, built on first use into `cache_dir/kernels/<cpu key>`. A C++ compiler and
    ninja are needed once; it takes ~1 min. None where it cannot be built. The reason is logged and kept in
    `kernel_error()`. The engine then keeps its weights dense.
    """
    global _kernel, _kernel_error
    with _lock:
        if _kernel is not None or _kernel_error is not None:
            return _kernel
        try:
            _kernel = build_kernel(cache_dir)
        except Exception as exc:  # compiler missing, build failure, import failure: all mean "no kernel"
            lines = str(exc).strip().splitlines()
            _kernel_error = f"{type(exc).__name__}: {lines[-1] if lines else ''}"
            log.warning("quantized kernel unavailable, weights stay dense (%s)", _kernel_error)
        return _kernel


def build_kernel(cache_dir: Path, march: str = "native") -> Kernel:
    """The kernel compiled with -march=`march` into `cache_dir/kernels/<key>`, once. Raises where it cannot.
    The tests build an AVX2 one beside the native one, to check that path on an AVX-512 machine.
    """
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    key = cpu_key() if march == "native" else f"{march}_{cpu_key()}"
    build = cache_dir / "kernels" / key
    build.mkdir(parents=True, exist_ok=True)
    with _builder_lock(build):
        module: Kernel = cpp_extension.load(
            name=f"rtserver_quant_{key}",
            sources=[str(KERNEL_SOURCE)],
            extra_cflags=["-O3", f"-march={march}", "-ffp-contract=off"],
            build_directory=str(build),
            verbose=False,
        )
    return module


@contextmanager
def _builder_lock(build: Path) -> Iterator[None]:
    """One builder per build folder, held by the kernel (flock), so it dies with its process.
    torch's own lock is a file that a killed build leaves behind, and every later start would wait on
    it forever; whoever holds our lock knows that file is stale and removes it.
    """
    with open(build / "builder.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        yield


def _put_ninja_on_path() -> None:
    """torch's extension builder runs `ninja` from PATH. The pip package's binary is not there when the
    virtualenv is not activated (`.venv/bin/rtserver serve`).
    """
    try:
        import ninja
    except ImportError:
        return  # a system ninja may still be on PATH
    bin_dir = str(ninja.BIN_DIR)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def kernel_error() -> str | None:
    return _kernel_error


def quantized_matmul(kernel: Kernel, x: torch.Tensor, w: BlockWeight) -> torch.Tensor:
    """x [M, K] float32 @ W.T → [M, N] float32 through the kernel."""
    return kernel.blocks_mm(x, *w.args)


def probe_panel_rows(kernel: Kernel, mlps: list[tuple[BlockWeight, BlockWeight]], repeats: int = 3) -> int:
    """The largest step size (1 to 64 rows) at which the small-step kernel clearly beats the panel path. It
    must win on every layer's MLP blocks (gate/up, down), not one. One layer's weights stay in cache and
    would time only the arithmetic.
    """
    if not mlps:
        return 1

    def at(panel_rows: int) -> Callable[..., None]:
        def run(x: torch.Tensor, h: torch.Tensor) -> None:
            kernel.set_panel_rows(panel_rows)
            for gate_up, down in mlps:
                quantized_matmul(kernel, x, gate_up), quantized_matmul(kernel, h, down)

        return run

    rows = 1
    for m in (2, 4, 8, 16, 32, 64):
        inputs = (torch.randn(m, mlps[0][0].shape[1]), torch.randn(m, mlps[0][1].shape[1]))
        if not _clearly_faster(at(1 << 30), at(0), inputs, repeats):
            break
        rows = m
    return rows


def _clearly_faster(
    fast: Callable[..., object], other: Callable[..., object], inputs: tuple[object, ...], repeats: int
) -> bool:
    """Whether `fast(*inputs)` takes under 0.9 of `other(*inputs)`'s time. Only a clear win counts. The two
    are timed in turns and the best of each kept. So load from other processes slows both alike.
    """
    best = [float("inf"), float("inf")]
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            other(*inputs)
            t1 = time.perf_counter()
            fast(*inputs)
            t2 = time.perf_counter()
            best = [min(best[0], t1 - t0), min(best[1], t2 - t1)]
    return best[1] < 0.9 * best[0]
