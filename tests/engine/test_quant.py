"""The GGUF file's quantized blocks (engine/quant.py) and the kernel that multiplies with them: blocks
read from the file equal the dense weights exactly, the kernel equals a float32 matmul of the
dequantized weights up to rounding, decode attention over the paged pool equals SDPA (q8_0 pools: over
their dequantized values), and the engine in dtype gguf answers as float32 does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rtserver.config import EngineSettings
from rtserver.engine import kv_rows, quant
from rtserver.engine.attention import KernelAttention, PagedAttention
from rtserver.engine.backend import SamplingParams
from rtserver.engine.heap import reused_bytes
from rtserver.engine.kv import KVCacheManager
from rtserver.engine.linear import BlockEmbedding, BlockLinear, OneDNNLinear
from rtserver.engine.model import embedded_model_path, load_model
from rtserver.engine.plan import StepItem
from rtserver.engine.runner import ModelRunner
from rtserver.engine.sequence import Sequence

from ..conftest import activation_bits, chat_prompt


@pytest.fixture(scope="module")
def kernel():
    k = quant.load_kernel(Path("~/.cache/rtserver").expanduser())
    if k is None:  # the default dtype depends on it: a machine that cannot build it must say so
        pytest.fail(f"the quantized kernel did not build: {quant.kernel_error()}")
    return k


@pytest.fixture(autouse=True)
def kernel_defaults(kernel):
    """Each test starts on the small-step path at the default width: an engine started before set its
    probed switch and its activations' width."""
    kernel.set_panel_rows(1 << 40)
    kernel.set_activation_bits(16)  # auto's width for the embedded model (Q4_1)


@pytest.fixture(scope="module")
def blocks(smol):
    cfg = smol.model.config
    return quant.read_gguf_weights(
        embedded_model_path(), cfg.model_type, cfg.num_attention_heads, cfg.num_key_value_heads
    )


def random_blocks(fmt: str, n: int, k: int, seed: int) -> quant.QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    qbytes, fields = quant.FORMATS[fmt]
    qs = torch.randint(0, 256, (n, k // 32 * qbytes), generator=g, dtype=torch.uint8)
    scales = (torch.randn(n, k // 32, fields, generator=g) * 0.05).half()
    return quant.QuantizedWeight(fmt, qs, scales)


def test_blocks_read_from_the_file_equal_the_dense_weights(smol, blocks):
    """Every quantized tensor of the embedded file, dequantized, is bit-equal to the weight transformers
    loaded (q/k rows un-permuted the same way); the tied output head comes from the embedding."""
    dense = smol.model.state_dict()
    assert len(blocks) == 7 * smol.model.config.num_hidden_layers + 1
    assert {b.format for b in blocks.values()} == {"Q4_1", "Q8_0"}
    for name, w in blocks.items():
        assert torch.equal(w.dequantize(), dense[name]), name


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_kernel_equals_a_float32_matmul_of_the_dequantized_weight(kernel, fmt, bits):
    """Row counts 1..9 cross the kernel's 4-row passes; widths 32, 96 and 1536 one block, an odd count
    (the integer path's last block alone) and many; activations of mixed magnitudes and a zero block.
    The integer path is held to its own arithmetic (fixed-point activations of 8 or 16 bits) tightly,
    and to float32's within what those activations allow."""
    with activation_bits(kernel, bits):
        _kernel_equals_a_float32_matmul(kernel, fmt, bits)


def _kernel_equals_a_float32_matmul(kernel, fmt: str, bits: int) -> None:
    vnni = kernel.fixed_point_activations
    fixed = vnni or kernel.activation_bits() == 8  # integer dots: VNNI's, or AVX2's bytes
    # float unpacking sums in float32 (order differs from F.linear's); the integer path is exact but
    # for its float32 scaling
    tol = {"rtol": 1e-5, "atol": 2e-4} if fixed else {"rtol": 1e-4, "atol": 1e-3}
    for k in (32, 96, 1536):
        w = random_blocks(fmt, 72, k, seed=k)
        for m in range(1, 10):
            x = torch.randn(m, k) * torch.rand(m, k) * 4
            x[0, :32] = 0.0
            got = quant.quantized_matmul(kernel, x, w)
            want = quant.reference_matmul(x, w, fixed, bits, exact_mins=bits == 16)
            torch.testing.assert_close(got, want, **tol)
            # against float32: each activation moved by at most half its block's step, times |w|
            want = quant.reference_matmul(x, w)
            step = x.view(m, -1, 32).abs().amax(-1, keepdim=True).expand(m, k // 32, 32).reshape(m, k)
            top = quant.FIXED_POINT_MAX if bits == 16 else quant.BYTE_ACTIVATION_MAX
            bound = (step / top / 2) @ w.dequantize().abs().T if fixed else 0
            assert ((got - want).abs() <= bound + 1e-4 * want.abs() + 1e-3).all()


def test_auto_activation_bits_take_8_only_where_the_kl_judge_held():
    """engine.activation_bits = 0: 8 bits on integer dots (VNNI's, or AVX2's bytes) for a Q4_K_M file
    (general.file_type 15), 16 for the embedded Q4_1 file (3), an unknown type, or a CPU without integer
    dots; a set width is kept."""
    from types import SimpleNamespace

    avx2 = SimpleNamespace(byte_dots=True, fixed_point_activations=False)
    vnni = SimpleNamespace(byte_dots=False, fixed_point_activations=True)
    neither = SimpleNamespace(byte_dots=False, fixed_point_activations=False)
    held = (8, "auto: this file type held the KL judge at 8 bits")
    for kernel in (avx2, vnni):
        assert quant.activation_bits_for(0, kernel, 15) == held
        assert quant.activation_bits_for(0, kernel, 3)[0] == 16
        assert quant.activation_bits_for(0, kernel, None)[0] == 16
    assert quant.activation_bits_for(0, neither, 15) == (16, "auto: this CPU has no integer dots")
    assert quant.activation_bits_for(8, vnni, 3) == (8, "engine.activation_bits")
    assert quant.activation_bits_for(16, avx2, 15) == (16, "engine.activation_bits")


def test_fixed_point_reference_keeps_16_bits_of_each_block():
    x = torch.randn(3, 96) * torch.tensor([1e-3, 1.0, 1e3]).repeat_interleave(32)
    got = quant.fixed_point_reference(x)
    step = x.view(3, 3, 32).abs().amax(-1, keepdim=True) / quant.FIXED_POINT_MAX
    # half a step, plus float32's rounding of q * step itself (a few ulp of x)
    xb = x.view(3, 3, 32)
    assert ((got.view(3, 3, 32) - xb).abs() <= step / 2 + xb.abs() * 2**-21).all()
    assert torch.equal(quant.fixed_point_reference(torch.zeros(2, 64)), torch.zeros(2, 64))


def test_fixed_point_reference_at_8_bits_keeps_127_steps_of_each_block():
    x = torch.randn(3, 96) * torch.tensor([1e-3, 1.0, 1e3]).repeat_interleave(32)
    got = quant.fixed_point_reference(x, bits=8).view(3, 3, 32)
    amax = x.view(3, 3, 32).abs().amax(-1, keepdim=True)
    assert ((got - x.view(3, 3, 32)).abs() <= amax / 127 / 2 * (1 + 2**-20)).all()
    assert len(torch.unique(torch.round(got / amax * 127))) <= 255


def test_kernel_on_the_real_weights(kernel, blocks):
    fixed = kernel.fixed_point_activations
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        x = torch.randn(3, blocks[name].shape[1])
        got = quant.quantized_matmul(kernel, x, blocks[name])
        want = quant.reference_matmul(x, blocks[name], fixed, kernel.activation_bits())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_kernel_loads_no_openmp_runtime_of_its_own(kernel):
    """The kernel's loops run on its own threads (kernels/pool.h): the module is built without OpenMP,
    so the process keeps torch's libgomp alone. Packages that bundle a private copy for themselves
    (sentencepiece's under sentencepiece.libs) do not count."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    shared = {r for r in runtimes if ".libs/" not in r or "/torch" in r}
    assert len(shared) <= 1, runtimes
    module = Path(kernel.__file__).read_bytes()
    assert b"GOMP_parallel" not in module and b"omp_get_num_threads" not in module


def test_kernel_refuses_what_it_cannot_multiply(kernel):
    w = random_blocks("Q4_1", 8, 64, seed=1)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        quant.quantized_matmul(kernel, torch.randn(2, 64, dtype=torch.float64), w)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        quant.quantized_matmul(kernel, torch.randn(2, 48), w)
    with pytest.raises(RuntimeError, match="do not match"):
        quant.quantized_matmul(kernel, torch.randn(2, 96), w)
    with pytest.raises(RuntimeError, match=r"dm must be float16 \[N, K/32, 2\]"):
        kernel.q4_1_mm(torch.randn(2, 64), w.qs, w.scales.float())


KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(
    ("d", "heads", "kv_heads"),
    [(64, 9, 3), (128, 16, 8), (256, 4, 1), (80, 10, 1), (72, 6, 2)],  # head sizes of 4 + 1 vectors, none
)
def test_decode_attention_reads_the_pool_in_place_like_sdpa(kernel, d, heads, kv_heads, kv_dtype):
    """Query heads per KV head from 1 to 10 (in fours and a rest), head sizes in whole 64s, with a
    remainder of one vector, and one that is no whole number of vectors; rows few and many. A 16-bit
    pool equals SDPA over its values as float32: only storing K/V rounds."""
    torch.manual_seed(0)
    slots = 400
    k_pool, v_pool = (
        torch.randn(slots, kv_heads, d).to(kv_dtype),
        torch.randn(slots, kv_heads, d).to(kv_dtype),
    )
    lengths = [1, 5, 40, 17, 16, 333]  # whole vectors of scores and partial ones
    table = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for r, n in enumerate(lengths):
        table[r, :n] = torch.randperm(slots - 1)[:n] + 1
    q = torch.randn(len(lengths), heads, d)
    got = kernel.decode_attention(q, k_pool, v_pool, table, torch.tensor(lengths), d**-0.5)
    # two rows take tasks per KV head, six a task per row: the same arithmetic
    two = kernel.decode_attention(q[:2], k_pool, v_pool, table[:2], torch.tensor(lengths[:2]), d**-0.5)
    assert torch.equal(two, got[:2])
    kf, vf = k_pool.float(), v_pool.float()
    for r, n in enumerate(lengths):
        k, v = kf[table[r, :n]].transpose(0, 1), vf[table[r, :n]].transpose(0, 1)
        want = F.scaled_dot_product_attention(q[r].view(kv_heads, heads // kv_heads, d), k, v, scale=d**-0.5)
        torch.testing.assert_close(got[r], want.reshape(heads, d), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="outside the pool"):
        bad = table.clone()
        bad[0, 0] = slots
        kernel.decode_attention(q, k_pool, v_pool, bad, torch.tensor(lengths), 1.0)
    with pytest.raises(RuntimeError, match="of one type"):
        kernel.decode_attention(q, k_pool, v_pool.double(), table, torch.tensor(lengths), 1.0)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("window", [0, 7])
def test_prefill_attention_is_causal_over_the_pool_like_sdpa(kernel, window, kv_dtype):
    """Prompt chunks of three items (one starting mid-context, as a later chunk or a kept session does)
    in one call: each row attends to its item's positions up to its own, or its last `window` of them."""
    torch.manual_seed(1)
    slots, d, heads, kv_heads = 300, 64, 9, 3
    k_pool, v_pool = (
        torch.randn(slots, kv_heads, d).to(kv_dtype),
        torch.randn(slots, kv_heads, d).to(kv_dtype),
    )
    chunks = [(0, 12), (20, 5), (0, 33)]  # (first position, rows)
    table = torch.zeros(len(chunks), 53, dtype=torch.long)
    item, position = [], []
    for b, (start, n) in enumerate(chunks):
        table[b, : start + n] = torch.randperm(slots - 1)[: start + n] + 1
        item += [b] * n
        position += range(start, start + n)
    q = torch.randn(len(item), heads, d)
    got = kernel.prefill_attention(
        q, k_pool, v_pool, table, torch.tensor(item), torch.tensor(position), window, d**-0.5
    )
    kf, vf = k_pool.float(), v_pool.float()
    for r, (b, pos) in enumerate(zip(item, position)):
        ctx = table[b, max(0, pos - window + 1) if window else 0 : pos + 1]
        k, v = kf[ctx].transpose(0, 1), vf[ctx].transpose(0, 1)
        want = F.scaled_dot_product_attention(q[r].view(kv_heads, heads // kv_heads, d), k, v, scale=d**-0.5)
        torch.testing.assert_close(got[r], want.reshape(heads, d), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="outside the pool"):
        bad = table.clone()
        bad[2, 32] = slots
        kernel.prefill_attention(q, k_pool, v_pool, bad, torch.tensor(item), torch.tensor(position), 0, 1.0)
    with pytest.raises(RuntimeError, match="position is outside"):
        far = torch.tensor(position)
        far[0] = 53
        kernel.prefill_attention(q, k_pool, v_pool, table, torch.tensor(item), far, 0, 1.0)
    with pytest.raises(RuntimeError, match="item is outside"):
        beyond = torch.tensor(item) + 1
        kernel.prefill_attention(q, k_pool, v_pool, table, beyond, torch.tensor(position), 0, 1.0)


def q8_0_reference(x: np.ndarray) -> np.ndarray:
    """llama.cpp's quantize_row_q8_0_ref in numpy: per 32 values d = max|x| / 127 (float32), quants
    roundf(x * (1 / d)) (ties away from zero), d stored as float16; a 1 / d that is not finite gives zero
    quants. Bytes [rows, D / 32 * 34]."""
    blocks = x.astype(np.float32).reshape(-1, 32)
    d = np.abs(blocks).max(1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.float32(1) / d
    inv[~np.isfinite(inv)] = 0
    y = (blocks * inv).astype(np.float64)  # the float32 product, then rounded exactly in float64
    q = np.sign(y) * np.floor(np.abs(y) + 0.5)
    out = np.concatenate([d.astype(np.float16).view(np.uint8), q.astype(np.int8).view(np.uint8)], 1)
    return out.reshape(x.shape[0], -1)


def test_q8_0_rows_are_llama_cpps_bytes_in_the_kernel_and_in_torch(kernel):
    """The kernel's q8_0 writes (layer_forward's, through quantize_kv) and the torch path's are the numpy
    reference's bytes: random rows at several magnitudes, rounding ties, an all-zero block, blocks too
    small for a float16 scale; dequantized, each value is its quant times its scale."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(600, 128, generator=g) * torch.logspace(-3, 3, 600)[:, None]
    x[0] = 0
    x[1, :32] = 1e-39  # 1 / d overflows: zero quants
    x[1, 32:64] = 3e-6  # d underflows float16 to zero
    x[2, :32] = 127.0  # d = 1: x / d ties at every value but the first
    x[2, 1:32:2] = torch.arange(16) + 0.5
    x[2, 2:32:2] = -(torch.arange(15) + 0.5)
    want = torch.from_numpy(q8_0_reference(x.numpy()))
    assert torch.equal(kernel.quantize_kv(x), want)
    assert torch.equal(kv_rows.quantize_q8_0(x), want)
    assert torch.equal(kv_rows.quantize_q8_0(x.view(600, 2, 64)), want.view(600, 2, 68))
    ties = want[2, 2:34].view(torch.int8)  # away from zero: 0.5 -> 1, -0.5 -> -1, 15.5 -> 16
    assert torch.equal(ties[1::2], torch.arange(16, dtype=torch.int8) + 1)
    assert torch.equal(ties[2::2], -torch.arange(15, dtype=torch.int8) - 1)
    d = want.view(-1, 34)[:, :2].contiguous().view(torch.float16).float()
    q = want.view(-1, 34)[:, 2:].contiguous().view(torch.int8).float()
    assert torch.equal(kv_rows.dequantize_q8_0(want), (q * d).view(600, 128))
    assert not kv_rows.dequantize_q8_0(want[:2])[:, :64].any()
    with pytest.raises(ValueError, match="multiple of 32"):
        kv_rows.quantize_q8_0(torch.randn(2, 80))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.quantize_kv(torch.randn(2, 80))


def q8_0_pools(slots: int, kv_heads: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    """K and V q8_0 pools of random rows (slot 0 zero, as the KV manager keeps it), and their values."""
    g = torch.Generator().manual_seed(seed)
    pools = []
    for _ in range(2):
        pool = kv_rows.quantize_q8_0(torch.randn(slots, kv_heads, d, generator=g))
        pool[0] = 0
        pools.append(pool)
    return (*pools, *(kv_rows.dequantize_q8_0(p) for p in pools))


def paged_slots(blocks: torch.Tensor, n: int, block_tokens: int = 16) -> torch.Tensor:
    """The first n slots of a context laid out in `blocks`, as the KV manager's slot table has them."""
    return (blocks[:, None] * block_tokens + torch.arange(block_tokens)).reshape(-1)[:n]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int, scale: float) -> torch.Tensor:
    heads, d = q.shape
    o = F.scaled_dot_product_attention(
        q.view(kv_heads, heads // kv_heads, d), k.transpose(0, 1), v.transpose(0, 1), scale=scale
    )
    return o.reshape(heads, d)


@pytest.mark.parametrize(("d", "heads", "kv_heads"), [(64, 9, 3), (128, 16, 8), (256, 4, 1), (96, 6, 2)])
def test_attention_on_a_q8_0_pool_equals_float32_attention_on_its_values(kernel, d, heads, kv_heads):
    """Decode and prompt rows over a q8_0 pool, contexts in 16-slot pages in shuffled order, lengths
    around page boundaries: within 1e-5 of float32 SDPA over the dequantized K/V, the bound the float32
    and 16-bit pools hold (the same values, float32 sums in another order); 2 rows (tasks per KV head)
    and 8 (a task per row) alike. A head size that is no multiple of 32 is refused."""
    torch.manual_seed(2)
    k_pool, v_pool, kf, vf = q8_0_pools(30 * 16, kv_heads, d, seed=d)
    lengths = [1, 15, 16, 17, 32, 33, 100, 400]
    table = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for r, n in enumerate(lengths):
        table[r, :n] = paged_slots(torch.randperm(29)[:25] + 1, n)
    q = torch.randn(len(lengths), heads, d)
    got = kernel.decode_attention(q, k_pool, v_pool, table, torch.tensor(lengths), d**-0.5)
    two = kernel.decode_attention(q[:2], k_pool, v_pool, table[:2], torch.tensor(lengths[:2]), d**-0.5)
    assert torch.equal(two, got[:2])
    for r, n in enumerate(lengths):
        ctx = table[r, :n]
        want = _sdpa(q[r], kf[ctx], vf[ctx], kv_heads, d**-0.5)
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5)
    # prompt chunks: from a page's start, from a page boundary mid-context, across several pages
    chunks = [(0, 16), (16, 17), (5, 60), (31, 2)]
    ptable = torch.zeros(len(chunks), 65, dtype=torch.long)
    item, position = [], []
    for b, (start, n) in enumerate(chunks):
        ptable[b, : start + n] = paged_slots(torch.randperm(29)[:5] + 1, start + n)
        item += [b] * n
        position += range(start, start + n)
    qp = torch.randn(len(item), heads, d)
    for window in (0, 7):
        got = kernel.prefill_attention(
            qp, k_pool, v_pool, ptable, torch.tensor(item), torch.tensor(position), window, d**-0.5
        )
        for r, (b, pos) in enumerate(zip(item, position)):
            ctx = ptable[b, max(0, pos - window + 1) if window else 0 : pos + 1]
            want = _sdpa(qp[r], kf[ctx], vf[ctx], kv_heads, d**-0.5)
            torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.decode_attention(torch.randn(1, 2, 80), k_pool, v_pool, table[:1], torch.tensor([1]), 1.0)
    with pytest.raises(RuntimeError, match="of one type"):
        kernel.decode_attention(q, k_pool, vf, table, torch.tensor(lengths), 1.0)


def test_the_torch_path_reads_a_q8_0_pool_as_its_dequantized_values(kernel):
    """A q8_0 KV manager's pool (rows written as the runner's torch path writes them) read by SDPA's
    attention gives exactly what a float32 pool of the dequantized rows gives; the kernel's in-place
    reads are within float32 rounding of it. A head size that is no multiple of 32 is refused."""
    heads, kv_heads, d = 6, 2, 64
    q8 = KVCacheManager(1, kv_heads, d, kv_rows.Q8_0, 1 << 20, 16)
    f32 = KVCacheManager(1, kv_heads, d, torch.float32, 1 << 20, 16)  # fewer blocks: slots are taken here
    assert q8.bytes_per_token == 2 * kv_heads * 68 and f32.bytes_per_token == 2 * kv_heads * d * 4
    assert q8.k.shape[-1] == 68 and q8.total_blocks > f32.total_blocks and not q8.k[0, :16].any()
    torch.manual_seed(4)
    items, offsets = [], [0]
    for start, n in ((0, 20), (40, 1), (15, 3), (0, 1)):  # prompt chunks and decodes, mid-page too
        ids = list(range(start + n))
        handle, _ = f32.acquire(ids, start + n)
        slots = handle.slots[: start + n]
        for rows8, rows32 in ((q8.k[0], f32.k[0]), (q8.v[0], f32.v[0])):
            rows8.index_copy_(0, slots, kv_rows.to_pool(torch.randn(start + n, kv_heads, d), kv_rows.Q8_0))
            rows32.index_copy_(0, slots, kv_rows.from_pool(rows8[slots], torch.float32))
        seq = Sequence(ids, SamplingParams(), eos_token_ids=set())
        items.append(StepItem(seq, handle, start, ids[start:], "last"))
        offsets.append(offsets[-1] + n)
    q = torch.randn(offsets.pop(), heads, d)
    torch_path = PagedAttention(heads, kv_heads, d, d**-0.5)
    plan = torch_path.plan(items, offsets)
    want = torch_path(q, f32.k[0], f32.v[0], plan)
    assert torch.equal(torch_path(q, q8.k[0], q8.v[0], plan), want)
    in_place = KernelAttention(heads, kv_heads, d, d**-0.5, kernel)
    got = in_place(q, q8.k[0], q8.v[0], in_place.plan(items, offsets))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 32"):
        KVCacheManager(1, 1, 80, kv_rows.Q8_0, 1 << 20, 16)


def _greedy(runner: ModelRunner, kv: KVCacheManager, tok, prompts: list[list[int]], n: int) -> list[int]:
    out = []
    for ids in prompts:
        seq = Sequence(ids, SamplingParams(), eos_token_ids=set())
        seq.kv, _ = kv.acquire(ids, len(ids) + n)
        start, step = 0, ids
        for _ in range(n):
            (logits,) = runner.forward([StepItem(seq, seq.kv, start, step, "last")])
            start += len(step)
            step = [int(logits[-1].argmax())]
            out.append(step[0])
        kv.release(seq.kv)
    return out


def test_small_steps_on_the_blocks_answer_as_float32(smol, kernel, blocks):
    """Decode steps (one row) through the fused decode layers, every linear on its blocks, give
    float32's greedy tokens."""
    tok = smol.tokenizer
    prompts = [chat_prompt(tok, t) for t in ("Tell me a short fact about the number 7.", "Name a colour.")]
    cfg = smol.model.config
    answers = []
    for use in (False, True):
        kv = KVCacheManager(cfg.num_hidden_layers, cfg.num_key_value_heads, 64, torch.float32, 8 << 20, 16)
        runner = ModelRunner(smol.model, kv, 512, **({"blocks": blocks, "kernel": kernel} if use else {}))
        if use:
            assert runner.use_attention_kernel(kernel)
            runner.choose_fused_decode()
            assert runner.fused_decode
        answers.append(_greedy(runner, kv, tok, prompts, 16))
    assert answers[1] == answers[0]


def test_a_serving_runner_takes_each_layers_blocks_as_it_builds_it(kernel, monkeypatch):
    """Serving, each layer's linears leave the loader's blocks as they are built: the copies fusing
    q/k/v and gate/up make never sit beside every original (twice the file at start-up). The embedding
    and the head stay there; a runner that keeps its model leaves the blocks alone."""
    from rtserver.engine import layers

    loaded = load_model("embedded", dtype="gguf", threads=2)
    cfg = loaded.model.config
    held: list[int] = []
    monkeypatch.setattr(layers, "cat", lambda ws: held.append(len(loaded.blocks)) or quant.cat(ws))
    for release in (False, True):
        held.clear()
        kv = KVCacheManager(cfg.num_hidden_layers, cfg.num_key_value_heads, 64, torch.float32, 1 << 20, 16)
        ModelRunner(loaded.model, kv, 512, release_dense_weights=release, blocks=loaded.blocks, kernel=kernel)
        per_layer = 7  # q, k, v, o, gate, up, down
        if not release:
            assert set(held) == {per_layer * cfg.num_hidden_layers + 1}  # + the tied embedding
    assert held == sorted(held, reverse=True) and held[-1] < 2 * per_layer + 1
    assert set(loaded.blocks) == {"model.embed_tokens.weight"}


def test_a_serving_engine_lets_go_of_the_loaded_blocks_before_it_makes_panels(kernel, monkeypatch):
    """Serving, the loader's blocks are let go before any panels are made: a part kept as panels only
    (Q8_0, a tied embedding among them) frees its blocks as its panels are made, not once every layer's
    kept panels exist too."""
    from rtserver.engine.core import Engine

    loaded = load_model("embedded", dtype="gguf", threads=2)
    held: list[int] = []
    made = ModelRunner.keep_only_panels

    def keep_only_panels(runner: ModelRunner) -> None:
        held.append(len(loaded.blocks))
        made(runner)

    monkeypatch.setattr(ModelRunner, "keep_only_panels", keep_only_panels)
    Engine(loaded, EngineSettings(kv_budget_mb=16), release_dense_weights=True)
    assert held == ([0] if kernel.fixed_point_activations else [])


def test_engine_in_dtype_gguf_runs_every_linear_on_its_blocks_and_says_so(
    smol, kernel, monkeypatch, tmp_path
):
    """No dense copy of a quantized linear exists: each one has only its blocks, the greedy answers are
    the float32 engine's (16-bit activations, the default), and /health names the choice. Without the
    kernel: float32, and why."""
    from rtserver.engine.core import Engine

    loaded = load_model("embedded", dtype="gguf", threads=2)
    engine = Engine(loaded, EngineSettings(kv_budget_mb=16), release_dense_weights=True)
    chosen = engine.health()["kernels"]
    assert loaded.dtype_name == "gguf" and chosen["linears_on_blocks"] == "121 of 121"
    assert "Q4_1/Q8_0" in chosen["weights"] and "probe" in chosen["why"]
    assert chosen["activation_bits"] == 16 and chosen["activation_bits_why"].startswith("auto: ")
    if kernel.fixed_point_activations:
        assert (
            chosen["big_steps"].endswith("activations rounded to 16 bits") and kernel.activation_bits() == 16
        )
    runner = engine.runner
    assert all(
        isinstance(lin, BlockLinear)
        for lin in [runner.lm_head, *(lin for L in runner.layers for lin in L.linears)]
    )
    assert isinstance(runner.embed, BlockEmbedding)
    # every layer's and the head's panels kept unpacked for many-row steps (the prompts below take
    # them); the Q8_0 tensors kept as panels only
    linears = [runner.lm_head, *(lin for L in runner.layers for lin in L.linears)]
    parts = [(f, p) for lin in linears for f, p in zip(lin.blocks.args[0], lin.panels)]
    assert all(bool(p.numel()) or f == "Q8_0P" for f, p in parts) == kernel.fixed_point_activations
    assert any(f == "Q8_0P" for f, _ in parts) == kernel.fixed_point_activations
    assert chosen["kept_panels_mb"] == pytest.approx(
        sum(lin.panel_bytes() for lin in linears) / 2**20, abs=0.1
    )
    prompts = [chat_prompt(smol.tokenizer, t) for t in ("Hi!", "Count from one to five.")]
    cfg = smol.model.config
    kv = KVCacheManager(cfg.num_hidden_layers, cfg.num_key_value_heads, 64, torch.float32, 8 << 20, 16)
    dense = _greedy(ModelRunner(smol.model, kv, 512), kv, smol.tokenizer, prompts, 12)
    assert _greedy(runner, engine.kv, smol.tokenizer, prompts, 12) == dense
    # No compiler (or a failed build): plain float32, and /health says why.
    monkeypatch.setattr("rtserver.engine.quant.load_kernel", lambda cache: None)
    monkeypatch.setattr("rtserver.engine.quant.kernel_error", lambda: "CalledProcessError: no c++")
    unbuilt = load_model("embedded", dtype="gguf", threads=2)
    fallback = Engine(unbuilt, EngineSettings(kv_budget_mb=16)).health()["kernels"]
    why = "the quantized kernel could not be built (CalledProcessError: no c++)"
    assert fallback == {"weights": "float32", "why": why} and not unbuilt.blocks


# The KV agreement tests' chat prompts after their number facts: customer-service and other turns.
AGREEMENT_TEXTS = [
    "Where is my order #AB-1234?",
    "Write a haiku about the sea.",
    "How do I reset my password?",
    "Summarize: the parcel arrived late and damaged.",
    "What is the capital of France?",
    "List three colours.",
    "Thanks, that helped a lot!",
    "Explain rain to a child.",
]


def test_16_bit_kv_keeps_the_float32_kv_greedy_replies(smol, kernel):
    """The embedded model on its blocks, 24 chat prompts x 32 greedy tokens: the default KV (float16)
    against float32 KV, everything else equal. Each token's K/V rounds to 16 bits, so a reply may fork
    where two tokens nearly tie; at least 90% stay identical (the bench's figure is 32 of 32)."""
    from rtserver.engine.core import Engine

    texts = [f"Tell me a short fact about the number {i}." for i in range(16)] + AGREEMENT_TEXTS
    prompts = [chat_prompt(smol.tokenizer, t) for t in texts]
    replies = {}
    for kv_dtype in ("auto", "float32"):
        engine = Engine(
            load_model("embedded", dtype="gguf", threads=2),
            EngineSettings(kv_budget_mb=32, kv_dtype=kv_dtype),
        )
        pool = engine.health()["kv"]
        assert pool["dtype"] == ("float16" if kv_dtype == "auto" else "float32") and pool["dtype_why"]
        replies[kv_dtype] = [_greedy(engine.runner, engine.kv, smol.tokenizer, [p], 32) for p in prompts]
    same = sum(a == b for a, b in zip(replies["auto"], replies["float32"]))
    print(f"\n16-bit KV: {same} of {len(prompts)} greedy replies equal float32 KV's")
    assert same >= 0.9 * len(prompts), same


def test_8_bit_activations_keep_the_next_token_distribution_of_16_bits(smol, kernel):
    """engine.activation_bits = 8 on the embedded model's blocks: /health says so, and each prompt's
    next-token distribution (its prompt on the panels, as a burst's) stays within a small KL divergence
    of the 16-bit engine's. Without VNNI, 16 bits is float32 and 8 the AVX2 byte dots."""
    from rtserver.engine.core import Engine

    texts = [f"Tell me a short fact about the number {i}." for i in range(8)] + AGREEMENT_TEXTS
    prompts = [chat_prompt(smol.tokenizer, t) for t in texts]
    logits = {}
    for bits in (16, 8):
        engine = Engine(
            load_model("embedded", dtype="gguf", threads=2),
            EngineSettings(kv_budget_mb=32, activation_bits=bits),
        )
        kernel.set_panel_rows(0)  # every prompt on the panels
        rounded = kernel.fixed_point_activations or bits == 8
        want = f"rounded to {bits} bits" if rounded else "beside a float32 GEMM"
        assert engine.health()["kernels"]["big_steps"].endswith(want)
        rows = []
        for ids in prompts:
            seq = Sequence(ids, SamplingParams(), eos_token_ids=set())
            seq.kv, _ = engine.kv.acquire(ids, len(ids) + 1)
            rows.append(engine.runner.forward([StepItem(seq, seq.kv, 0, ids, "last")])[0][-1])
            engine.kv.release(seq.kv)
        logits[bits] = torch.stack(rows)
    kl = F.kl_div(
        logits[8].log_softmax(-1), logits[16].log_softmax(-1), log_target=True, reduction="none"
    ).sum(-1)
    print(f"\n8-bit activations: next-token KL mean {kl.mean():.2e}, max {kl.max():.2e}")
    assert float(kl.max()) < 0.1


def test_health_shows_a_q8_0_pool_and_the_bytes_a_token_takes(smol):
    """/health's kv block names the q8_0 pool and its bytes a token (68 a head's row of 64 values against
    float16's 128): the same budget holds about 1.9 times float16's tokens."""
    from rtserver.engine.core import Engine

    cfg = smol.model.config
    pools = {
        kv_dtype: Engine(smol, EngineSettings(kv_budget_mb=64, kv_dtype=kv_dtype)).health()["kv"]
        for kv_dtype in ("q8_0", "float16")
    }
    q8 = pools["q8_0"]
    assert q8["dtype"] == "q8_0" and q8["dtype_why"] == "engine.kv_dtype" and q8["budget_mb"] == 64
    assert q8["bytes_per_token"] == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 68
    assert pools["float16"]["bytes_per_token"] == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 128
    assert q8["tokens"] / pools["float16"]["tokens"] == pytest.approx(128 / 68, rel=0.01)


def _greedy_side_by_side(runner: ModelRunner, kv: KVCacheManager, prompts: list[list[int]], n: int):
    """n greedy tokens for every prompt, run as the bench's burst runs them: the prompts in one step,
    then one decode step of every sequence at a time."""
    seqs = [Sequence(ids, SamplingParams(), eos_token_ids=set()) for ids in prompts]
    for seq, ids in zip(seqs, prompts):
        seq.kv, _ = kv.acquire(ids, len(ids) + n)
    starts, steps = [0] * len(prompts), [list(ids) for ids in prompts]
    replies: list[list[int]] = [[] for _ in prompts]
    for _ in range(n):
        items = [StepItem(seq, seq.kv, a, step, "last") for seq, a, step in zip(seqs, starts, steps)]
        for i, logits in enumerate(runner.forward(items)):
            starts[i] += len(steps[i])
            steps[i] = [int(logits[-1].argmax())]
            replies[i].append(steps[i][0])
    for seq in seqs:
        kv.release(seq.kv)
    return replies


@pytest.mark.slow
def test_q8_0_kv_keeps_most_float32_kv_greedy_replies(smol, kernel):
    """The embedded model on its blocks, 32 chat prompts x 64 greedy tokens side by side: q8_0 KV against
    float32 KV, everything else equal. q8_0 rounds each token's K/V to 8 bits a block of 32, so more
    replies fork where two tokens nearly tie than with 16 bits; the share that stays identical is printed
    and kept at 15 of 32 or more, a margin below the share measured. /health shows the pool and the
    bytes a token takes."""
    from rtserver.engine.core import Engine

    texts = [f"Tell me a short fact about the number {i}." for i in range(24)] + AGREEMENT_TEXTS
    prompts = [chat_prompt(smol.tokenizer, t) for t in texts]
    cfg = smol.model.config
    rows = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads  # K and V rows a token
    row_bytes = {"float32": 64 * 4, "q8_0": 64 // 32 * 34}  # the embedded model's head size is 64
    budget_mb = 192  # every sequence's KV at once, in float32
    replies = {}
    for kv_dtype in ("q8_0", "float32"):
        engine = Engine(
            load_model("embedded", dtype="gguf", threads=2),
            EngineSettings(kv_budget_mb=budget_mb, kv_dtype=kv_dtype),
        )
        kernel.set_panel_rows(8)  # not the start-up probe's timing: both runs take the same matmul paths
        pool = engine.health()["kv"]
        assert pool["dtype"] == kv_dtype and pool["dtype_why"] == "engine.kv_dtype"
        assert pool["bytes_per_token"] == rows * row_bytes[kv_dtype]
        assert pool["tokens"] == ((budget_mb << 20) // (pool["bytes_per_token"] * 16) - 1) * 16
        replies[kv_dtype] = _greedy_side_by_side(engine.runner, engine.kv, prompts, 64)
    pairs = list(zip(replies["q8_0"], replies["float32"]))
    same = sum(a == b for a, b in pairs)
    before = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in pairs]
    print(
        f"\nq8_0 KV: {same} of {len(prompts)} greedy replies (64 tokens) equal float32 KV's; "
        f"{sum(before) / (64 * len(pairs)):.0%} of tokens before they diverge"
    )
    assert same >= 15, same


def test_panels_are_kept_layer_by_layer_within_the_budget(smol, kernel, blocks):
    """The first layers whose panels fit are kept, in order; the bytes kept are what they take. Without
    VNNI (float32 panels) none are."""
    import copy

    cfg = smol.model.config
    kv = KVCacheManager(cfg.num_hidden_layers, cfg.num_key_value_heads, 64, torch.float32, 8 << 20, 16)
    runner = ModelRunner(copy.deepcopy(smol.model), kv, 512, blocks=blocks, kernel=kernel)
    if not kernel.fixed_point_activations:
        assert runner.keep_panels(1 << 40) == 0
        assert not any(p.numel() for L in runner.layers for lin in L.linears for p in lin.panels)
        return
    layer = sum(lin.panel_bytes() for lin in runner.layers[0].linears)
    assert 3 << 20 < layer < 6 << 20  # a byte a weight and the scales: 3.5 M weights a layer
    assert runner.keep_panels(2 * layer + layer // 2) == 2 * layer
    kept = [all(p.numel() for lin in L.linears for p in lin.panels) for L in runner.layers]
    assert kept[:3] == [True, True, False] and not any(kept[2:])


def quantize_q8_0(w: torch.Tensor) -> quant.QuantizedWeight:
    n, k = w.shape
    blocks = w.view(n, k // 32, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half()
    q = torch.round(blocks / d.float().clamp(min=1e-8)).clamp(-127, 127).to(torch.int8)
    return quant.QuantizedWeight("Q8_0", q.view(torch.uint8).reshape(n, k), d)


class _JoinAt:
    """A join source that offers its items once, before `layer`."""

    def __init__(self, layer: int, items: list[StepItem]):
        self.layer, self.items = layer, items

    def take(self, layer: int) -> list[StepItem]:
        return self.items if layer == self.layer else []


def test_fused_decode_layers_equal_the_torch_forward_with_biases(tiny_qwen2, kernel):
    """A Qwen2 model (q/k/v biases, GQA) on Q8_0 blocks: decode steps of several rows with different
    context lengths through the fused layers give the logits of the torch forward over the same
    (dequantized) weights; prompts run fused too (alone, and as their own group beside the decodes), a
    prompt joining mid-step on the blocks unfused."""
    import copy

    model = copy.deepcopy(tiny_qwen2.model)
    blocks = {}
    for name, param in model.named_parameters():
        if param.dim() == 2 and "embed" not in name:
            blocks[name] = quantize_q8_0(param.data)
            param.data = blocks[name].dequantize()
    cfg = model.config
    results = []
    # the torch path; fused on the blocks
    for fused in (False, True):
        kv = KVCacheManager(cfg.num_hidden_layers, cfg.num_key_value_heads, 16, torch.float32, 4 << 20, 16)
        on_blocks = {"blocks": blocks, "kernel": kernel} if fused else {}
        runner = ModelRunner(copy.deepcopy(model), kv, 512, **on_blocks)
        if fused:
            runner.use_attention_kernel(kernel)
            runner.choose_fused_decode()
            assert runner.fused_decode
        torch.manual_seed(1)
        seqs, steps = [], []
        for n in (3, 20, 41):
            ids = torch.randint(0, cfg.vocab_size, (n,)).tolist()
            seq = Sequence(ids, SamplingParams(), eos_token_ids=set())
            seq.kv, _ = kv.acquire(ids, n + 5)
            steps.append(runner.forward([StepItem(seq, seq.kv, 0, ids, "last")])[0])  # a fused prompt
            seqs.append((seq, n))
        for t in range(3):
            items = [StepItem(seq, seq.kv, n + t, [7 + t], "last") for seq, n in seqs]
            steps.append(torch.cat(runner.forward(items)))
        # A prompt prefilled in a decode step (listed first): fused, a group of its own beside the decodes.
        ids = torch.randint(0, cfg.vocab_size, (6,)).tolist()
        mixed = Sequence(ids, SamplingParams(), eos_token_ids=set())
        mixed.kv, _ = kv.acquire(ids, 7)
        items = [StepItem(seq, seq.kv, n + 3, [5], "last") for seq, n in seqs]
        out = runner.forward([StepItem(mixed, mixed.kv, 0, ids, "last"), *items])
        steps.append(torch.cat(out[1:]))
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits[0, -1:].float()
        torch.testing.assert_close(out[0], theirs, rtol=1e-4, atol=1e-4)
        # A prompt joining a fused step before its last layer: it goes on beside the fused rows.
        ids = torch.randint(0, cfg.vocab_size, (9,)).tolist()
        late = Sequence(ids, SamplingParams(), eos_token_ids=set())
        late.kv, _ = kv.acquire(ids, 10)
        items = [StepItem(seq, seq.kv, n + 4, [11], "last") for seq, n in seqs]
        joining = [StepItem(late, late.kv, 0, ids, "last")]
        joined = torch.cat(runner.forward(items, _JoinAt(1, joining)))
        assert len(items) == 3  # the caller's plan stays; the joiner's logits come after it
        steps.append(joined[:3])
        results.append(steps)
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits[0, -1:].float()
        torch.testing.assert_close(joined[3:], theirs, rtol=1e-4, atol=1e-4)
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


SERVING_TEXTS = ("Tell me a short fact about the number 7.", "Name a colour.", "Say hello in French.")


def _serving_greedy(smol, kernel=None, blocks=None, route: str | None = None) -> list[list[int]]:
    """12 batched greedy tokens of SERVING_TEXTS: on smol's float32 model as it is (route None), or on a
    copy serving without dense weights by `route`; a few columns' logits equal the full logits' columns."""
    import copy

    tok = smol.tokenizer
    prompts = [chat_prompt(tok, t) for t in SERVING_TEXTS]
    cfg = smol.model.config
    packed = route is not None
    kv = KVCacheManager(cfg.num_hidden_layers, cfg.num_key_value_heads, 64, torch.float32, 8 << 20, 16)
    on_blocks = {"blocks": blocks, "kernel": kernel} if route == "blocks" else {}
    runner = ModelRunner(copy.deepcopy(smol.model) if packed else smol.model, kv, 512, **on_blocks)
    if packed:
        runner.use_attention_kernel(kernel)
        runner.release_dense_weights()
        qkv = runner.layers[0].qkv
        if route == "onednn":
            assert isinstance(qkv, OneDNNLinear)
        else:
            assert isinstance(runner.embed, BlockEmbedding) and isinstance(runner.lm_head, BlockLinear)
            assert isinstance(qkv, BlockLinear)
    seqs = []
    for ids in prompts:
        seq = Sequence(ids, SamplingParams(), eos_token_ids=set())
        seq.kv, _ = kv.acquire(ids, len(ids) + 12)
        seqs.append(seq)
    logits = runner.forward([StepItem(s, s.kv, 0, ids, "last") for s, ids in zip(seqs, prompts)])
    out = []
    for t in range(12):
        picks = [int(lg[-1].argmax()) for lg in logits]
        out.append(picks)
        items = [StepItem(s, s.kv, len(ids) + t, [p], "last") for s, ids, p in zip(seqs, prompts, picks)]
        logits = runner.forward(items)
    columns = [tok.convert_tokens_to_ids(w) for w in ("yes", "no", "Paris")]
    hs = torch.randn(3, cfg.hidden_size)
    full = runner.lm_head(hs)
    # The columns are exact float32; the whole head on VNNI rounds activations to 16 bits of each block.
    torch.testing.assert_close(runner._column_logits(hs, columns), full[:, columns], rtol=1e-5, atol=1e-3)
    return out


@pytest.fixture(scope="module")
def serving_float32(smol) -> list[list[int]]:
    """The float32 answers both routes below are held to: the same model, prompts and steps each time,
    so they are worked out once for the module."""
    return _serving_greedy(smol)


@pytest.mark.parametrize("route", ["onednn", "blocks"])
def test_serving_weights_without_dense_copies_answer_as_float32(smol, kernel, blocks, route, serving_float32):
    """Serving (release_dense_weights): float32 linears on oneDNN-packed copies, or every linear and the
    head on their blocks with lookups in the embedding's blocks (no dense embedding). Batched greedy
    tokens equal float32's, and a few columns' logits equal the full logits' columns."""
    assert _serving_greedy(smol, kernel, blocks, route) == serving_float32


def test_the_heap_keeps_freed_buffers_up_to_a_full_decode_steps_logits():
    """A serving process keeps freed buffers for the next step only up to the logits of a full decode
    step (at least 32 MB): a burst's prefill activations are not kept resident for good."""
    assert reused_bytes(64, 262_144) == 64 << 20  # Gemma 3's vocabulary, 64 rows
    assert reused_bytes(64, 49_152) == 32 << 20  # the embedded model's: the floor
    assert reused_bytes(1, 262_144) == 32 << 20
