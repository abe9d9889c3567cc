"""The next token of every sequence in a step, from its logits row: greedy or sampled, a batch at a time.

Sampled rows share one temperature division, one top-k and one cumulative sum; only what is per
sequence by nature stays per row: the repetition penalty, the EOS ban before `min_new_tokens`, and
the uniform draw from the sequence's own seeded generator. Rows with an output format are first
masked to the tokens their grammar allows (grammar.py).
"""

from __future__ import annotations

import torch

from .backend import SamplingParams
from .grammar import Rows, apply_masks
from .sequence import Sequence

NUCLEUS_FIRST = 64  # best logits searched for the nucleus before widening (a chat reply's is a handful)


def sampling_candidates(row: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens a sampled step may pick and their probabilities (unnormalised): softmax(row /
    temperature) kept to the `top_k` best, then to the smallest set of those whose probability reaches
    `top_p` (the token that crosses it included). One row of `Sampler`'s batched arithmetic."""
    tokens, weights, kept = _Rows(row[None], [p]).candidates()
    return tokens[0, : int(kept[0])], weights[0, : int(kept[0])]


class _Rows:
    """Sampled rows and their parameters as tensors."""

    def __init__(self, logits: torch.Tensor, params: list[SamplingParams]):
        vocab = logits.shape[1]
        self.logits = logits / torch.tensor([p.temperature for p in params])[:, None]
        self.top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
        self.top_p = torch.tensor([p.top_p for p in params])
        self.vocab = vocab

    def candidates(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, m] token ids, best first, their probabilities (zero past each row's kept set) and how
        many each row keeps. The
        nucleus is looked for among the few best logits first (torch.topk), widening until every row
        has found it: sorting the whole vocabulary costs milliseconds a row."""
        k_max = int(self.top_k.max())
        lse = torch.logsumexp(self.logits, -1)
        cut = self.top_k < self.vocab
        if bool(cut.any()):  # the normaliser over each row's top-k set
            best = torch.topk(self.logits, k_max).values
            best[torch.arange(k_max)[None] >= self.top_k[:, None]] = float("-inf")
            lse = torch.where(cut, torch.logsumexp(best, -1), lse)
        m = min(k_max, NUCLEUS_FIRST)
        while True:
            vals, idx = torch.topk(self.logits, m)  # sorted, best first
            inside = torch.arange(m)[None] < self.top_k[:, None]
            probs = torch.where(inside, torch.exp(vals - lse[:, None]), 0.0)
            before = probs.cumsum(-1) - probs
            # top_p 1 keeps the whole top-k set, whatever the rounding of the running sum
            keep = inside & ((before < self.top_p[:, None]) | (self.top_p[:, None] >= 1.0))
            kept = keep.sum(-1)
            if m == k_max or bool(((kept < m) | (self.top_k <= m)).all()):
                return idx, torch.where(keep, probs, 0.0), kept
            m = min(k_max, m * 8)


class Sampler:
    def sample(self, seqs: list[Sequence], logits: Rows) -> list[int | Exception]:
        """One next token per sequence from its row of fp32 logits ([n, vocab], or n rows that may be
        views of a step's logits: masked in place, never copied for greedy rows), per its own decoding
        params. A sequence whose decoding raises gets the exception in its place; the others get their
        tokens."""
        out: list[int | Exception] = [0] * len(seqs)
        failed = apply_masks([s.constraint for s in seqs], logits)
        for i, exc in enumerate(failed):
            if exc is not None:
                out[i] = exc
        live = [i for i, exc in enumerate(failed) if exc is None]
        plain = [i for i in live if _plain_greedy(seqs[i])]
        for i in plain:
            # numpy's argmax is vectorised; torch's is several times slower on a long row
            out[i] = int(logits[i].numpy().argmax())
        rest = [i for i in live if i not in set(plain)]
        greedy: list[tuple[int, torch.Tensor]] = []
        sampled: list[tuple[int, torch.Tensor, float]] = []
        for i in rest:
            s = seqs[i]
            try:
                row = _penalised(s, logits[i].clone())
                if s.params.greedy:
                    greedy.append((i, row))
                else:
                    sampled.append((i, row, float(torch.rand(1, generator=s.generator()))))
            except Exception as exc:  # this sequence's parameters or state; its neighbours go on
                out[i] = exc
        for i, row in greedy:
            out[i] = int(row.argmax())
        if sampled:
            rows = torch.stack([row for _, row, _ in sampled])
            draws = torch.tensor([u for _, _, u in sampled])
            for (i, _, _), t in zip(
                sampled, self._draw(rows, [seqs[i].params for i, _, _ in sampled], draws)
            ):
                out[i] = t
        return out

    def verify(self, seq: Sequence, rows: torch.Tensor, drafts: list[int]) -> list[int] | Exception:
        """The tokens a decode with drafts gives: row j's pick, made as `sample` would make it one step at
        a time after the picks before it, for as long as each pick equals its draft. When sampling, a draft
        is kept with its probability and a rejection draws from the rest: speculative sampling's rule for a
        draft of probability one. So the output is what plain decoding gives. `rows` are masked in place.
        """
        run: list[int] = []
        followed = 0  # drafts the sequence's grammar has followed, given back at the end
        error: Exception | None = None
        try:
            for j, row in enumerate(rows[: len(drafts) + 1]):
                token = self._pick(seq, row, run)
                run.append(token)
                if j == len(drafts) or token != drafts[j] or token in seq.eos_token_ids:
                    break
                if seq.constraint.active:
                    followed += 1
                    if seq.constraint.advance(token):
                        break  # complete text: nothing may follow
        except Exception as exc:  # this sequence's parameters or state
            error = exc
        try:
            seq.constraint.rollback(followed)
        except Exception as exc:
            error = error or exc
        return run if error is None else error

    def _pick(self, seq: Sequence, row: torch.Tensor, ahead: list[int]) -> int:
        """One row's token for `seq` as it would be with `ahead` appended."""
        error = apply_masks([seq.constraint], [row])[0]
        if error is not None:
            raise error
        if _plain_greedy(seq, len(ahead)):
            return int(row.numpy().argmax())
        row = _penalised(seq, row.clone(), ahead)
        if seq.params.greedy:
            return int(row.argmax())
        draw = torch.tensor([float(torch.rand(1, generator=seq.generator()))])
        return self._draw(row[None], [seq.params], draw)[0]

    @staticmethod
    def _draw(rows: torch.Tensor, params: list[SamplingParams], draws: torch.Tensor) -> list[int]:
        """Inverse CDF: each row's uniform draw over its kept tokens' cumulative probabilities. Rows
        that keep the whole vocabulary (no top-k, no top-p) skip the sort: their CDF is in id order."""
        tokens = [0] * len(params)
        whole = [j for j, p in enumerate(params) if p.top_p >= 1.0 and not 0 < p.top_k < rows.shape[1]]
        others = [j for j in range(len(params)) if j not in set(whole)]
        if whole:
            scaled = rows[whole] / torch.tensor([params[j].temperature for j in whole])[:, None]
            cdf = torch.exp(scaled - scaled.amax(-1, keepdim=True)).cumsum(-1)
            ids = _search(cdf, draws[whole], torch.full((len(whole),), cdf.shape[1]))
            for j, t in zip(whole, ids.tolist()):
                tokens[j] = t
        if others:
            idx, probs, kept = _Rows(rows[others], [params[j] for j in others]).candidates()
            picks = _search(probs.cumsum(-1), draws[others], kept)
            for j, t in zip(others, idx.gather(1, picks[:, None])[:, 0].tolist()):
                tokens[j] = t
        return tokens


def _search(cdf: torch.Tensor, draws: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Per row, the first position whose cumulative weight passes draw * total, within the kept ones."""
    targets = draws[:, None] * cdf.gather(1, (kept - 1)[:, None])
    at = torch.searchsorted(cdf, targets, right=True)[:, 0]
    return torch.minimum(at, kept - 1)


def _plain_greedy(s: Sequence, ahead: int = 0) -> bool:
    p = s.params
    return (
        p.greedy
        and p.repetition_penalty == 1.0
        and not (p.min_new_tokens and len(s.output_ids) + ahead < p.min_new_tokens)
    )


def _penalised(s: Sequence, row: torch.Tensor, ahead: list[int] | None = None) -> torch.Tensor:
    """The row after the sequence's repetition penalty and its EOS ban before min_new_tokens, with the
    tokens `ahead` as if appended."""
    p = s.params
    ahead = ahead or []
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(s.all_ids) | set(ahead)), dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals < 0, vals * p.repetition_penalty, vals / p.repetition_penalty)
    if p.min_new_tokens and len(s.output_ids) + len(ahead) < p.min_new_tokens and s.eos_token_ids:
        row[torch.tensor(sorted(s.eos_token_ids))] = float("-inf")
    return row
