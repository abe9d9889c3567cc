"""How the KV pool stores a K or V row of head_dim values: in the pool's element type (float32, bfloat16,
float16), or as q8_0 blocks (`engine.kv_dtype = "q8_0"`, a uint8 pool): each 32 values a float16 scale
then 32 int8 quants, llama.cpp's block_q8_0, packed into the row's bytes. The kernel quantizes and reads
the same bytes (kernels/attention.h: Q8Block)."""

from __future__ import annotations

import torch

Q8_0 = torch.uint8  # the element type of a pool of q8_0 rows
BLOCK = 32  # values a q8_0 block
BLOCK_BYTES = 34  # its float16 scale, then its 32 int8 quants


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The `engine.kv_dtype` name of a pool's element type."""
    return "q8_0" if dtype == Q8_0 else str(dtype).removeprefix("torch.")


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """The elements of a pool of `dtype` that one row of head_dim values takes."""
    if dtype != Q8_0:
        return head_dim
    if head_dim % BLOCK:
        raise ValueError(
            f"engine.kv_dtype q8_0 needs a head size that is a multiple of {BLOCK}, not {head_dim}"
        )
    return head_dim // BLOCK * BLOCK_BYTES


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., head_dim] as q8_0 bytes [..., head_dim / 32 * 34], as llama.cpp's quantize_row_q8_0_ref
    rounds them: d = max|x| / 127, quants round(x / d) half away from zero, d stored as float16. A block
    whose 1 / d is not finite (all zero, or too small for a float16 scale) gets zero quants."""
    *lead, head_dim = x.shape
    width = row_width(Q8_0, head_dim)
    blocks = x.float().reshape(-1, BLOCK)
    d = blocks.abs().amax(1, keepdim=True) / 127
    inv = torch.ones_like(d) / d  # divided, as the kernel's 1.f / d
    inv = torch.where(torch.isfinite(inv), inv, 0.0)
    y = blocks * inv
    # torch.round rounds ties to even; C's roundf (and the kernel's std::round) away from zero
    mag = y.abs()
    whole = mag.floor()
    q = torch.where(mag - whole >= 0.5, whole + 1, whole).copysign(y)
    out = torch.empty(blocks.shape[0], BLOCK_BYTES, dtype=torch.uint8)
    out[:, :2] = d.half().view(torch.uint8)
    out[:, 2:] = q.to(torch.int8).view(torch.uint8)
    return out.view(*lead, width)


def dequantize_q8_0(rows: torch.Tensor) -> torch.Tensor:
    """q8_0 bytes [..., width] as float32 rows [..., width / 34 * 32]: each quant times its scale."""
    *lead, width = rows.shape
    blocks = rows.reshape(-1, BLOCK_BYTES)
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return (q * d).view(*lead, width // BLOCK_BYTES * BLOCK)


def to_pool(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., head_dim] as a pool of `dtype` stores them."""
    return quantize_q8_0(x) if dtype == Q8_0 else x.to(dtype)


def from_pool(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a pool as values [..., head_dim] of `dtype`."""
    return (dequantize_q8_0(rows) if rows.dtype == Q8_0 else rows).to(dtype)
