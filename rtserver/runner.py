"""Model runner: one batched forward for a step plan over the paged KV pool, then sampling.

A lean forward of the Llama/Qwen2 decoder block written directly over the loaded transformers weights
(q/k/v and gate/up fused into one matmul each). Every token of the step — one per decoding sequence plus
the prefill chunks — goes through the linear layers as one [tokens, hidden] batch. Attention is the only
per-sequence part: all single-token (decode) rows share one SDPA call over their gathered, padded
context; each prefill chunk gets its own call with a causal mask offset by its cached length. Index
tensors and masks are built once per step and reused by every layer. Tests keep this equal to
transformers' own forward.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv import KVCacheManager, KVHandle
from .sequence import SamplingParams, Sequence

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


class UnsupportedModel(ValueError):
    pass


@dataclass
class StepItem:
    """Tokens of one sequence computed in this step: positions start..start+len(tokens)-1."""

    seq: Sequence
    kv: KVHandle  # where this item's context lives (the sequence's own, or a fork of it)
    start: int
    tokens: list[int]
    logits: str  # "last" | "all" | "none"


class Linear:
    """y = x @ W.T + b, either dense (F.linear in the model dtype) or int8: per-output-channel int8
    weights with activations quantized on the fly (fbgemm's dynamic linear). int8 reads a quarter of the
    bytes of float32 and runs on integer SIMD, which matters on CPUs without fast bf16."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, int8: bool):
        self.out_features = weight.shape[0]
        self.packed = None
        if int8:
            w = weight.detach().float()
            scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "quantized tensor creation is deprecated": still the API
                qw = torch.quantize_per_channel(w, scale.double(), torch.zeros_like(scale, dtype=torch.long),
                                                0, torch.qint8)
                self.packed = torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.float())
            self.weight, self.bias = None, None
            del w, qw
        else:
            self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            # reduce_range: 7-bit activations, so AVX2 u8*s8 pair sums cannot saturate int16 (no VNNI here)
            return torch.ops.quantized.linear_dynamic(x, self.packed, True)
        return F.linear(x, self.weight, self.bias)


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv: Linear
    o: Linear
    ln2: torch.Tensor
    gate_up: Linear
    down: Linear


def _cat_bias(*linears) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else torch.zeros(lin.out_features, dtype=lin.weight.dtype)
                      for b, lin in zip(biases, linears)])


def _fuse(*linears: torch.nn.Linear, share: bool = True) -> torch.Tensor:
    """One weight for several linears over the same input. With `share` the modules keep views into
    it, so the transformers model still works (tests compare against it) and no weight is held twice;
    without (int8: the fused copy only feeds the quantizer) the modules are left alone."""
    fused = torch.cat([lin.weight for lin in linears]).contiguous()
    if not share:
        return fused
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(fused[row:row + n], requires_grad=False)
        row += n
    return fused


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCacheManager, max_positions: int, int8: bool = False):
        cfg = model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(f"model type '{cfg.model_type}' is not supported "
                                   f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if getattr(cfg, "mlp_bias", False):
            raise UnsupportedModel("MLP biases are not supported")
        self.model = model
        self.kv = kv
        self.dtype = model.dtype
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.group = self.n_heads // self.n_kv
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head = Linear(model.lm_head.weight, None, int8)
        self.layers: list[_Layer] = []
        for layer in inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                ln1=layer.input_layernorm.weight,
                qkv=Linear(_fuse(att.q_proj, att.k_proj, att.v_proj, share=not int8),
                           _cat_bias(att.q_proj, att.k_proj, att.v_proj), int8),
                o=Linear(att.o_proj.weight, att.o_proj.bias, int8),
                ln2=layer.post_attention_layernorm.weight,
                gate_up=Linear(_fuse(mlp.gate_proj, mlp.up_proj, share=not int8), None, int8),
                down=Linear(mlp.down_proj.weight, None, int8)))
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        self.inter = self.layers[0].gate_up.out_features // 2
        # RoPE tables from the model's own rotary module, so scaling variants come out identical.
        max_positions = min(max_positions, getattr(cfg, "max_position_embeddings", max_positions))
        self.max_positions = max_positions
        pos = torch.arange(max_positions)[None]
        cos, sin = inner.rotary_emb(torch.zeros(1, dtype=self.dtype), pos)
        self.cos, self.sin = cos[0], sin[0]
        self.vocab_size = self.lm_head.out_features

    def release_dense_weights(self) -> None:
        """With int8 weights the model's dense linear weights are dead weight: free them (serving only;
        the transformers model cannot run afterwards)."""
        if self.lm_head.packed is None:
            return
        # Own copies of the few dense tensors still used, so the loaded (possibly memory-mapped)
        # weight storage can go entirely.
        self.embed = self.embed.clone()
        self.norm = self.norm.clone()
        for L in self.layers:
            L.ln1, L.ln2 = L.ln1.clone(), L.ln2.clone()
        for module in self.model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                setattr(module, name, torch.nn.Parameter(torch.empty(0, dtype=param.dtype), requires_grad=False))

    # -- pieces -------------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as transformers' RMSNorm (fp32 statistics, weight applied in model dtype).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    # -- the forward ----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, items: list[StepItem]) -> list[torch.Tensor | None]:
        """Run one step; returns per item the fp32 logits it asked for ([n, vocab]) or None."""
        tokens: list[int] = []
        positions: list[int] = []
        for it in items:
            tokens.extend(it.tokens)
            positions.extend(range(it.start, it.start + len(it.tokens)))
        T = len(tokens)
        ids = torch.tensor(tokens, dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        cos = self.cos[pos][:, None, :]
        sin = self.sin[pos][:, None, :]

        # Where each new token's K/V goes, and the context each attention call reads.
        write_slots = torch.cat([it.kv.slot_table[it.start:it.start + len(it.tokens)] for it in items])
        decode_rows = [i for i, it in enumerate(items) if len(it.tokens) == 1]
        decode_pos, decode_index, decode_mask = None, None, None
        row_offsets = []
        off = 0
        for it in items:
            row_offsets.append(off)
            off += len(it.tokens)
        if decode_rows:
            lengths = [items[i].start + 1 for i in decode_rows]
            lmax = max(lengths)
            decode_index = torch.zeros(len(decode_rows), lmax, dtype=torch.long)
            for r, i in enumerate(decode_rows):
                decode_index[r, :lengths[r]] = items[i].kv.slot_table[:lengths[r]]
            decode_mask = (torch.arange(lmax)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
            decode_pos = torch.tensor([row_offsets[i] for i in decode_rows], dtype=torch.long)
        prefills = []
        for i, it in enumerate(items):
            if len(it.tokens) > 1:
                ctx = it.start + len(it.tokens)
                q_pos = torch.arange(it.start, ctx)
                mask = torch.arange(ctx)[None, :] <= q_pos[:, None]  # [q, ctx], causal with offset
                mask = mask.repeat(self.group, 1)  # rows ordered (group member, query position)
                prefills.append((row_offsets[i], len(it.tokens), it.kv.slot_table[:ctx], mask))

        x = self.embed[ids]
        k_pool, v_pool = self.kv.k, self.kv.v
        for li, L in enumerate(self.layers):
            h = self._rms(x, L.ln1)
            qkv = L.qkv(h)
            q = qkv[:, :self.q_size].view(T, self.n_heads, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, self.n_kv, self.head_dim)
            v = qkv[:, self.q_size + self.kv_size:].view(T, self.n_kv, self.head_dim)
            q = self._rope(q, cos, sin)
            k = self._rope(k, cos, sin)
            kl, vl = k_pool[li], v_pool[li]
            kl.index_copy_(0, write_slots, k)
            vl.index_copy_(0, write_slots, v)
            attn = torch.empty(T, self.n_kv, self.group, self.head_dim, dtype=x.dtype)
            if decode_rows:
                # [B, kv, group, d] queries against [B, kv, L, d] keys: GQA without repeating K/V.
                qd = q[decode_pos].view(-1, self.n_kv, self.group, self.head_dim)
                kd = kl[decode_index].transpose(1, 2)
                vd = vl[decode_index].transpose(1, 2)
                attn[decode_pos] = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=decode_mask,
                                                                  scale=self.scale)
            for start, n, ctx_slots, mask in prefills:
                qp = q[start:start + n].view(n, self.n_kv, self.group, self.head_dim)
                qp = qp.permute(1, 2, 0, 3).reshape(self.n_kv, self.group * n, self.head_dim)
                kp = kl[ctx_slots].transpose(0, 1)
                vp = vl[ctx_slots].transpose(0, 1)
                out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=self.scale)
                attn[start:start + n] = out.view(self.n_kv, self.group, n, self.head_dim).permute(2, 0, 1, 3)
            x = x + L.o(attn.view(T, self.q_size))
            h = self._rms(x, L.ln2)
            gu = L.gate_up(h)
            x = x + L.down(F.silu(gu[:, :self.inter]) * gu[:, self.inter:])

        # Logits only where someone needs them (the last token of a chunk, or all for scoring).
        wanted_rows, spans = [], []
        for i, it in enumerate(items):
            if it.logits == "last":
                spans.append((len(wanted_rows), 1))
                wanted_rows.append(row_offsets[i] + len(it.tokens) - 1)
            elif it.logits == "all":
                spans.append((len(wanted_rows), len(it.tokens)))
                wanted_rows.extend(range(row_offsets[i], row_offsets[i] + len(it.tokens)))
            else:
                spans.append(None)
        if not wanted_rows:
            return [None] * len(items)
        hs = self._rms(x[torch.tensor(wanted_rows)], self.norm)
        logits = self.lm_head(hs).float()
        return [None if s is None else logits[s[0]:s[0] + s[1]] for s in spans]

    # -- sampling -------------------------------------------------------------------------------
    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """One next token per sequence from its row of fp32 logits, per its own decoding params."""
        greedy_plain = [i for i, s in enumerate(seqs) if self._plain_greedy(s.params, s)]
        out = [0] * len(seqs)
        if greedy_plain:
            picks = logits[greedy_plain].argmax(-1).tolist()
            for i, t in zip(greedy_plain, picks):
                out[i] = t
        for i, s in enumerate(seqs):
            if i in greedy_plain:
                continue
            row = self._process(s, logits[i].clone())
            if s.params.greedy:
                out[i] = int(row.argmax())
            else:
                probs = torch.softmax(row, -1)
                out[i] = int(torch.multinomial(probs, 1, generator=self._generator(s)))
        return out

    @staticmethod
    def _plain_greedy(p: SamplingParams, s: Sequence) -> bool:
        return (p.greedy and p.repetition_penalty == 1.0
                and not (p.min_new_tokens and len(s.output_ids) < p.min_new_tokens))

    def _generator(self, s: Sequence) -> torch.Generator | None:
        if s.params.seed is None:
            return None
        if s.generator is None:
            s.generator = torch.Generator().manual_seed(s.params.seed)
        return s.generator

    def _process(self, s: Sequence, row: torch.Tensor) -> torch.Tensor:
        p = s.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(s.all_ids)), dtype=torch.long)
            vals = row[seen]
            row[seen] = torch.where(vals < 0, vals * p.repetition_penalty, vals / p.repetition_penalty)
        if p.min_new_tokens and len(s.output_ids) < p.min_new_tokens and s.eos_token_ids:
            row[torch.tensor(sorted(s.eos_token_ids))] = float("-inf")
        if p.greedy:
            return row
        row = row / p.temperature
        if 0 < p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row[row < kth] = float("-inf")
        if p.top_p < 1.0:
            sorted_vals, order = torch.sort(row, descending=True)
            cum = torch.softmax(sorted_vals, -1).cumsum(-1)
            remove = cum - torch.softmax(sorted_vals, -1) >= p.top_p  # keep the token that crosses top_p
            row[order[remove]] = float("-inf")
        return row
