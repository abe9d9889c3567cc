"""The local engine: the async face of the model. It is an `InferenceBackend` over runner, KV and scheduler.

The scheduler runs on its own thread and deals in token ids. Each step's events reach the event loop in one
`call_soon_threadsafe`. So a busy step costs the loop one callback, not one per token. There each stream's
detokenizer makes the text, and a stop string cancels its sequence.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Hashable
from typing import Protocol

import torch

from ..config import EngineSettings
from .admit import SchedulerLimits
from .backend import (
    BackendHealth,
    BackendStats,
    FinishReason,
    Inserted,
    OutputFormat,
    Priority,
    PriorityStats,
    SamplingParams,
    SequenceResult,
    TokenEvent,
)
from .detokenizer import Detokenizer
from .gguf_file import GGUFFile
from .grammar import Grammars
from .heap import return_freed_memory, reuse_freed_buffers, reused_bytes
from .kv import KVCacheManager, OutOfKVMemory, SegmentKey
from .kv_memory import resolve_kv_memory
from .linear import BlockLinear, Linear
from .model import LoadedModel
from .openmp import limit_team, release_pool
from .plan import StepItem
from .quant import activation_bits_for, probe_panel_rows
from .runner import ModelRunner
from .scheduler import Scheduler, StepEvent
from .sequence import Sequence, Splice
from .speculation import DEFAULT_ROW_COST, Speculation
from .step import StepRunner

log = logging.getLogger("rtserver.engine")

# a decode row's cost by loaded model and rows (Engine._row_cost): engines built on one model measure once
_ROW_COSTS: weakref.WeakKeyDictionary[object, dict[int, float]] = weakref.WeakKeyDictionary()
MAX_SMALL_STEP_ROWS = 64  # the rows of a step that drafts may fill where no kernel probe says fewer


class OutputSink(Protocol):
    """Where a sequence's events go on the event loop."""

    def token(self, token_id: int, last: bool) -> None: ...

    def end(self, result: SequenceResult) -> None: ...


class GenerationStream:
    """Async iterator over one sequence's tokens; `await result()` gives the final outcome."""

    def __init__(self, engine: Engine, seq: Sequence):
        self._engine = engine
        self.seq = seq
        self.detokenizer = Detokenizer(engine.tokenizer, seq.params.stop, seq.eos_token_ids)
        self._failed: str | None = None  # why detokenizing failed
        self._queue: asyncio.Queue[TokenEvent | None] = asyncio.Queue()
        self._result: asyncio.Future[SequenceResult] = asyncio.get_running_loop().create_future()

    def token(self, token_id: int, last: bool) -> None:
        detok = self.detokenizer
        if detok.stopped or self._failed is not None:
            return  # sampled before the cancel took effect
        try:
            delta = detok.update(token_id, last)
        except Exception as exc:  # this sequence's alone: the step's other streams go on
            log.error("sequence %s failed in detokenizing", self.seq.id, exc_info=exc)
            self._failed = f"internal error in detokenizing ({type(exc).__name__})"
            self._engine.scheduler.cancel(self.seq)
            return
        self._queue.put_nowait(TokenEvent(token_id, delta))
        if detok.stopped:
            self._engine.scheduler.cancel(self.seq)

    def end(self, result: SequenceResult) -> None:
        detok = self.detokenizer
        result = dataclasses.replace(result, text=detok.text)
        if self._failed is not None:
            result = dataclasses.replace(result, finish_reason=FinishReason.ERROR, error=self._failed)
        elif detok.stopped:  # the output ends at the stop string, whatever the scheduler saw after it
            ids = detok.token_ids[: detok.stop_tokens]
            usage = dataclasses.replace(result.usage, generated_tokens=len(ids))
            result = dataclasses.replace(
                result, token_ids=ids, usage=usage, finish_reason=FinishReason.STOP_STRING
            )
        if not self._result.done():
            self._result.set_result(result)
        self._queue.put_nowait(None)

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> TokenEvent:
        item = await self._queue.get()
        if item is None:
            self._queue.put_nowait(None)  # later iterations end too
            raise StopAsyncIteration
        return item

    async def result(self) -> SequenceResult:
        return await asyncio.shield(self._result)

    def cancel(self) -> None:
        self._engine.scheduler.cancel(self.seq)


class _NoSink:
    """Where a segment's sequence tells its token and end: nobody listens."""

    def token(self, token_id: int, last: bool) -> None:
        pass

    def end(self, result: SequenceResult) -> None:
        pass


_NO_SINK = _NoSink()


class _ScoreSink:
    """A scoring sequence's end, as a future; it samples no tokens."""

    def __init__(self) -> None:
        self.future: asyncio.Future[SequenceResult] = asyncio.get_running_loop().create_future()

    def token(self, token_id: int, last: bool) -> None:
        pass

    def end(self, result: SequenceResult) -> None:
        if not self.future.done():
            self.future.set_result(result)


def _check_token_ids(ids: object, vocab: int, what: str) -> None:
    """Refuse at once what the model's step would fail on later. The message speaks of tensors."""
    if (
        not isinstance(ids, (list, tuple))
        or not ids
        or any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids)
    ):
        raise ValueError(f"{what} must be a non-empty list of token ids in 0..{vocab - 1}")


def decode_weight_bytes(linears: list[Linear]) -> int:
    """The weight bytes a one-token step reads. That is each block linear's blocks (or panels), and each
    dense linear's weight.
    """
    total = 0
    for lin in linears:
        if isinstance(lin, BlockLinear):
            _, a, b = lin.blocks.args
            total += sum(t.numel() * t.element_size() for t in [*a, *b])
        elif isinstance(weight := getattr(lin, "weight", None), torch.Tensor):
            total += weight.numel() * weight.element_size()
    return total


def file_matmul_bytes(f: GGUFFile) -> int:
    """The bytes of a GGUF file's tensors that one token multiplies with. That is every block's matrices and
    the output head. Where the head is tied to the token embedding, it is the embedding.
    """
    names = [n for n, t in f.tensors.items() if n.startswith("blk.") and len(t.shape) >= 2]
    names.append("output.weight" if "output.weight" in f.tensors else "token_embd.weight")
    return sum(f.tensors[n].nbytes for n in names if n in f.tensors)


class Engine:
    def __init__(
        self, loaded: LoadedModel, settings: EngineSettings | None = None, release_dense_weights: bool = False
    ):
        self.settings = settings or EngineSettings()
        opts = self.settings
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        cfg = loaded.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv_memory = resolve_kv_memory(opts.kv_dtype, opts.kv_budget_mb, loaded)
        self.kv = KVCacheManager(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            head_dim,
            self.kv_memory.dtype,
            self.kv_memory.budget_mb << 20,
            opts.kv_block_tokens,
        )
        gguf = None if loaded.gguf_blocks is None else GGUFFile(loaded.gguf_blocks)
        self.activation_bits: tuple[int, str] | None = None
        if loaded.kernel is not None:
            # before any panel is made: panels are laid out for their activations' width
            file_type = None if gguf is None else gguf.field("general.file_type")
            self.activation_bits = activation_bits_for(opts.activation_bits, loaded.kernel, file_type)
            loaded.kernel.set_activation_bits(self.activation_bits[0])
        self._shipped = sorted({b.shipped for b in loaded.blocks.values()})  # before the runner takes them
        self.runner = ModelRunner(
            loaded.model,
            self.kv,
            opts.max_sequence_tokens,
            weight_storage=loaded.weight_storage,
            release_dense_weights=release_dense_weights,
            blocks=loaded.blocks,
            kernel=loaded.kernel,
        )
        self.kv.mover = self.runner  # KV may move: segments, blocks left out
        # What each linear computes with, and why (shown in /health).
        self.kernels: dict[str, object] = {"weights": loaded.dtype_name}
        self._step_threads = loaded.threads  # torch's threads while the scheduler runs
        self.small_step_rows = MAX_SMALL_STEP_ROWS  # the kernel's probe lowers it (see _use_gguf_blocks)
        if gguf is not None:
            if release_dense_weights:
                # by name, as loaded: the linears hold what they read (fused), so a part kept as panels
                # only lets go of its blocks as its panels are made, before others are unpacked
                loaded.blocks.clear()
            self.kernels = self._use_gguf_blocks(loaded, gguf)
            if release_dense_weights:
                self.runner.release_dense_weights()
        if release_dense_weights:
            return_freed_memory()
        self.scheduler = Scheduler(
            StepRunner(self.runner),
            self.kv,
            SchedulerLimits.from_settings(opts, self.runner.max_positions),
            self._dispatch,
            self._speculation(),
        )
        self.eos_token_ids = self._eos_ids(loaded)
        self.grammars = Grammars(self.tokenizer, self.runner.vocab_size, self.eos_token_ids)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[int, OutputSink] = {}
        self._producers: dict[SegmentKey, Sequence] = {}  # segments' sequences, while they may run
        self._thread: threading.Thread | None = None

    def _speculation(self) -> Speculation:
        """When steps draft, with what a draft's row costs on this model and machine (measured once per
        loaded model and row count)."""
        opts = self.settings
        rows = min(self.small_step_rows, 1 + opts.draft_tokens)
        cost = DEFAULT_ROW_COST
        if opts.speculate_max_live and rows > 1:
            known = _ROW_COSTS.setdefault(self.loaded.model, {})
            if rows not in known:
                known[rows] = self._row_cost(rows)
            cost = known[rows]
        return Speculation(
            opts.speculate_max_live, opts.draft_tokens, max_rows=self.small_step_rows, row_cost=cost
        )

    @torch.inference_mode()
    def _row_cost(self, rows: int, repeats: int = 3) -> float:
        """What each row past the first adds to a decode step, over a one-row step's time: a decode with
        `rows - 1` drafts against a plain one, on scratch KV (the best of `repeats` each, in turns)."""
        ids = [0] * 8
        seq = Sequence(ids, SamplingParams(), eos_token_ids=set())
        try:
            kv, _ = self.kv.acquire(ids, len(ids) + rows)
        except OutOfKVMemory:
            return DEFAULT_ROW_COST  # a pool too small to try it in
        try:
            self.runner.forward([StepItem(seq, kv, 0, ids, "last")])
            one = StepItem(seq, kv, len(ids), ids[:1], "last")
            many = StepItem(seq, kv, len(ids), ids[:rows], "all", drafts=rows - 1)
            best = [float("inf"), float("inf")]
            for _ in range(repeats):
                for i, item in enumerate((one, many)):
                    started = time.perf_counter()
                    self.runner.forward([item])
                    best[i] = min(best[i], time.perf_counter() - started)
        finally:
            self.kv.release(kv)
        return max(0.0, best[1] / best[0] - 1.0) / (rows - 1)

    def _use_gguf_blocks(self, loaded: LoadedModel, gguf: GGUFFile) -> dict[str, object]:
        """dtype gguf: every linear the file ships in a supported block type multiplies with its blocks.
        Some steps are above a start-up probe's row count. They run on panels of weight rows, kept unpacked
        within `kept_panels_mb`. Without the kernel every weight is dense float32.
        """
        assert loaded.gguf_blocks is not None
        kernel = loaded.kernel
        if kernel is None:
            return {"weights": "float32", "why": loaded.blocks_why or "no supported block types in the file"}
        runner = self.runner
        runner.use_attention_kernel(kernel)
        linears = [lin for L in runner.layers for lin in L.linears] + [runner.lm_head]
        on_blocks = [lin for lin in linears if isinstance(lin, BlockLinear)]
        mlps = [
            (L.gate_up.blocks, L.down.blocks)
            for L in runner.layers
            if isinstance(L.gate_up, BlockLinear) and isinstance(L.down, BlockLinear)
        ]
        rows = probe_panel_rows(kernel, mlps)
        kernel.set_panel_rows(rows)
        self.small_step_rows = rows
        kept = 0
        if kernel.fixed_point_activations:
            runner.keep_only_panels()
            kept = runner.keep_panels(self.settings.kept_panels_mb << 20)
        runner.choose_fused_decode()
        if len(on_blocks) == len(linears):
            # the kernel's own threads do every big loop; torch's OpenMP workers would only spin beside them
            self._step_threads = 1
        formats = self._shipped
        log.info(
            "%d of %d linears on GGUF blocks (%s); panels above %d rows; %.0f MB of them kept unpacked",
            len(on_blocks),
            len(linears),
            ", ".join(formats),
            rows,
            kept / 2**20,
        )
        return {
            "weights": f"GGUF blocks of {loaded.gguf_blocks.name} ({'/'.join(formats)})",
            "linears_on_blocks": f"{len(on_blocks)} of {len(linears)}",
            "small_steps": f"blocks, up to {rows} rows",
            "big_steps": (
                f"32 weight rows of quants against activations rounded to {bits} bits"
                if (bits := kernel.activation_bits()) < 32
                else "16 weight rows dequantized at a time beside a float32 GEMM"
            ),
            "activation_bits": self.activation_bits[0] if self.activation_bits else None,
            "activation_bits_why": self.activation_bits[1] if self.activation_bits else None,
            "kept_panels_mb": round(kept / 2**20, 1),
            "decode_weight_mb": round(decode_weight_bytes(linears) / 2**20, 1),
            "file_matmul_mb": round(file_matmul_bytes(gguf) / 2**20, 1),
            "fused_decode_steps": "every size" if runner.fused_decode else "none",
            "torch_threads": self._step_threads,
            "why": "start-up probe: the small-step kernel beat the panels up to that many rows",
        }

    @staticmethod
    def _eos_ids(loaded: LoadedModel) -> set[int]:
        ids = loaded.model.generation_config.eos_token_id
        if ids is None:
            ids = loaded.tokenizer.eos_token_id
        return set(ids if isinstance(ids, list) else [ids]) - {None}

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        # The thread that built the engine lets its OpenMP workers go: the scheduler's are then the only ones.
        release_pool()
        reuse_freed_buffers(reused_bytes(self.settings.max_running, self.runner.vocab_size))
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._serve, name="rtserver-scheduler", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        """The scheduler's thread. It owns the kernel's worker threads, then runs every step."""
        self.take_step_thread()
        self.scheduler.run_forever()

    def take_step_thread(self) -> None:
        """The calling thread runs the steps from now on: it owns the kernel's worker threads, and its torch
        operations run on the team a step takes. The scheduler's thread does this first; a tool that drives
        `runner` itself, with no scheduler started, does it on its own thread.
        """
        if self.loaded.kernel is not None:
            self.loaded.kernel.bind_pool(self.loaded.threads)
        if self._step_threads < self.loaded.threads:
            limit_team(self._step_threads)

    async def stop(self) -> None:
        self.scheduler.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    # -- from the scheduler thread --------------------------------------------------------------
    def _dispatch(self, events: list[StepEvent]) -> None:
        if events and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, events)

    def _deliver(self, events: list[StepEvent]) -> None:
        ending = {seq.id for seq, event in events if isinstance(event, SequenceResult)}
        for seq, event in events:
            sink = self._streams.get(seq.id)
            if sink is None:
                continue
            if isinstance(event, SequenceResult):
                del self._streams[seq.id]
                sink.end(event)
            else:  # its last token comes in the same step as its end
                sink.token(event, seq.id in ending)

    # -- public API (event loop) ----------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        session_key: Hashable | None = None,
        public_tokens: int = 0,
        prefix_scope: int | None = None,
        fork_session: Hashable | None = None,
        inserted: Inserted | None = None,
    ) -> GenerationStream:
        """Queue a generation. Raises SamplingError, OutputFormatError, RequestTooLarge or Overloaded at
        once. Only the first `public_tokens` prompt tokens are shared with other sessions (see
        `InferenceBackend`). An output format not yet compiled is compiled here (see prepare_output).
        Generations of one `prefix_scope` share their whole prompt's KV with each other alone. One given
        `fork_session` may start from that session's KV (see `InferenceBackend`). `inserted`: see
        `Inserted`.
        """
        params.validate(len(self.tokenizer))
        _check_token_ids(prompt_ids, self.runner.vocab_size, "prompt_ids")
        if inserted is not None and (why := inserted.problem(len(prompt_ids), public_tokens)) is not None:
            raise ValueError(why)
        seq = Sequence(
            prompt_ids,
            params,
            eos_token_ids=self.eos_token_ids,
            session_key=session_key,
            public_tokens=public_tokens,
            prefix_scope=prefix_scope,
            fork_session=fork_session,
        )
        seq.constraint = self.grammars.constraint(params.output, seq.eos_token_ids, params.max_new_tokens)
        if inserted is not None:
            seq.inserted = (inserted.start, inserted.end)
            self._splice_segments(seq, inserted.segments, params.priority)
        stream = GenerationStream(self, seq)
        self._queue(seq, stream)
        return stream

    def _queue(self, seq: Sequence, sink: OutputSink) -> None:
        """Submit a sequence whose tokens and end go to `sink`. Raises what the scheduler refused."""
        self._streams[seq.id] = sink
        try:
            self.scheduler.submit(seq)
        except Exception:
            del self._streams[seq.id]
            raise

    def _splice_segments(
        self, seq: Sequence, segments: tuple[tuple[int, int], ...], priority: Priority
    ) -> None:
        """Each segment's KV comes from an entry of its own: the public tokens, then the segment. One not
        cached yet is computed first, by a sequence of its own that leaves its KV as that entry. Those
        sequences take at most half the queue: customers' turns must still find room. A segment they
        cannot take is computed in place.
        """
        public = seq.prompt_ids[: seq.public_tokens]
        self._producers = {k: p for k, p in self._producers.items() if not p.is_finished}
        for s, e in segments:
            ids = seq.prompt_ids[s:e]
            key = SegmentKey(hash((tuple(public), tuple(ids))))
            producer = self._producers.get(key)
            if producer is None and not self.kv.holds(key):
                if self.scheduler.spare() <= self.scheduler.limits.max_waiting // 2:
                    continue
                producer = Sequence(
                    public + ids,
                    SamplingParams(max_new_tokens=1, priority=priority),
                    eos_token_ids=set(),
                    session_key=key,
                    public_tokens=len(public),
                )
                try:
                    self._queue(producer, _NO_SINK)
                except Exception:
                    continue
                self._producers[key] = producer
            seq.splices[s] = Splice(e, key, len(public), producer)

    async def prepare_output(self, fmt: OutputFormat, *, pin: bool = False) -> None:
        """Compile `fmt` on a worker thread (see backend.StructuredOutput)."""
        await asyncio.to_thread(self.grammars.compile, fmt, pin=pin)

    async def score(
        self,
        prompt_ids: list[int],
        candidates: list[list[int]],
        *,
        normalize: bool = True,
        public_tokens: int = 0,
    ) -> list[float]:
        """Log-probability of each candidate continuation after the prompt, summed over its tokens.

        With `normalize=False` each score is off by one constant, shared by every candidate of this prompt.
        It is the log-normaliser of the prompt's next-token distribution, left out. Differences between
        candidates are unchanged, and so is a softmax across them. The model then computes only the logits
        of the candidates' first tokens, not the whole vocabulary.
        """
        result = await self._score(prompt_ids, candidates, normalize, None, public_tokens)
        assert result.scores is not None
        return result.scores

    async def score_features(
        self,
        prompt_ids: list[int],
        candidates: list[list[int]],
        *,
        features_from: int,
        public_tokens: int = 0,
    ) -> tuple[list[float], list[float]]:
        """`score(normalize=False)` plus the prompt's hidden-state features from the same forward. See
        `backend.FeatureScorer`. Positions from `features_from` on are always computed. The prefix cache
        serves at most the positions before it. So the features do not depend on what else is cached.
        """
        if not 0 <= features_from < len(prompt_ids):
            raise ValueError(f"features_from = {features_from}: the prompt has {len(prompt_ids)} tokens")
        result = await self._score(prompt_ids, candidates, False, features_from, public_tokens)
        if result.scores is None or result.features is None:
            raise RuntimeError("scoring returned no features")
        return result.scores, result.features

    @property
    def feature_model_id(self) -> str:
        loaded = self.loaded
        return f"{loaded.name}|{loaded.dtype}|{loaded.weight_storage}"

    async def _score(
        self,
        prompt_ids: list[int],
        candidates: list[list[int]],
        normalize: bool,
        features_from: int | None,
        public_tokens: int,
    ) -> SequenceResult:
        if not candidates:
            raise ValueError("candidates must be non-empty token lists")
        _check_token_ids(prompt_ids, self.runner.vocab_size, "prompt_ids")
        for c in candidates:
            _check_token_ids(c, self.runner.vocab_size, "candidates")
        seq = Sequence(
            prompt_ids,
            SamplingParams(max_new_tokens=1),
            eos_token_ids=self.eos_token_ids,
            candidates=[list(c) for c in candidates],
            public_tokens=public_tokens,
        )
        if not normalize:
            seq.score_columns = sorted({c[0] for c in candidates})
        seq.features_from = features_from
        sink = _ScoreSink()
        self._queue(seq, sink)
        result: SequenceResult = await sink.future
        if result.finish_reason is FinishReason.ERROR or result.scores is None:
            raise RuntimeError(result.error or "scoring failed")
        return result

    def drop_session(self, session_key: Hashable) -> None:
        """Free a session's cached KV (session closed or expired)."""
        self.kv.drop_session(session_key)

    def health(self) -> BackendHealth:
        running = len(self.scheduler.running)
        return {
            "kind": "local",
            "state": "up",
            "running": running,
            "kernels": self.kernels,
            "kv": {
                **self.kv_memory.describe(),
                "bytes_per_token": self.kv.bytes_per_token,
                "tokens": self.kv.total_blocks * self.kv.block_tokens,
            },
            "speculation": self.scheduler.drafter.speculation.describe(),
        }

    @property
    def available(self) -> bool:
        return True  # in process: up as long as this server is

    def stats(self) -> BackendStats:
        s = self.scheduler
        return {
            "running": len(s.running),
            "waiting": len(s.waiting),
            "steps": s.steps,
            "tokens_generated": s.tokens_generated,
            "tokens_prefilled": s.tokens_prefilled,
            "draft_tokens": s.drafted,
            "draft_tokens_accepted": s.accepted,
            "kv": self.kv.stats(),
            "priorities": self._by_priority(),
        }

    def _by_priority(self) -> dict[str, PriorityStats]:
        s = self.scheduler
        running, waiting = list(s.running), list(s.waiting)  # copies: the scheduler thread moves them
        return {
            p.name.lower(): {
                "running": sum(q.priority == p for q in running),
                "waiting": sum(q.priority == p for q in waiting),
                "started": int(s.latency[p][0]),
                "queued_s": s.latency[p][1],
                "ttft_s": s.latency[p][2],
            }
            for p in Priority
        }
