"""Attention over the paged KV pool: RoPE, and a step's attention calls, planned once and run per layer.

Decode tokens are grouped by context length, and prefill chunks by size. Each group is one batched call over
K/V gathered from the pool. Padding reads the zero block, masked out. With the kernel, decode groups read
the pool in place instead (`KernelAttention`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .kv_rows import from_pool
from .plan import StepItem
from .quant import Kernel


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, the halves layout (transformers' rotate_half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass
class DecodeCall:
    """One attention call over several decode tokens. Contexts are padded to the group's longest."""

    rows: torch.Tensor  # the tokens' rows in the step
    ctx_index: torch.Tensor  # context slots, flattened [B * L]
    shape: tuple[int, int, int, int]  # (B, L, kv heads, head dim) of the gathered context
    mask: torch.Tensor | None  # None: every context has the same length
    table: torch.Tensor  # context slots [B, L], read in place by the kernel
    lengths: torch.Tensor  # each context's length


@dataclass
class PrefillCall:
    """One attention call over several prefill chunks. Queries are padded to the longest chunk."""

    q_index: torch.Tensor  # [B, n] rows of the queries (padding repeats a chunk's first row)
    ctx_index: torch.Tensor
    shape: tuple[int, int, int, int]
    mask: torch.Tensor  # causal with offset (and a sliding window)
    src: torch.Tensor | None  # the unpadded output rows, None where nothing is padded
    dst: torch.Tensor  # where they go in the step


@dataclass(frozen=True)
class RowContexts:
    """Rows as the kernel's prefill_attention and layer_forward read them. Each row has its item's context
    slots (a row of `table`) and its position. It attends up to that position, or a window back. These are
    every prompt row of a step, or a decode group's rows, one item each.
    """

    rows: torch.Tensor  # the rows in the step
    table: torch.Tensor  # [items, longest context] each item's context slots from position 0
    item: torch.Tensor  # each row's row of the table
    position: torch.Tensor
    window: int

    @classmethod
    def of_decodes(cls, call: DecodeCall) -> RowContexts:
        """A decode group's rows, each its own item at the end of its table row. The window is already cut."""
        every = torch.arange(len(call.lengths))
        return cls(call.rows, call.table, every, call.lengths - 1, 0)


_EMPTY = torch.empty(0, dtype=torch.long)
NO_ROWS = RowContexts(_EMPTY, _EMPTY.view(0, 0), _EMPTY, _EMPTY, 0)  # the null object: never written to


@dataclass
class AttentionPlan:
    """A step's attention calls, built once and run by every layer of one window size. They are SDPA calls,
    or with the kernel its prompt rows in one call.
    """

    decodes: list[DecodeCall] = field(default_factory=list)
    prefills: list[PrefillCall] = field(default_factory=list)
    prefill_rows: RowContexts = NO_ROWS


def decode_groups(items: list[StepItem]) -> list[list[int]]:
    """Decode tokens (items of one token) grouped by context length for batched attention. A group's
    contexts are padded to its longest. So a few long sessions beside many short streams get their own call.
    Otherwise every short one would gather and attend over the long padding. A new group costs one more
    attention call per layer. So groups split only where padding would exceed about the useful work.
    """
    order = sorted((i for i, it in enumerate(items) if len(it.tokens) == 1), key=lambda i: items[i].start)
    groups: list[list[int]] = []
    group: list[int] = []
    useful = 0
    for i in order:
        ctx = items[i].start + 1
        if group and (len(group) + 1) * ctx > 2 * (useful + ctx) + 1024:
            groups.append(group)
            group, useful = [], 0
        group.append(i)
        useful += ctx
    if group:
        groups.append(group)
    return groups


def prefill_groups(items: list[StepItem]) -> list[list[int]]:
    """Prefill chunks (items of more than one token) grouped for batched attention. Similar sizes go
    together. Then padding to the group's longest chunk and context costs at most about twice the useful
    work. Many short task prompts share one call; a long chat chunk keeps its own.
    """
    order = sorted(
        (i for i, it in enumerate(items) if len(it.tokens) > 1),
        key=lambda i: (items[i].end, len(items[i].tokens)),
    )
    groups: list[list[int]] = []
    group: list[int] = []
    useful = n_max = ctx_max = 0
    for i in order:
        n, ctx = len(items[i].tokens), items[i].end
        new_n, new_ctx = max(n_max, n), max(ctx_max, ctx)
        if group and (len(group) + 1) * new_n * new_ctx > 2 * (useful + n * ctx) + 4096:
            groups.append(group)
            group, useful, new_n, new_ctx = [], 0, n, ctx
        group.append(i)
        useful += n * ctx
        n_max, ctx_max = new_n, new_ctx
    if group:
        groups.append(group)
    return groups


def _context(
    pool: torch.Tensor, slots: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """The K or V of `slots` gathered from one layer's pool, in the queries' dtype. The shape is [B,
    kv_heads, L, head_dim]. It uses index_select: a plain row gather, cheaper than advanced indexing's
    general path. q8_0 rows are dequantized.
    """
    return from_pool(pool.index_select(0, slots), dtype).view(shape).transpose(1, 2)


class PagedAttention:
    """Grouped-query attention of a step's rows over one layer's K/V pool. It runs through torch's SDPA."""

    def __init__(self, n_heads: int, n_kv: int, head_dim: int, scale: float):
        self.n_heads, self.n_kv, self.head_dim, self.scale = n_heads, n_kv, head_dim, scale
        self.group = n_heads // n_kv

    def plan(self, items: list[StepItem], row_offsets: list[int], window: int = 0) -> AttentionPlan:
        """The step's calls: decode tokens by context length, prefill chunks by size."""
        return AttentionPlan(
            [self.decode_call(items, g, row_offsets, window) for g in decode_groups(items)],
            [self.prefill_call(items, g, row_offsets, window) for g in prefill_groups(items)],
        )

    def prefill_call(
        self, items: list[StepItem], group: list[int], row_offsets: list[int], window: int = 0
    ) -> PrefillCall:
        """Index tensors and mask for one call over several prefill chunks. Queries are padded to the
        longest chunk, contexts to the longest context. Padding reads the zero block, masked out. Padded
        query rows see position 0 only and are dropped. A `window` also masks out keys that many positions
        back or more, as a sliding-window layer does.
        """
        n = max(len(items[i].tokens) for i in group)
        ctx = max(items[i].end for i in group)
        B = len(group)
        q_index = torch.empty(B, n, dtype=torch.long)
        ctx_index = torch.zeros(B, ctx, dtype=torch.long)
        q_pos = torch.zeros(B, n, dtype=torch.long)
        src, dst = [], []
        for b, i in enumerate(group):
            it = items[i]
            m, end = len(it.tokens), it.end
            rows = torch.arange(row_offsets[i], row_offsets[i] + m)
            q_index[b, :m] = rows
            q_index[b, m:] = row_offsets[i]
            q_pos[b, :m] = torch.tensor(it.position_list())
            ctx_index[b, :end] = it.kv.slots[:end]
            src.append(torch.arange(b * n, b * n + m))
            dst.append(rows)
        key_pos = torch.arange(ctx)[None, None, :]
        mask = key_pos <= q_pos[:, :, None]  # [B, n, ctx]: causal with offset
        if window:
            mask &= key_pos > q_pos[:, :, None] - window
        # rows ordered (group member, query position), as the queries are laid out
        mask = mask[:, None].expand(B, self.group, n, ctx).reshape(B, 1, self.group * n, ctx)
        src_t = torch.cat(src)
        padded = src_t.numel() != B * n
        shape = (B, ctx, self.n_kv, self.head_dim)
        src_rows = src_t if padded else None
        return PrefillCall(q_index, ctx_index.view(-1), shape, mask, src_rows, torch.cat(dst))

    def decode_call(
        self, items: list[StepItem], group: list[int], row_offsets: list[int], window: int = 0
    ) -> DecodeCall:
        """Rows, gathered context slots and mask for one call over several decode tokens. Contexts are
        padded to the group's longest with the zero block, masked out. With a `window`, each context is its
        last `window` positions. A decode with drafts gives a row per token, each its own context up to it.
        """
        ends = [items[i].start + 1 + j for i in group for j in range(len(items[i].tokens))]
        kvs = [items[i].kv for i in group for _ in items[i].tokens]
        lengths = [min(end, window) for end in ends] if window else ends
        lmax = max(lengths)
        table = torch.zeros(len(ends), lmax, dtype=torch.long)
        for r, (kv, end, length) in enumerate(zip(kvs, ends, lengths)):
            table[r, :length] = kv.slots[end - length : end]
        mask = None  # every context of the group has the same length: nothing padded to mask out
        if min(lengths) < lmax:
            mask = (torch.arange(lmax)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
        rows = torch.tensor(
            [row_offsets[i] + j for i in group for j in range(len(items[i].tokens))], dtype=torch.long
        )
        shape = (len(ends), lmax, self.n_kv, self.head_dim)
        return DecodeCall(rows, table.view(-1), shape, mask, table, torch.tensor(lengths, dtype=torch.long))

    def __call__(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        """The attention output [rows, heads * head_dim] of queries `q` [rows, heads, head_dim]."""
        T = q.shape[0]
        attn = torch.empty(T, self.n_kv, self.group, self.head_dim, dtype=q.dtype)
        for d in plan.decodes:
            attn[d.rows] = self._decode(q[d.rows], k_pool, v_pool, d)
        for p in plan.prefills:
            B, n = p.q_index.shape
            qp = q[p.q_index].view(B, n, self.n_kv, self.group, self.head_dim)
            qp = qp.permute(0, 2, 3, 1, 4).reshape(B, self.n_kv, self.group * n, self.head_dim)
            kp = _context(k_pool, p.ctx_index, p.shape, q.dtype)
            vp = _context(v_pool, p.ctx_index, p.shape, q.dtype)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=self.scale)
            o = o.view(B, self.n_kv, self.group, n, self.head_dim).permute(0, 3, 1, 2, 4)
            o = o.reshape(B * n, self.n_kv, self.group, self.head_dim)
            attn[p.dst] = o if p.src is None else o[p.src]
        return attn.view(T, self.n_heads * self.head_dim)

    def _decode(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, d: DecodeCall
    ) -> torch.Tensor:
        # [B, kv, group, d] queries against [B, kv, L, d] keys: GQA without repeating K/V.
        qd = q.view(-1, self.n_kv, self.group, self.head_dim)
        kd = _context(k_pool, d.ctx_index, d.shape, q.dtype)
        vd = _context(v_pool, d.ctx_index, d.shape, q.dtype)
        return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask, scale=self.scale)


class KernelAttention(PagedAttention):
    """Attention through the kernel, which reads the pool in place. No gather, no mask; float32 queries, any
    pool. Decode groups go by decode_attention. Every prompt row of the step goes in one prefill_attention.
    """

    def __init__(self, n_heads: int, n_kv: int, head_dim: int, scale: float, kernel: Kernel):
        super().__init__(n_heads, n_kv, head_dim, scale)
        self.kernel = kernel

    def plan(self, items: list[StepItem], row_offsets: list[int], window: int = 0) -> AttentionPlan:
        decodes = [self.decode_call(items, g, row_offsets, window) for g in decode_groups(items)]
        return AttentionPlan(decodes, [], self.prefill_rows(items, row_offsets, window))

    @staticmethod
    def prefill_rows(items: list[StepItem], row_offsets: list[int], window: int) -> RowContexts:
        prompts = [i for i, it in enumerate(items) if len(it.tokens) > 1]
        if not prompts:
            return NO_ROWS
        ends = [items[i].end for i in prompts]
        table = torch.zeros(len(prompts), max(ends), dtype=torch.long)
        rows, item, position = [], [], []
        for b, (i, end) in enumerate(zip(prompts, ends)):
            it = items[i]
            table[b, :end] = it.kv.slots[:end]
            rows.append(torch.arange(row_offsets[i], row_offsets[i] + len(it.tokens)))
            item.append(torch.full((len(it.tokens),), b, dtype=torch.long))
            position.append(torch.tensor(it.position_list()))
        return RowContexts(torch.cat(rows), table, torch.cat(item), torch.cat(position), window)

    def __call__(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        attn = super().__call__(q, k_pool, v_pool, plan)
        p = plan.prefill_rows
        if len(p.rows):
            o = self.kernel.prefill_attention(
                q[p.rows], k_pool, v_pool, p.table, p.item, p.position, p.window, self.scale
            )
            attn[p.rows] = o.view(len(p.rows), -1)
        return attn

    def _decode(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, d: DecodeCall
    ) -> torch.Tensor:
        o = self.kernel.decode_attention(q, k_pool, v_pool, d.table, d.lengths, self.scale)
        return o.view(-1, self.n_kv, self.group, self.head_dim)
