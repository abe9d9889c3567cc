"""Model runner: one batched forward for a step plan over the paged KV pool.

A lean Llama/Qwen2 block runs over the loaded weights (layers.py). Every token of the step goes through the
linears as one batch. Only attention is grouped per sequence (attention.py). Index tensors are built once
per step. Sampling and label scoring over its logits are StepRunner's (step.py). Tests keep it equal to
transformers' own forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .attention import NO_ROWS, AttentionPlan, KernelAttention, PagedAttention, RowContexts, rope
from .families import attention_scale, family_of, layer_windows, rope_tables
from .features import FeatureLayers, Features, FeatureTaps
from .heap import trim
from .kv import KVCacheManager
from .kv_rows import from_pool, to_pool
from .layers import DecoderLayer, Weights
from .linear import BlockEmbedding, BlockLinear, FusedArgs, Linear
from .plan import NO_JOINS, JoinSource, StepItem
from .quant import BlockWeight, Kernel
from .step import Forward

log = logging.getLogger("rtserver.runner")

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _fused(lin: Linear) -> FusedArgs:
    args = lin.fused_args()
    assert args is not None  # choose_fused_decode runs fused only where every linear can
    return args


@dataclass
class _Layout:
    """Where a step's rows come from and go. Index tensors and masks are built once per step, and every
    layer reads them. They are built again when items join it mid-step.
    """

    ids: torch.Tensor  # the rows' token ids
    write_slots: torch.Tensor  # KV pool slot of each row
    row_offsets: list[int]  # first row of each item
    wanted_rows: list[int]  # rows whose hidden state leaves the last layer
    wanted: torch.Tensor
    spans: list[tuple[int, int] | None]  # per item: (first wanted row, count) or None
    # attention calls of the torch path, and of sliding-window layers (the last `window` positions)
    attention: AttentionPlan = field(default_factory=AttentionPlan)
    local: AttentionPlan = field(default_factory=AttentionPlan)
    # RoPE of the rows' positions, per table (Gemma's local and global layers differ)
    rope: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # the fused path: each row's context, whole and in the sliding window (decodes: one row an item)
    contexts: RowContexts = NO_ROWS
    local_contexts: RowContexts = NO_ROWS

    @classmethod
    def empty(cls) -> _Layout:
        none = torch.empty(0, dtype=torch.long)
        return cls(none, none, [], [], none, [])


class _Rows:
    """One group of a step's rows: the fused decodes, the fused prompts, or the rest. Holds its items,
    layout, residual stream and what it pools for features.
    """

    def __init__(self, runner: ModelRunner, items: list[StepItem], decodes: bool = False):
        self.items = items
        self.lay = runner._layout(items, decodes) if items else _Layout.empty()
        self.x: torch.Tensor | None = runner._embed(self.lay.ids) if items else None
        self._runner = runner
        self.taps = FeatureTaps(runner.feature_layers)
        self.features = [self.taps.item(it, self.lay.row_offsets[i]) for i, it in enumerate(items)]

    def join(self, items: list[StepItem], caught_up: torch.Tensor) -> None:
        """Items joining before a layer, with their residual stream caught up to it. Rows are appended. So
        the rows (and pooled ranges) of the items already here stay.
        """
        self.items = [*self.items, *items]
        self.features += [None] * len(items)
        self.x = caught_up if self.x is None else torch.cat([self.x, caught_up])
        self.lay = self._runner._layout(self.items)


class ModelRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        kv: KVCacheManager,
        max_positions: int,
        weight_storage: str | None = None,
        release_dense_weights: bool = False,
        blocks: dict[str, BlockWeight] | None = None,
        kernel: Kernel | None = None,
    ):
        """`blocks` (with the `kernel`): linears whose weights are given as GGUF blocks, by transformers
        parameter name. Those linears use only them. Their dense parameters are never read.
        """
        cfg = model.config
        self.family = family_of(cfg)
        self.model = model
        self.kv = kv
        self.dtype = model.dtype
        self.n_heads: int = cfg.num_attention_heads
        self.n_kv: int = cfg.num_key_value_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps: float = cfg.rms_norm_eps
        self.scale = attention_scale(cfg, self.head_dim)
        # The decoder stack (LlamaModel / Qwen2Model): its submodules are read by their transformers names.
        inner: Any = model.model
        # Gemma's embeddings are scaled by sqrt(hidden), in the model dtype as transformers rounds it.
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5 if self.family.scaled_embedding else 1.0)
        self.weight_storage = weight_storage
        max_positions = min(max_positions, getattr(cfg, "max_position_embeddings", max_positions))
        self.max_positions = max_positions
        self.rope, rope_of_layer = rope_tables(cfg, inner.rotary_emb, max_positions, self.dtype)
        self.window = max(layer_windows(cfg))  # one window size per model: the sliding layers'
        self.weights = Weights(
            model, self.family, weight_storage, blocks or {}, kernel, rope_of_layer, release_dense_weights
        )
        w = self.weights
        self.embed, self.norm, self.lm_head, self.layers = w.embed, w.norm, w.lm_head, w.layers
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        self.inter = self.layers[0].gate_up.out_features // 2
        self.feature_layers = FeatureLayers.of(len(self.layers))  # what a learned head reads
        self.vocab_size = self.lm_head.out_features
        self.attention = PagedAttention(self.n_heads, self.n_kv, self.head_dim, self.scale)
        self.attention_kernel: Kernel | None = None  # see use_attention_kernel
        self._rope_stacked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # see move_rows
        self.fused_decode = False  # decodes and generation prompts run fused (choose_fused_decode)
        self._fused_layers: list[object] = []  # the kernel's FusedLayer of each layer (choose_fused_decode)
        self.prompt_rows = prompt_rows(cfg.hidden_size, self.inter, self.q_size, self.kv_size)
        if release_dense_weights:
            self.release_dense_weights()

    def shift_keys(self, k: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """Pool K rows [layers, n, kv heads, row] as they would be `shift` [n] positions on. RoPE composes:
        the rotation of p + shift is that of p, then that of shift. So moved KV needs no recompute.
        """
        out = torch.empty_like(k)
        sign = torch.where(shift < 0, -1.0, 1.0)[:, None, None]
        steps = shift.abs()
        for table, layers in self._layers_by_rope(k.shape[0]).items():
            cos, sin = self.rope[table]
            c, s = cos[steps].float()[:, None, :], sin[steps].float()[:, None, :] * sign
            rows = from_pool(k[layers], torch.float32)
            out[layers] = to_pool(rope(rows, c, s), k.dtype)
        return out

    def move_rows(
        self, k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, shift: torch.Tensor
    ) -> None:
        """Pool rows copied from slots `src` to `dst` (not overlapping) in every layer, each key rotated by
        its `shift`. The kernel does it in one pass; torch gathers, rotates and writes.
        """
        if self.attention_kernel is None:
            k[:, dst] = self.shift_keys(k[:, src], shift)
            v[:, dst] = v[:, src]
            return
        if self._rope_stacked is None:  # no torch op before the kernel call: its threads would still spin
            cos = torch.stack([c.float() for c, _ in self.rope]).contiguous()
            sin = torch.stack([s.float() for _, s in self.rope]).contiguous()
            tables = torch.tensor([layer.rope for layer in self.layers], dtype=torch.long)
            self._rope_stacked = (cos, sin, tables)
        cos, sin, tables = self._rope_stacked
        self.attention_kernel.move_rows(k, v, src, dst, shift.contiguous(), cos, sin, tables)

    def _layers_by_rope(self, n: int) -> dict[int, list[int]]:
        """The first `n` layers grouped by the RoPE table they read."""
        groups: dict[int, list[int]] = {}
        for li in range(n):
            groups.setdefault(self.layers[li].rope, []).append(li)
        return groups

    def release_dense_weights(self) -> None:
        """Serving only (the transformers model cannot run afterwards): see Weights.release."""
        self.weights.release()  # the layers' linears are replaced in place

    def use_attention_kernel(self, kernel: Kernel) -> bool:
        """Attention through the kernel (float32 activations; pools float32, bfloat16, float16 or q8_0)."""
        if self.dtype != torch.float32:
            return False
        self.attention_kernel = kernel
        self.attention = KernelAttention(self.n_heads, self.n_kv, self.head_dim, self.scale, kernel)
        return True

    def keep_only_panels(self) -> None:
        """Some block linears' parts keep only their panels. They are the parts whose panels cost no more
        memory than their blocks (BlockLinear.keep_only_panels). A tied embedding then reads the output
        head's.
        """
        for lin in [lin for L in self.layers for lin in L.linears]:
            if isinstance(lin, BlockLinear):
                lin.keep_only_panels()
        head, embed = self.lm_head, self.embed
        if isinstance(head, BlockLinear):
            before = head.blocks
            head.keep_only_panels()
            if isinstance(embed, BlockEmbedding) and embed.blocks is before:
                embed.blocks = head.blocks

    def keep_panels(self, budget: int) -> int:
        """Unpack the block linears once for many-row steps, while they fit in `budget` bytes. It goes layer
        by layer, then the output head. Returns the bytes kept.
        """
        kept = 0
        for linears in [L.linears for L in self.layers] + [[self.lm_head]]:
            on_blocks = [lin for lin in linears if isinstance(lin, BlockLinear)]
            size = sum(lin.panel_bytes() for lin in on_blocks)
            if not on_blocks or kept + size > budget:
                break
            for lin in on_blocks:
                lin.keep_panels()
            kept += size
        return kept

    def choose_fused_decode(self) -> None:
        """Decodes and generation prompts run fused (the kernel's layer_forward) where every linear can. A
        layer's many small torch ops cost a step more than one kernel call.
        """
        if not all(lin.fused_args() is not None for L in self.layers for lin in L.linears):
            return
        if self.attention_kernel is None or self.dtype != torch.float32:
            return
        if any(L.o.bias is not None for L in self.layers):
            return  # layer_forward adds q/k/v biases only (Llama's attention_bias also has o_proj's)
        self.fused_decode = True
        self._fused_layers = [self._fused_layer_of(L) for L in self.layers]

    def _fused_layer_of(self, L: DecoderLayer) -> object:
        """Layer L as the kernel's FusedLayer: its weights and switches, checked once."""
        n = L.norms
        assert self.attention_kernel is not None, "fused layers run on the kernel"
        return self.attention_kernel.FusedLayer(
            n.attn_in.scale,
            *_fused(L.qkv),
            L.qkv.bias,
            *_fused(L.o),
            n.mlp_in.scale,
            *_fused(L.gate_up),
            *_fused(L.down),
            self.n_heads,
            self.n_kv,
            self.head_dim,
            self.eps,
            self.scale,
            n.q.scale,
            n.k.scale,
            n.attn_out.scale,
            n.mlp_out.scale,
            self.family.activation == "gelu_tanh",
        )

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return x * self.embed_scale.to(x.dtype) if self.family.scaled_embedding else x

    # -- the forward ----------------------------------------------------------------------------
    def _layout(self, items: list[StepItem], decodes: bool = False) -> _Layout:
        """Index tensors and masks of a step, built once and read by every layer. Also the rows' contexts as
        layer_forward reads them. `decodes`: one decode group, no torch attention plan.
        """
        tokens: list[int] = []
        positions: list[int] = []
        row_offsets: list[int] = []
        for it in items:
            row_offsets.append(len(tokens))
            tokens.extend(it.tokens)
            positions.extend(it.position_list())
        pos = torch.tensor(positions, dtype=torch.long)
        # Rows whose hidden state leaves the last layer: the last token of a chunk, or all for scoring.
        wanted_rows: list[int] = []
        spans: list[tuple[int, int] | None] = []
        for i, it in enumerate(items):
            if it.logits == "last":
                spans.append((len(wanted_rows), 1))
                wanted_rows.append(row_offsets[i] + len(it.tokens) - 1)
            elif it.logits == "all":
                spans.append((len(wanted_rows), len(it.tokens)))
                wanted_rows.extend(range(row_offsets[i], row_offsets[i] + len(it.tokens)))
            else:
                spans.append(None)
        lay = _Layout(
            ids=torch.tensor(tokens, dtype=torch.long),
            rope=[(cos[pos], sin[pos]) for cos, sin in self.rope],
            # where each new token's K/V goes
            write_slots=torch.cat([_write_slots(it) for it in items]),
            row_offsets=row_offsets,
            wanted_rows=wanted_rows,
            wanted=torch.tensor(wanted_rows, dtype=torch.long),
            spans=spans,
        )
        if decodes:  # one decode group; a sliding window cuts its table, so no window here
            every = list(range(len(items)))
            lay.contexts = RowContexts.of_decodes(self.attention.decode_call(items, every, row_offsets))
            lay.local_contexts = lay.contexts
            if self.window:
                local = self.attention.decode_call(items, every, row_offsets, self.window)
                lay.local_contexts = RowContexts.of_decodes(local)
            return lay
        lay.attention = self.attention.plan(items, row_offsets)
        lay.local = self.attention.plan(items, row_offsets, self.window) if self.window else lay.attention
        lay.contexts, lay.local_contexts = lay.attention.prefill_rows, lay.local.prefill_rows
        return lay

    def _fused_parts(self, items: list[StepItem]) -> tuple[list[int], list[int]]:
        """The items of a step that run each layer as one fused kernel call, when `fused_decode` is on. The
        call is kernels/layer.h: layer_forward, with the same arithmetic as `_layer`. First come its decodes:
        single tokens, and decodes with drafts, each row attending as a decode does. So a drafted token's
        logits are those a later decode of it would give. Then come its generation prompts (logits of the
        last row alone). Scoring and pooling items run beside them through torch ops. So a prompt arriving
        among 32 streams does not slow their step to torch's.
        """
        if not self.fused_decode:
            return [], []
        plain = [
            i
            for i, it in enumerate(items)
            if it.pool_from is None and it.columns is None and it.label is None
        ]
        decodes = [
            i for i in plain if items[i].drafts or (len(items[i].tokens) == 1 and items[i].logits == "last")
        ]
        prompts = [i for i in plain if len(items[i].tokens) > 1 and items[i].logits == "last"]
        return decodes, prompts

    @torch.inference_mode()
    def run(self, items: list[StepItem], joins: JoinSource = NO_JOINS) -> Forward:
        """Run one step. Per item it returns the fp32 logits it asked for, or None. Those are [n, vocab], or
        [n, len(columns)]. It also returns its hidden-state features where it pools them.

        `joins` is asked for more items before every layer but the first. These are prompts that arrived
        while this step runs. They need not wait for the next one; a step of many streams is long. Their
        rows first run the layers already done, alone. Then they go on with the step's rows. They come back
        in `Forward.joined`, their logits after the plan's. Joining items prefill whole prompts (logits
        "last", no pooled features).
        """
        planned = len(items)
        items = list(items)  # the caller's plan stays as it is; joiners are appended here
        decode_idx, prompt_idx = self._fused_parts(items)
        in_fused = set(decode_idx + prompt_idx)
        rest_idx = [i for i in range(len(items)) if i not in in_fused]
        groups = [
            (decode_idx, _Rows(self, [items[i] for i in decode_idx], decodes=True)),
            (prompt_idx, _Rows(self, [items[i] for i in prompt_idx])),
            (rest_idx, _Rows(self, [items[i] for i in rest_idx])),
        ]
        decodes, prompts, rest = (rows for _, rows in groups)
        for li in range(len(self.layers)):
            new = joins.take(li) if li > 0 else []
            if new:
                assert all(it.logits == "last" and it.pool_from is None and not it.columns for it in new)
                rest_idx += range(len(items), len(items) + len(new))
                items.extend(new)
                rest.join(new, self._catch_up(new, li))
            decodes.x = None if decodes.x is None else self._fused_layer(li, decodes.lay, decodes.x)
            prompts.x = None if prompts.x is None else self._prompt_layer(li, prompts.lay, prompts.x)
            if rest.x is not None:  # None past the last layer: no row asked
                rest.x = self._layer(li, rest.lay, rest.x, rest.taps)
        out = Forward([None] * len(items), [None] * len(items), items[planned:])
        for idx, rows in groups:
            logits = self._logits(rows.items, rows.lay, rows.x, rows.features) if rows.x is not None else []
            for i, lg in zip(idx, logits):
                out.logits[i] = lg
            for i, f in zip(idx, rows.features):
                out.features[i] = f
        if sum(len(rows.lay.ids) for _, rows in groups) > self.prompt_rows:
            # a prefill's buffers go back with its step; a decode step's stay for the next
            if self.attention_kernel is not None:
                self.attention_kernel.release_scratch()
            trim()
        return out

    def forward(self, items: list[StepItem], joins: JoinSource = NO_JOINS) -> list[torch.Tensor | None]:
        """The logits of one step, per item (joiners appended)."""
        return self.run(items, joins).logits

    def _catch_up(self, items: list[StepItem], layers: int) -> torch.Tensor:
        """The residual stream of items joining a step before layer `layers`. It runs the layers before it."""
        lay = self._layout(items)
        x = self._embed(lay.ids)
        for li in range(layers):
            out = self._layer(li, lay, x)
            assert out is not None  # not past the last layer: every row goes on
            x = out
        return x

    def _layer(
        self,
        li: int,
        lay: _Layout,
        x: torch.Tensor,
        taps: FeatureTaps | None = None,
    ) -> torch.Tensor | None:
        """Decoder layer `li` over the step's rows, through torch ops (any step). None: the last layer
        and no row gives logits."""
        L = self.layers[li]
        T = x.shape[0]
        h = L.norms.attn_in(x)
        qkv = L.qkv(h)
        # q and k side by side in one RoPE (the same elementwise arithmetic, half the small ops)
        qk = qkv[:, : self.q_size + self.kv_size].view(T, self.n_heads + self.n_kv, self.head_dim)
        if self.family.qk_norm:
            qk = torch.cat([L.norms.q(qk[:, : self.n_heads]), L.norms.k(qk[:, self.n_heads :])], 1)
        cos, sin = lay.rope[L.rope]
        qk = rope(qk, cos[:, None, :], sin[:, None, :])
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.n_kv, self.head_dim)
        kl, vl = self.kv.k[li], self.kv.v[li]
        kl.index_copy_(0, lay.write_slots, to_pool(k, kl.dtype))
        vl.index_copy_(0, lay.write_slots, to_pool(v, vl.dtype))
        attn = self.attention(q, kl, vl, lay.local if L.window > 0 else lay.attention)
        if li == len(self.layers) - 1 and len(lay.wanted_rows) < T:
            # Past the last layer's K/V only the rows that give logits matter: the rest skip its
            # output projection and MLP (row-wise operations, so the kept rows are unchanged).
            if not lay.wanted_rows:
                return None
            x, attn = x[lay.wanted], attn[lay.wanted]
        x = x + L.norms.attn_out(L.o(attn))
        gu = L.gate_up(L.norms.mlp_in(x))
        x = x + L.norms.mlp_out(L.down(self.family.act(gu[:, : self.inter]) * gu[:, self.inter :]))
        if taps is not None:
            taps.after(li, x)
        return x

    def _prompt_layer(self, li: int, lay: _Layout, x: torch.Tensor) -> torch.Tensor:
        """Layer `li` of the fused prompts, in runs of at most `prompt_rows` rows: a run's rows attend
        to the K/V the runs before it wrote, so each call's buffers stay bounded however many prompt
        tokens the step holds. Past the last layer's K/V only the rows asked for logits go on."""
        last = li == len(self.layers) - 1
        n = x.shape[0]
        runs = -(-n // self.prompt_rows)
        size = -(-n // runs)  # even runs: none so short that it would take the few-row kernel
        outs = []
        for a in range(0, n, size):
            keep = lay.wanted[(lay.wanted >= a) & (lay.wanted < a + size)] - a if last else None
            outs.append(self._fused_layer(li, lay, x[a : a + size], a, keep))
        if runs > 1:
            trim()  # freed between tensors still held, its buffers would stay resident to the step's end
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _fused_layer(
        self, li: int, lay: _Layout, x: torch.Tensor, first: int = 0, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Decoder layer `li` of fused rows: one call of the kernel's `layer_forward`. `x` holds the
        layout's rows from `first` on. With `keep`, only those of its rows come back (the last layer)."""
        L = self.layers[li]
        cos, sin = lay.rope[L.rope]
        c = lay.local_contexts if L.window else lay.contexts
        rows = slice(first, first + x.shape[0])
        assert self.attention_kernel is not None, "fused layers run on the kernel"
        return self.attention_kernel.layer_forward(
            self._fused_layers[li],
            x,
            cos[rows],
            sin[rows],
            self.kv.k[li],
            self.kv.v[li],
            lay.write_slots[rows],
            c.table,
            c.item[rows],
            c.position[rows],
            c.window,
            keep,
        )

    def _logits(
        self, items: list[StepItem], lay: _Layout, x: torch.Tensor, features: list[Features | None]
    ) -> list[torch.Tensor | None]:
        """Logits only where someone needs them, and only the columns asked for. Also the final hidden state
        of items whose features keep it.
        """
        hs = self.norm(x)
        out: list[torch.Tensor | None] = [None] * len(items)
        asked = {i: span for i, span in enumerate(lay.spans) if span is not None}
        for i, span in asked.items():
            f = features[i]
            if f is not None:
                f.final(hs[span[0] + span[1] - 1])
        full = [i for i in asked if items[i].columns is None]
        if full:
            rows = [r for i in full for r in range(asked[i][0], asked[i][0] + asked[i][1])]
            logits = self.lm_head(hs if len(rows) == len(lay.wanted_rows) else hs[torch.tensor(rows)]).float()
            at = 0
            for i in full:
                out[i] = logits[at : at + asked[i][1]]
                at += asked[i][1]
        by_columns: dict[tuple[int, ...], list[int]] = {}
        for i in asked:
            columns = items[i].columns
            if columns is not None:
                by_columns.setdefault(tuple(columns), []).append(i)
        for cols, group in by_columns.items():
            picked = torch.tensor([r for i in group for r in range(asked[i][0], asked[i][0] + asked[i][1])])
            logits = self._column_logits(hs[picked], list(cols))
            at = 0
            for i in group:
                out[i] = logits[at : at + asked[i][1]]
                at += asked[i][1]
        return out

    def _column_logits(self, hs: torch.Tensor, columns: list[int]) -> torch.Tensor:
        """Logits of a few vocabulary entries (the output head's way: see Linear.columns)."""
        return self.lm_head.columns(hs, torch.tensor(columns))


# What one fused call of a step's prompt rows may allocate: its float32 activations and the kernel's
# 16-bit copies of them. A burst's prompts fill a step of thousands of rows.
PROMPT_CALL_BYTES = 48 << 20
MIN_PROMPT_ROWS = 64  # fewer rows a call would read the weights more often than it computes with them


def prompt_rows(hidden: int, inter: int, q_size: int, kv_size: int) -> int:
    """The most prompt rows one fused layer call takes: its buffers (residual, normed input, q/k/v,
    queries, attention output, projection, gate and up, the kernel's activations) within
    PROMPT_CALL_BYTES."""
    floats = 3 * hidden + max(hidden, inter) + 2 * q_size + 2 * kv_size + q_size + 2 * inter
    row = 4 * floats + 2 * max(hidden, inter)
    return max(MIN_PROMPT_ROWS, PROMPT_CALL_BYTES // row)


def _write_slots(it: StepItem) -> torch.Tensor:
    """Where an item's new K/V rows go."""
    if it.positions is None:
        return it.kv.slots[it.start : it.start + len(it.tokens)]
    return it.kv.slots[torch.tensor(it.positions)]
