"""Every GGUF block type the kernel reads (engine/quant.py, engine/kernels/blocks.h): dequantization
equals gguf-py's exactly, the kernel's matmul and fused decode layers equal a float32 matmul of the
dequantized weight within float32's summation bound, a stacked weight of mixed types runs part by
part, unsupported types are refused by name, and a requantized Q4_K_M file runs every linear on its
blocks with float32's greedy tokens."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from rtserver.config import EngineSettings
from rtserver.engine import quant
from rtserver.engine.backend import SamplingParams
from rtserver.engine.gguf_file import GGUFFile
from rtserver.engine.kv import KVCacheManager
from rtserver.engine.linear import BlockLinear
from rtserver.engine.model import load_model
from rtserver.engine.plan import StepItem
from rtserver.engine.runner import ModelRunner
from rtserver.engine.sequence import Sequence

from ..components import missing
from ..conftest import activation_bits, chat_prompt

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]
# per type: byte offsets of its float16 fields in a block, and a magnitude for them that keeps the
# dequantized weights near 0.1 (K-types multiply d by 6- or 8-bit sub-block scales)
HALVES = {
    "Q4_0": ([0], 1e-2),
    "Q4_1": ([0, 2], 1e-2),
    "Q5_0": ([0], 1e-2),
    "Q5_1": ([0, 2], 5e-3),
    "Q8_0": ([0], 1e-3),
    "Q2_K": ([80, 82], 2e-3),
    "Q3_K": ([108], 1e-3),
    "Q4_K": ([0, 2], 5e-4),
    "Q5_K": ([0, 2], 2e-4),
    "Q6_K": ([208], 1e-4),
    "IQ4_NL": ([0], 1e-3),
    "IQ4_XS": ([0], 1e-4),
}
U = 2.0**-24  # float32's unit roundoff


@pytest.fixture(scope="module")
def kernel():
    k = quant.load_kernel(Path("~/.cache/rtserver").expanduser())
    if k is None:
        pytest.fail(f"the quantized kernel did not build: {quant.kernel_error()}")
    return k


@pytest.fixture(autouse=True)
def kernel_defaults(kernel):
    """Each test starts on the small-step path at the default width: an engine started before set its
    probed switch and its activations' width."""
    kernel.set_panel_rows(1 << 40)
    kernel.set_activation_bits(16)  # auto's width for the embedded model (Q4_1)


def unsigned_q6_k(kernel) -> bool:
    """VNNI's Q6_K pass takes its quants as 0..63 and the 32 off against the exact activation sums; AVX2's
    takes the 32 off the rounded ones, so there the signed quants meet the rounding."""
    return kernel.fixed_point_activations and "Q6_K" in kernel.decode_passes


def block_size(fmt: str) -> tuple[int, int]:
    """(weights, bytes) of one block of `fmt`."""
    return GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]


def random_rows(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """n rows of width k in `fmt`'s raw layout: random quant bytes, random float16 fields."""
    weights, nbytes = block_size(fmt)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // weights, nbytes), dtype=np.uint8)
    offsets, scale = HALVES[fmt]
    for at in offsets:
        half = (rng.standard_normal((n, k // weights)) * scale).astype(np.float16)
        raw[..., at : at + 2] = half.view(np.uint8).reshape(n, k // weights, 2)
    return raw.reshape(n, -1)


def weight(fmt: str, raw: np.ndarray) -> quant.BlockWeight:
    return quant._from_rows(fmt, raw)


def widths(fmt: str) -> tuple[int, ...]:
    return (256, 1536) if block_size(fmt)[0] == 256 else (32, 96, 576)


MINS = {"Q4_1": 2, "Q5_1": 2, "Q2_K": 82, "Q4_K": 2, "Q5_K": 2}  # the float16 min (dmin) of a block
# the K-quant decode passes (kernels/kquant_dots.h) take Q6_K's quants as 0..63 with -32 d sc aside
UNSIGNED_Q6_K = 32
# types that run with a min m = -shift d (Q4_0 as Q4_1, Q5_0 as Q5_1S): (block bytes, shift)
SHIFTED = {"Q4_0": (18, 8), "Q5_0": (22, 16)}


def scaled_quants(fmt: str, raw: np.ndarray, kernel) -> torch.Tensor:
    """D * q of each weight (its value less the block's offset M): what meets the activations'
    fixed-point rounding on the integer path, while M meets their exact sums."""
    if fmt in SHIFTED:  # the quants meet the activations unshifted
        nbytes, shift = SHIFTED[fmt]
        d = (
            np.ascontiguousarray(raw.reshape(raw.shape[0], -1, nbytes)[..., :2])
            .view(np.float16)
            .astype(np.float32)
        )
        shifted = dequantize(raw, GGMLQuantizationType[fmt]).astype(np.float32)
        return torch.from_numpy(shifted + shift * np.repeat(d[..., 0], 32, axis=-1))
    if fmt in ("IQ4_NL", "IQ4_XS"):  # their passes take the table's values + 128, and 128 d off aside
        dense = torch.from_numpy(dequantize(raw, GGMLQuantizationType[fmt]).astype(np.float32))
        return dense + 128 * iq4_scales(fmt, raw)
    if fmt == "Q6_K" and unsigned_q6_k(kernel):
        blocks = raw.reshape(raw.shape[0], -1, 210)
        d = np.ascontiguousarray(blocks[..., 208:210]).view(np.float16).astype(np.float32)
        sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
        shift = np.repeat(d * sc, 16, axis=-1).reshape(raw.shape[0], -1) * UNSIGNED_Q6_K
        return torch.from_numpy(dequantize(raw, GGMLQuantizationType[fmt]).astype(np.float32) + shift)
    if fmt in MINS:
        weights, nbytes = block_size(fmt)
        raw = raw.copy().reshape(raw.shape[0], -1, nbytes)
        raw[..., MINS[fmt] : MINS[fmt] + 2] = 0
        raw = raw.reshape(raw.shape[0], -1)
    return torch.from_numpy(dequantize(raw, GGMLQuantizationType[fmt]).astype(np.float32))


def iq4_scales(fmt: str, raw: np.ndarray) -> torch.Tensor:
    """Each weight's d (IQ4_NL) or d (ls - 32) (IQ4_XS): the table's value 1 dequantized, weight by weight."""
    weights, nbytes = block_size(fmt)
    ones = raw.copy().reshape(raw.shape[0], -1, nbytes)
    ones[..., nbytes - weights // 2 :] = 0x88  # index 8 in both nibbles: the table's value 1
    dense = dequantize(ones.reshape(raw.shape[0], -1), GGMLQuantizationType[fmt]).astype(np.float32)
    return torch.from_numpy(dense)


def summation_bound(
    x: torch.Tensor, w: torch.Tensor, kernel, scaled: torch.Tensor | None = None
) -> torch.Tensor:
    """|kernel - F.linear| allowed: both sum K products of the same float32 weights in float32, each
    within gamma_K * sum|x||w| of the exact sum (gamma_K = K u / (1 - K u)), hence twice that apart.
    The integer paths (VNNI; on AVX2 the K-quants' decode passes) add their activations' rounding:
    half a step of max|block| / 32512 at 16 bits (/ 127 at 8) per activation, times |D q| (`scaled`;
    the weight itself where no block has an offset, or where the offsets meet the rounded activations'
    sums, as every integer path does at 8 bits)."""
    k = x.shape[1]
    gamma = k * U / (1 - k * U)
    bound = 2 * gamma * (x.abs() @ w.abs().T)
    if kernel.fixed_point_activations or kernel.decode_passes:
        eight = kernel.activation_bits() == 8
        top = quant.BYTE_ACTIVATION_MAX if eight else quant.FIXED_POINT_MAX
        step = x.view(x.shape[0], -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(x.shape)
        bound = bound + (step / top / 2) @ (w if scaled is None or eight else scaled).abs().T
    return bound + 1e-30


@pytest.mark.parametrize("fmt", TYPES)
def test_dequantize_equals_gguf_py(kernel, fmt):
    """Random blocks: the weight's dequantize (and for raw types the kernel's own decode) is bit-equal to
    gguf-py's; rows() picks rows with the same arithmetic."""
    for k in widths(fmt):
        raw = random_rows(fmt, 24, k, seed=k)
        want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[fmt]).astype(np.float32))
        w = weight(fmt, raw)
        assert w.shape == (24, k)
        assert torch.equal(w.dequantize(), want)
        assert torch.equal(w.rows(torch.tensor([5, 0, 23])), want[[5, 0, 23]])
        if fmt in quant.RAW_TYPES:
            assert torch.equal(kernel.dequantize_blocks(fmt, torch.from_numpy(raw), k), want)


@pytest.mark.parametrize(("fmt", "runs_as"), [("Q4_0", "Q4_0"), ("Q5_0", "Q8_0")])
def test_a_scale_too_large_for_a_float16_min_keeps_an_exact_layout(kernel, fmt, runs_as):
    """Q4_0 and Q5_0 run with a min of -8 d and -16 d; where that overflows float16 (d near 8,000 or
    4,000), the tensor keeps its raw rows (Q4_0) or runs as Q8_0 (Q5_0), still equal to gguf-py's."""
    nbytes, shift = SHIFTED[fmt]
    raw = random_rows(fmt, 8, 96, seed=4).reshape(8, -1, nbytes)
    raw[3, 1, :2] = np.array([70000.0 / shift], dtype=np.float16).view(np.uint8)
    raw = raw.reshape(8, -1)
    w = weight(fmt, raw)
    assert w.format == runs_as and w.shipped == fmt
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[fmt]).astype(np.float32))
    assert torch.equal(w.dequantize(), want)
    x = torch.randn(3, 96)
    got = quant.quantized_matmul(kernel, x, w)
    assert ((got - F.linear(x, want)).abs() <= summation_bound(x, want, kernel)).all()


def assert_within_summation_bound(kernel, fmt: str, n: int, seed: int, steps: tuple, zero_row: int) -> None:
    """n weight rows of `fmt` at every width, steps of each size in `steps`: the kernel within the
    summation bound of a float32 matmul; activations of mixed magnitudes, one row's first block zero."""
    for k in widths(fmt):
        raw = random_rows(fmt, n, k, seed=k + seed)
        w = weight(fmt, raw)
        dense, scaled = w.dequantize(), scaled_quants(fmt, raw, kernel)
        for m in steps:
            x = torch.randn(m, k) * torch.rand(m, k) * 4
            x[zero_row, :32] = 0.0
            got = quant.quantized_matmul(kernel, x, w)
            want = F.linear(x, dense)
            assert ((got - want).abs() <= summation_bound(x, dense, kernel, scaled)).all(), (fmt, k, m)


@pytest.mark.parametrize("fmt", TYPES)
def test_kernel_equals_a_float32_matmul_within_the_summation_bound(kernel, fmt):
    """Steps of 1, 2, 5 and 16 rows (the kernel's 4-row passes and their remainders), widths of one
    block to many, activations of mixed magnitudes with a zero block."""
    assert_within_summation_bound(kernel, fmt, 40, 1, (1, 2, 5, 16), 0)


@pytest.fixture(scope="module")
def avx2_kernel():
    """The kernel built for AVX2 alone (Haswell), whatever this CPU has: checked here too."""
    return quant.build_kernel(Path("~/.cache/rtserver").expanduser(), march="haswell")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", TYPES)
def test_the_avx2_build_equals_a_float32_matmul_within_the_summation_bound(avx2_kernel, fmt):
    """The same bound on the AVX2 build: each block unpacked to float, but for the K-quants' small steps
    (int16 dots, vpmaddwd); its panels in float32 at 16 bits and on byte dots (vpmaddubsw) at 8."""
    assert not avx2_kernel.fixed_point_activations
    assert avx2_kernel.decode_passes == ["Q4_K", "Q5_K", "Q6_K"]
    assert_within_summation_bound(avx2_kernel, fmt, 40, 3, (1, 2, 5, 16), 0)
    avx2_kernel.set_panel_rows(0)
    try:
        with activation_bits(avx2_kernel, 8):
            assert avx2_kernel.activation_bits() == 8
            assert_within_summation_bound(avx2_kernel, fmt, 37, 2, (1, 6, 13), -1)
            assert_extremes_within_summation_bound(avx2_kernel, fmt)
        assert avx2_kernel.activation_bits() == 32
    finally:
        avx2_kernel.set_panel_rows(1 << 40)


@pytest.fixture(scope="module")
def eight_bit_kernels(kernel, request):
    """The kernels whose 8-bit paths are checked: this CPU's, and the AVX2 build where this CPU has VNNI."""
    if not kernel.fixed_point_activations:
        return [kernel]
    return [kernel, request.getfixturevalue("avx2_kernel")]


@pytest.mark.parametrize("panel_rows", [0, 1 << 40], ids=["panels", "small steps"])
@pytest.mark.parametrize("fmt", TYPES)
def test_8_bit_dots_equal_a_float32_matmul_of_the_rounded_activations(eight_bit_kernels, fmt, panel_rows):
    """At 8 bits, big steps and small, VNNI's dots and AVX2's byte dots: a float32 matmul of the
    activations as fixed_point_reference rounds them, mins included (they meet the rounded sums), up to
    float32 summation. So a row's result does not depend on the step's size. Tighter than the bound
    above, which allows each activation half a step."""
    for kernel in eight_bit_kernels:
        kernel.set_panel_rows(panel_rows)
        try:
            with activation_bits(kernel, 8):
                for k in widths(fmt):
                    w = weight(fmt, random_rows(fmt, 37, k, seed=k + 5))
                    dense = w.dequantize()
                    for m in (1, 3, 6, 15):  # one row; the panels' 4-row blocks and remainders of 2 and 3
                        x = torch.randn(m, k) * torch.rand(m, k) * 4
                        x[0, :32] = 0.0
                        rounded = quant.fixed_point_reference(x, 8)
                        got = quant.quantized_matmul(kernel, x, w)
                        gamma = k * U / (1 - k * U)
                        bound = 2 * gamma * (rounded.abs() @ dense.abs().T) + 1e-30
                        assert ((got - F.linear(rounded, dense)).abs() <= bound).all(), (fmt, k, m)
        finally:
            kernel.set_panel_rows(1 << 40)


# per type: the bytes of a block that hold its quants, and the byte that gives every quant its largest
# magnitude (blocks.h's kMaxQ), Q8_0's -128 included
EXTREMES = {
    "Q4_0": (2, 18, 0x00),
    "Q4_1": (4, 20, 0xFF),
    "Q5_0": (2, 22, 0x00),
    "Q5_1": (4, 24, 0xFF),
    "Q8_0": (2, 34, 0x80),
    "Q2_K": (16, 80, 0xFF),
    "Q3_K": (0, 96, 0x00),
    "Q4_K": (16, 144, 0xFF),
    "Q5_K": (16, 176, 0xFF),
    "Q6_K": (0, 192, 0x00),
    "IQ4_NL": (2, 18, 0x00),
    "IQ4_XS": (8, 136, 0x00),
}


def assert_extremes_within_summation_bound(kernel, fmt: str) -> None:
    """Every quant at its largest magnitude, every activation at +-127 of its block: a many-row step's
    products all of one sign, the most its integer sums ever hold, within the summation bound."""
    start, end, byte = EXTREMES[fmt]
    _, nbytes = block_size(fmt)
    k = widths(fmt)[-1]
    raw = random_rows(fmt, 40, k, seed=11).reshape(40, -1, nbytes)
    raw[..., start:end] = byte
    raw = raw.reshape(40, -1)
    w = weight(fmt, raw)
    dense = w.dequantize()
    x = torch.ones(13, k)
    x[7:] = -1.0
    got = quant.quantized_matmul(kernel, x, w)
    bound = summation_bound(x, dense, kernel, scaled_quants(fmt, raw, kernel))
    assert ((got - F.linear(x, dense)).abs() <= bound).all(), fmt


@pytest.mark.parametrize("panel_rows", [0, 1 << 40], ids=["panels", "small steps"])
@pytest.mark.parametrize("fmt", TYPES)
def test_quants_at_their_extremes_stay_within_the_bound_at_8_bits(kernel, fmt, panel_rows):
    """8-bit steps (VNNI's quads; AVX2's byte dots, whose panels' int16 sums kMaxQ bounds) at the
    largest products the blocks can make."""
    kernel.set_panel_rows(panel_rows)
    try:
        with activation_bits(kernel, 8):
            assert_extremes_within_summation_bound(kernel, fmt)
    finally:
        kernel.set_panel_rows(1 << 40)


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("fmt", TYPES)
def test_the_panel_path_equals_a_float32_matmul_within_the_summation_bound(kernel, fmt, bits):
    """Many-row steps run on panels of weight rows (integer dots on VNNI, else a float32 GEMM): 6-row
    register blocks and their remainders, a last panel of few rows: the small steps' bound, at 8 and 16
    bits."""
    kernel.set_panel_rows(0)
    try:
        with activation_bits(kernel, bits):
            assert_within_summation_bound(kernel, fmt, 37, 2, (1, 6, 13, 40), -1)
    finally:
        kernel.set_panel_rows(1 << 40)


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("fmt", TYPES)
def test_panels_kept_unpacked_give_the_same_products_as_unpacking_each_step(kernel, fmt, bits):
    """A weight's panels unpacked once at load (int8) hold the quants the step would unpack: the products
    are identical, bit for bit, on a last panel of few rows too, and when the step's rows go in several
    blocks (1100 rows: more than a block's 256 KB of activations). Without VNNI there are none to keep."""
    if not kernel.fixed_point_activations:
        w = weight(fmt, random_rows(fmt, 8, 256, 1))
        assert kernel.unpack_panels(*[a[0] for a in w.args], 256).numel() == 0
        return
    kernel.set_panel_rows(0)
    try:
        with activation_bits(kernel, bits):
            for k in widths(fmt):
                w = weight(fmt, random_rows(fmt, 37, k, seed=k + 3))
                formats, qs, scales = w.args
                panels = [kernel.unpack_panels(f, q, sc, k) for f, q, sc in zip(formats, qs, scales)]
                # two panels of 32 rows: a byte a quant, and the scale groups' D (and M) as float32
                assert [p.numel() for p in panels] == [kernel.kept_bytes(formats[0], 37, k)]
                assert 64 * k < panels[0].numel() <= 64 * k * 3 // 2
                for rows in (13, 1100):
                    x = torch.randn(rows, k) * torch.rand(rows, k) * 4
                    assert torch.equal(kernel.blocks_mm(x, *w.args, panels), kernel.blocks_mm(x, *w.args))
    finally:
        kernel.set_panel_rows(1 << 40)


@pytest.mark.parametrize(("fmt", "panels"), [("Q8_0", "Q8_0P")])
def test_weights_kept_only_as_panels_read_and_multiply_as_their_blocks(kernel, fmt, panels):
    """Q8_0 kept only as int8 panels: no more bytes than its blocks (a sixteenth more), the same float32
    weight bit for bit (rows too: an embedding lookup), and at every step size the products of the kept
    panels; without VNNI the kernel refuses them."""
    k = 256
    w = weight(fmt, random_rows(fmt, 64, k, seed=9))
    if not kernel.fixed_point_activations:
        with pytest.raises(RuntimeError, match=f"{panels} panels need a CPU with VNNI"):
            none = [torch.empty(0)]
            kernel.blocks_mm(torch.randn(1, k), [panels], [torch.zeros(2, 1, dtype=torch.uint8)], none, none)
        return
    p = quant.panels_only(kernel, w)
    assert isinstance(p, quant.PanelWeight) and (p.format, p.shipped, p.shape) == (panels, fmt, (64, k))
    assert p.nbytes <= w.nbytes * 17 // 16
    assert torch.equal(p.dequantize(), w.dequantize())
    index = torch.tensor([[63, 0], [17, 32]])
    assert torch.equal(p.rows(index), w.dequantize()[index])
    kept = [kernel.unpack_panels(*[a[0] for a in w.args], k)]
    kernel.set_panel_rows(0)
    try:
        for m in (1, 2, 5, 13, 40):
            x = torch.randn(m, k) * torch.rand(m, k) * 4
            got = kernel.blocks_mm(x, *p.args, [torch.empty(0)])
            assert torch.equal(got, kernel.blocks_mm(x, *w.args, kept))
    finally:
        kernel.set_panel_rows(1 << 40)
    with pytest.raises(RuntimeError, match=f"{panels} panels do not match"):
        kernel.blocks_mm(torch.randn(1, 2 * k), *p.args, [torch.empty(0)])
    with pytest.raises(RuntimeError, match=f"{panels} panels need rows a multiple of 32"):
        kernel.panels_of(panels, *[a[0] for a in weight(fmt, random_rows(fmt, 40, k, seed=1)).args], k)
    with pytest.raises(RuntimeError, match="Q8_0P panels are made from Q8_0"):
        kernel.panels_of("Q8_0P", *[a[0] for a in weight("Q4_1", random_rows("Q4_1", 32, k, seed=2)).args], k)


def test_panels_made_for_one_activation_width_are_refused_under_the_other(kernel):
    """Kept panels and panel formats carry their layout in their dtype: int8 pairs for 16-bit
    activations, uint8 quads + 128 for 8-bit. Read under the other width they fail, clearly."""
    if not kernel.fixed_point_activations:
        assert kernel.activation_bits() == 32
        return
    w = weight("Q8_0", random_rows("Q8_0", 64, 256, seed=5))
    with activation_bits(kernel, 16):
        kept, p = kernel.unpack_panels(*[a[0] for a in w.args], 256), quant.panels_only(kernel, w)
    assert kept.dtype == torch.int8 and p.data.dtype == torch.int8
    assert torch.equal(p.dequantize(), w.dequantize())
    with activation_bits(kernel, 8):
        assert kernel.unpack_panels(*[a[0] for a in w.args], 256).dtype == torch.uint8
        with pytest.raises(RuntimeError, match="panels made for 16-bit activations, but the kernel rounds"):
            kernel.blocks_mm(torch.randn(40, 256), *w.args, [kept])
        with pytest.raises(RuntimeError, match="panels made for 16-bit activations"):
            kernel.blocks_mm(torch.randn(1, 256), *p.args, [torch.empty(0)])


def test_panels_of_another_weight_are_refused(kernel):
    w = weight("Q8_0", random_rows("Q8_0", 64, 64, 1))
    with pytest.raises(RuntimeError, match="panels must be empty or unpack_panels' for the same weight"):
        kernel.blocks_mm(torch.randn(40, 64), *w.args, [torch.zeros(64 * 64, dtype=torch.int8)])
    with pytest.raises(RuntimeError, match="no panels or one per part"):
        kernel.blocks_mm(torch.randn(40, 64), *w.args, [torch.empty(0, dtype=torch.int8)] * 2)


def test_a_stacked_weight_of_mixed_types_runs_part_by_part(kernel):
    """q/k in Q5_1 and v in Q8_0, gate Q4_K and up Q6_K: one stacked weight each, outputs side by
    side; runs of one type are joined into one weight, and Q5_0 joins Q5_1 (both run as Q5_1S)."""
    k = 256
    raws = [random_rows(f, n, k, seed=n) for f, n in (("Q5_1", 64), ("Q5_1", 32), ("Q8_0", 32))]
    q, kk, v = weight("Q5_1", raws[0]), weight("Q5_1", raws[1]), weight("Q8_0", raws[2])
    qkv = quant.cat([q, kk, v])
    assert isinstance(qkv, quant.StackedWeight) and [p.format for p in qkv.parts] == ["Q5_1S", "Q8_0"]
    assert qkv.shape == (128, k) and (qkv.format, qkv.shipped) == ("Q5_1S+Q8_0", "Q5_1+Q8_0")
    dense = torch.cat([q.dequantize(), kk.dequantize(), v.dequantize()])
    assert torch.equal(qkv.dequantize(), dense)
    assert torch.equal(qkv.rows(torch.tensor([127, 3, 70])), dense[[127, 3, 70]])
    q5 = quant.cat([weight("Q5_0", random_rows("Q5_0", 16, k, 5)), q])
    assert isinstance(q5, quant.QuantizedWeight) and (q5.format, q5.shipped) == ("Q5_1S", "Q5_0+Q5_1")
    gate, up = random_rows("Q4_K", 48, k, 1), random_rows("Q6_K", 48, k, 2)
    gate_up = quant.cat([weight("Q4_K", gate), weight("Q6_K", up)])
    scaled = {
        "Q5_1+Q8_0": torch.cat(
            [scaled_quants("Q5_1", raws[0], kernel), scaled_quants("Q5_1", raws[1], kernel), v.dequantize()]
        ),
        "Q4_K+Q6_K": torch.cat([scaled_quants("Q4_K", gate, kernel), scaled_quants("Q6_K", up, kernel)]),
    }
    for w in (qkv, gate_up):
        for m in (1, 2, 5, 16):
            x = torch.randn(m, k)
            got = quant.quantized_matmul(kernel, x, w)
            want = F.linear(x, w.dequantize())
            assert got.shape == want.shape
            assert ((got - want).abs() <= summation_bound(x, w.dequantize(), kernel, scaled[w.shipped])).all()
    with pytest.raises(ValueError, match="widths"):
        quant.cat([q, weight("Q5_1", random_rows("Q5_1", 8, 96, 3))])


def test_unsupported_types_are_refused_by_name(kernel):
    with pytest.raises(ValueError, match="IQ2_XXS is not supported"):
        quant.RawWeight("IQ2_XXS", torch.zeros(4, 66, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match=r"unsupported block type IQ3_S \(supported: Q4_0"):
        kernel.blocks_mm(
            torch.randn(1, 256), ["IQ3_S"], [torch.zeros(4, 110, dtype=torch.uint8)], [torch.empty(0)]
        )
    with pytest.raises(RuntimeError, match="Q4_K blocks need K a multiple of 256"):
        kernel.blocks_mm(
            torch.randn(1, 96), ["Q4_K"], [torch.zeros(4, 144, dtype=torch.uint8)], [torch.empty(0)]
        )
    with pytest.raises(RuntimeError, match="Q6_K blocks do not match"):
        kernel.blocks_mm(
            torch.randn(1, 512), ["Q6_K"], [torch.zeros(4, 210, dtype=torch.uint8)], [torch.empty(0)]
        )


@pytest.fixture(scope="module")
def tiny_llama(smol):
    """A random 2-layer Llama of width 256 (whole K-type blocks), GQA, head size 64, a small vocabulary
    (the smol tokenizer's first 1024 ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = smol.tokenizer
    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def _on_blocks(model, types: dict[str, str], seed: int) -> dict[str, quant.BlockWeight]:
    """Random blocks for every linear of `model` (type by projection name, e.g. "v_proj"), and the
    model's weights set to their dequantized values."""
    blocks = {}
    for i, (name, param) in enumerate(model.named_parameters()):
        if param.dim() == 2 and "embed" not in name:
            proj = name.split(".")[-2]
            fmt = types.get(proj, types["*"])
            n, k = param.shape
            blocks[name] = weight(fmt, random_rows(fmt, n, k, seed=seed + i))
            param.data = blocks[name].dequantize()
    return blocks


MIXES = [{"*": t} for t in TYPES] + [
    {"*": "Q5_0", "v_proj": "Q8_0", "down_proj": "Q6_K", "up_proj": "Q4_K", "lm_head": "Q6_K"},
]


@pytest.mark.parametrize("types", MIXES, ids=lambda t: "+".join(sorted(set(t.values()))))
def test_fused_decode_steps_equal_the_torch_forward(tiny_llama, smol, kernel, types):
    """Prompts of 3 to 78 tokens, then decode steps of 1, 2, 5 and 16 rows (contexts of different
    lengths), through the fused layer_forward on the blocks (and with Q8_0 and Q6_K kept only as
    panels) and through the kernel's matmul unfused, give the logits of the torch forward over the
    dequantized weights (logits_close)."""
    model = copy.deepcopy(tiny_llama)
    blocks = _on_blocks(model, types, seed=7)
    cfg = model.config

    def run(mode: str) -> list[torch.Tensor]:
        kv = KVCacheManager(cfg.num_hidden_layers, cfg.num_key_value_heads, 64, torch.float32, 8 << 20, 16)
        on_blocks = {} if mode == "torch" else {"blocks": blocks, "kernel": kernel}
        runner = ModelRunner(copy.deepcopy(model), kv, 512, **on_blocks)
        if mode == "panels" and kernel.fixed_point_activations:
            runner.keep_only_panels()  # Q8_0 and Q6_K as panels only, fused
        if mode in ("fused", "panels"):
            runner.use_attention_kernel(kernel)
            runner.choose_fused_decode()
        linears = [runner.lm_head, *(lin for L in runner.layers for lin in L.linears)]
        on_blocks = sum(isinstance(lin, BlockLinear) for lin in linears)
        assert on_blocks == (0 if mode == "torch" else len(linears))
        assert runner.fused_decode == (mode in ("fused", "panels"))
        return _decode_steps(runner, kv, cfg.vocab_size, smol.tokenizer)  # prompts fused too

    want = run("torch")
    with activation_bits(kernel, 16):  # the machinery; 8-bit rounding has its own bounds (the matmuls)
        for mode in ("fused", "unfused", "panels"):
            for a, b in zip(run(mode), want):
                logits_close(a, b, kernel)


class _CountingKernel:
    """The kernel, with the rows of each layer_forward call counted."""

    def __init__(self, kernel):
        self._kernel, self.rows = kernel, []

    def __getattr__(self, name):
        return getattr(self._kernel, name)

    def layer_forward(self, layer, x, *args):
        self.rows.append(x.shape[0])
        return self._kernel.layer_forward(layer, x, *args)


def test_fused_prompt_rows_run_in_bounded_calls(tiny_llama, smol, kernel, monkeypatch):
    """A step's fused prompt rows go through each layer in calls of at most `prompt_rows` rows (its
    buffers bounded however long the burst's prompts), the later rows reading the K/V the earlier calls
    wrote: the logits equal those of one call over every row (within the integer dots' rounding on
    VNNI, where one or two rows take them and more rows float). Such a step hands its freed buffers back
    to the OS at its end; a decode step keeps them for the next."""
    from rtserver.engine import runner as runner_module

    model = copy.deepcopy(tiny_llama)
    blocks = _on_blocks(model, {"*": "Q4_K"}, seed=5)
    cfg = model.config
    results, calls, trims = [], [], []
    monkeypatch.setattr(runner_module, "trim", lambda: trims.append(len(calls)))
    for rows in (10_000, 16):
        kv = KVCacheManager(cfg.num_hidden_layers, cfg.num_key_value_heads, 64, torch.float32, 8 << 20, 16)
        runner = ModelRunner(copy.deepcopy(model), kv, 512, blocks=blocks, kernel=kernel)
        runner.use_attention_kernel(kernel)
        runner.choose_fused_decode()
        counting = _CountingKernel(kernel)
        runner.attention_kernel, runner.prompt_rows = counting, rows
        results.append(_decode_steps(runner, kv, cfg.vocab_size, smol.tokenizer, rows=(5,)))
        calls.append(counting.rows)
    # both layers' prompt rows (5 prompts, 65 rows; the last layer keeps their last rows), then the
    # decode step's 5 rows in both layers
    assert calls == [[65, 65, 5, 5], [13] * 10 + [5, 5]]
    assert trims == [1, 1, 1]  # the bounded runner's prefill: after each layer's runs, and its end
    for a, b in zip(*results):
        if kernel.fixed_point_activations:
            # VNNI: the last layer's MLP takes one kept row a run (integer dots) against five (float)
            logits_close(a, b, kernel)
        else:
            assert torch.equal(a, b)


def _fused_runner(tiny_llama, kernel, fmt: str) -> tuple[ModelRunner, KVCacheManager]:
    """A runner of the tiny model on blocks of one type, its layers fused."""
    model = copy.deepcopy(tiny_llama)
    cfg = model.config
    kv = KVCacheManager(cfg.num_hidden_layers, cfg.num_key_value_heads, 64, torch.float32, 8 << 20, 16)
    runner = ModelRunner(model, kv, 512, blocks=_on_blocks(model, {"*": fmt}, seed=7), kernel=kernel)
    runner.use_attention_kernel(kernel)
    runner.choose_fused_decode()
    assert runner.fused_decode
    return runner, kv


def test_fused_layer_refuses_what_does_not_fit_its_weights(tiny_llama, kernel):
    """A layer is checked once when it is bound (FusedLayer), a step's tensors at every call, each with
    a message naming what does not fit."""
    runner, kv = _fused_runner(tiny_llama, kernel, "Q8_0")
    cfg = runner.model.config
    n_kv, runner.n_kv = runner.n_kv, runner.n_heads  # q/k/v rows no longer (heads + 2 KV heads) x head size
    with pytest.raises(RuntimeError, match="layer shapes do not match"):
        runner._fused_layer_of(runner.layers[0])
    runner.n_kv = n_kv
    layer, (k_pool, v_pool) = runner._fused_layers[0], (kv.k[0], kv.v[0])
    x, cos, sin = torch.randn(1, cfg.hidden_size), torch.ones(1, 64), torch.zeros(1, 64)
    one, zero = torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    table = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"x must be float32 \[R, hidden\]"):
        kernel.layer_forward(
            layer, x[:, :-1].contiguous(), cos, sin, k_pool, v_pool, one, table, zero, zero, 0
        )
    with pytest.raises(RuntimeError, match="pools must hold the layer's KV heads"):
        kernel.layer_forward(
            layer,
            x,
            cos,
            sin,
            k_pool[:, :1].contiguous(),
            v_pool[:, :1].contiguous(),
            one,
            table,
            zero,
            zero,
            0,
        )
    with pytest.raises(RuntimeError, match="a write slot is outside the pool"):
        kernel.layer_forward(layer, x, cos, sin, k_pool, v_pool, one * k_pool.shape[0], table, zero, zero, 0)
    got = kernel.layer_forward(layer, x, cos, sin, k_pool, v_pool, one, table, zero, zero, 0)
    assert got.shape == x.shape and torch.isfinite(got).all()
    for keep, message in ((one, "keep must be ascending rows of x"), (zero.int(), "keep must be int64")):
        with pytest.raises(RuntimeError, match=message):
            kernel.layer_forward(layer, x, cos, sin, k_pool, v_pool, one, table, zero, zero, 0, keep)


def test_fused_layer_keeps_only_the_rows_asked(tiny_llama, kernel):
    """With `keep`, every row writes its K/V, and the kept rows come back as the whole call gives them."""
    runner, kv = _fused_runner(tiny_llama, kernel, "Q4_K")
    cfg = runner.model.config
    layer, (k_pool, v_pool) = runner._fused_layers[0], (kv.k[0], kv.v[0])
    torch.manual_seed(3)
    rows = 9
    x, cos, sin = torch.randn(rows, cfg.hidden_size), torch.randn(rows, 64), torch.randn(rows, 64)
    slots, zero = torch.arange(rows), torch.zeros(rows, dtype=torch.long)
    table = torch.arange(16).view(1, 16)
    call = (cos, sin, k_pool, v_pool, slots, table, zero, torch.arange(rows), 0)
    whole = kernel.layer_forward(layer, x, *call)
    k_whole = k_pool[:rows].clone()
    k_pool.zero_()
    for keep in ([8], [0, 4, 8], []):
        got = kernel.layer_forward(layer, x, *call, torch.tensor(keep, dtype=torch.long))
        if kernel.fixed_point_activations and 0 < len(keep) <= 2:
            logits_close(got, whole[keep], kernel)  # VNNI: one or two rows take the integer dots, nine float
        else:
            assert torch.equal(got, whole[keep])
        assert torch.equal(k_pool[:rows], k_whole)


def logits_close(got: torch.Tensor, want: torch.Tensor, kernel) -> None:
    """Float rounding carried through two layers and the head: within 1e-4 of the largest logit. The
    integer paths' 16-bit activations (relative 1.5e-5 of each block's largest) add up to 4e-4 more."""
    share = 5e-4 if kernel.fixed_point_activations or kernel.decode_passes else 1e-4
    torch.testing.assert_close(got, want, rtol=0, atol=share * float(want.abs().max()))


def _decode_steps(runner, kv, vocab: int, tokenizer, rows=(1, 2, 5, 16)) -> list[torch.Tensor]:
    """Logits of prompts of 3, 8, 13, ... tokens, then of a decode step, for each row count."""
    torch.manual_seed(1)
    steps = []
    for m in rows:
        seqs, prefill = [], []
        for r in range(m):
            ids = torch.randint(0, vocab, (3 + 5 * r,)).tolist()
            seq = Sequence(ids, SamplingParams(), eos_token_ids=set())
            seq.kv, _ = kv.acquire(ids, len(ids) + 2)
            prefill.append(StepItem(seq, seq.kv, 0, ids, "last"))
            seqs.append((seq, len(ids)))
        steps.append(torch.cat(runner.forward(prefill)))
        items = [StepItem(seq, seq.kv, n, [11 + r], "last") for r, (seq, n) in enumerate(seqs)]
        steps.append(torch.cat(runner.forward(items)))
        for seq, _ in seqs:
            kv.release(seq.kv)
    return steps


@pytest.mark.parametrize("family", ["tiny_qwen3", "tiny_gemma3", "tiny_smollm3"])
def test_fused_decode_steps_of_each_family_equal_its_torch_forward(request, smol, kernel, family):
    """Qwen3's per-head q/k norms and Gemma 3's as well, its (1 + w) norms, sandwich norms, GeGLU,
    local and global RoPE and 16-token sliding windows (contexts up to 78 tokens), SmolLM3's layer
    without RoPE, in the fused layer_forward: the logits of the torch forward over the dequantized
    weights."""
    model = copy.deepcopy(request.getfixturevalue(family).model)
    blocks = _on_blocks(model, {"*": "Q8_0", "v_proj": "Q5_0", "down_proj": "Q4_0"}, seed=3)
    cfg = model.config
    results = []
    for fused in (False, True):
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv = KVCacheManager(
            cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, torch.float32, 8 << 20, 16
        )
        if fused:
            runner = ModelRunner(copy.deepcopy(model), kv, 512, blocks=blocks, kernel=kernel)
            runner.use_attention_kernel(kernel)
            runner.choose_fused_decode()
            assert runner.fused_decode
        else:
            runner = ModelRunner(copy.deepcopy(model), kv, 512)
            assert not runner.fused_decode
        results.append(_decode_steps(runner, kv, cfg.vocab_size, smol.tokenizer))
    for a, b in zip(results[1], results[0]):
        logits_close(a, b, kernel)


# Q4_K_M (Q5_0, Q8_0, Q4_K, Q6_K tensors) in the fast run; the other files' types in the slow one
FILES = ["Q4_K_M"] + [
    pytest.param(t, marks=pytest.mark.slow)
    for t in ("Q4_0", "Q4_1", "Q5_1", "Q2_K", "Q3_K_M", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS")
]


def requantized(qtype: str) -> Path:
    from rtbench.model_files import ModelFileError, requantized

    try:
        return requantized(qtype)
    except (ModelFileError, OSError) as exc:
        missing(f"the embedded model requantized to {qtype} ({exc})", "a llama-quantize build")


@pytest.mark.parametrize("qtype", FILES)
def test_real_rows_of_requantized_files(kernel, qtype):
    """The embedded model requantized by llama-quantize: one tensor of each type the file holds (an
    unpermuted one: MLP or v/o rows) reads as gguf-py dequantizes it, and the kernel multiplies it
    within the summation bound."""
    g = GGUFFile(requantized(qtype))
    blocks = quant.weights_from_file(g, "llama", 9, 3)
    seen: set[str] = set()
    for t in g.tensors.values():
        fmt, parts = t.qtype.name, t.name.split(".")
        if fmt in seen or parts[0] != "blk" or parts[2] in ("attn_q", "attn_k", "attn_norm", "ffn_norm"):
            continue
        seen.add(fmt)
        name = f"model.layers.{parts[1]}.{quant._LAYER_NAMES[parts[2]]}.weight"
        if fmt not in quant.SUPPORTED_TYPES:
            assert name not in blocks  # left dense
            continue
        want = torch.from_numpy(dequantize(g.raw(t.name), t.qtype).astype(np.float32))
        w = blocks[name]
        assert w.shipped == fmt and torch.equal(w.dequantize(), want)
        scaled = scaled_quants(fmt, np.ascontiguousarray(g.raw(t.name)), kernel)
        for m in (1, 5):
            x = torch.randn(m, want.shape[1])
            got = quant.quantized_matmul(kernel, x, w)
            assert ((got - F.linear(x, want)).abs() <= summation_bound(x, want, kernel, scaled)).all()
    assert seen


async def _greedy_tokens(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    engine.start()
    try:
        streams = [engine.generate(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p in prompts]
        return [(await s.result()).token_ids for s in streams]
    finally:
        await engine.stop()


async def test_q4_k_m_file_runs_every_linear_on_its_blocks(kernel, monkeypatch):
    """dtype gguf on the requantized Q4_K_M file (Q5_0, Q8_0, Q4_K and Q6_K tensors): every linear
    (121 of 121) has only its blocks, which dequantize to the dense weights of a float32 load (q/k rows
    un-permuted), and batched greedy tokens equal the float32 engine's: decode steps on the small-step
    kernel, prompts on the panels."""
    from rtserver.engine.core import Engine

    path = requantized("Q4_K_M")
    loaded = load_model(str(path), dtype="gguf", threads=2)
    plain = load_model(str(path), dtype="float32", threads=2)
    dense = plain.model.state_dict()
    assert {b.shipped for b in loaded.blocks.values()} == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    for name, w in loaded.blocks.items():
        assert torch.equal(w.dequantize(), dense[name]), name
    # the probe times the machine; here steps of up to 4 rows take the small-step path. 16-bit
    # activations: auto takes this file type to 8 bits on AVX2, whose greedy paths fork sooner
    monkeypatch.setattr("rtserver.engine.core.probe_panel_rows", lambda kernel, mlps: 4)
    settings = EngineSettings(kv_budget_mb=32, activation_bits=16)
    engine = Engine(loaded, settings, release_dense_weights=True)
    linears = [lin for L in engine.runner.layers for lin in L.linears]
    assert all(isinstance(lin, BlockLinear) for lin in [*linears, engine.runner.lm_head])
    assert engine.health()["kernels"]["linears_on_blocks"] == "121 of 121"
    assert any(
        "+" in lin.blocks.shipped for lin in linears if isinstance(lin, BlockLinear)
    )  # q/k Q5_0 (as Q5_1S) beside v Q8_0: one stacked weight
    texts = ("Tell me a short fact about the number 7.", "Name a colour.", "Say hello in French.")
    prompts = [chat_prompt(loaded.tokenizer, t) for t in texts]
    got = await _greedy_tokens(engine, prompts, 24)
    want = await _greedy_tokens(Engine(plain, settings), prompts, 24)
    assert got == want


@pytest.mark.slow
def test_every_instruction_set_branch_compiles(tmp_path):
    """The kernel's AVX-512 VNNI branch and its portable one (no AVX2) build on any x86 machine
    (compile only, both at once): a CPU without them never builds them at start-up."""
    import shutil
    import subprocess
    import sysconfig

    from torch.utils import cpp_extension

    if shutil.which("c++") is None:
        missing("a C++ compiler", "apt-get install g++")
    includes = [
        f for p in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]] for f in ("-isystem", p)
    ]
    marches = {"vnni": ["-march=skylake-avx512", "-mavx512vnni"], "portable": ["-march=x86-64"]}
    builds = {
        name: subprocess.Popen(
            [
                "c++",
                "-DTORCH_EXTENSION_NAME=rtserver_quant_check",
                "-DTORCH_API_INCLUDE_EXTENSION_H",
                *includes,
                "-fPIC",
                "-std=c++20",
                "-O0",  # always_inline intrinsics are still checked for the target; no time spent optimising
                *march,
                "-ffp-contract=off",
                "-fopenmp",
                "-c",
                str(quant.KERNEL_SOURCE),
                "-o",
                str(tmp_path / f"quant-{name}.o"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, march in marches.items()
    }
    for name, build in builds.items():
        _, stderr = build.communicate(timeout=600)
        assert build.returncode == 0, (name, stderr[-2000:])
