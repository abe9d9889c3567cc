"""`rtserver bench --workloads kld`: how far rtserver's and llama.cpp's next-token distributions stray from
the float32 reference on the same model file and the same text.

The text (data/kld-text.txt, public domain, data/SOURCES.md) is tokenized once by the file's tokenizer
and cut into windows of N_CTX ids as llama-perplexity cuts them (kld_windows.py); the second half of each
window is scored. The reference is rtserver's float32 path on the file (its weights dequantized, float32
KV), one step of each window's rows. Its log-probabilities go into llama-perplexity's
`--kl-divergence-base` file (kld_base.py), token ids included, so llama.cpp evaluates the same ids against
the same reference bytes that rtserver's figures are counted against, with the same formula (kld.py).
rtserver's default path (the bench's dtype and engine settings) is measured twice, through the engine's
own runner with no scheduler: prefill, each window as one step of all its rows, as a prompt of that size
runs (every row's logits: the runner's torch composition of the kernel's many-row linears and attention,
the fused layer's arithmetic); decode, each window's first half as a prompt, then its scored positions
one token a step on the KV cache, as a stream generates. llama.cpp runs `llama-perplexity
--kl-divergence` on the file, one window a batch (`-b N_CTX`): its prompt path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from rtserver.config import EngineSettings
from rtserver.engine.backend import SamplingParams
from rtserver.engine.core import Engine
from rtserver.engine.gguf_file import GGUFFile
from rtserver.engine.kv import KVHandle
from rtserver.engine.model import LoadedModel, load_model
from rtserver.engine.plan import StepItem
from rtserver.engine.quant import Kernel
from rtserver.engine.sequence import Sequence

from .kld import Divergence, log_softmax
from .kld_base import BaseWriter, decode_rows
from .kld_windows import Windows

TEXT = Path(__file__).parent / "data" / "kld-text.txt"
N_CTX = 512  # llama-perplexity's default context
DEFAULT_FILES = ("q4_k_m", "gemma3-270m-q4_k_m")  # the bar's files (issue 51)
PATHS = ("prefill", "decode")
KV_BUDGET_MB = 256  # one window's KV at a time
LLAMA_TIMEOUT_S = 3600


def read_text(path: Path = TEXT) -> str:
    return path.read_text(encoding="utf-8")


def bos_id(path: Path) -> int | None:
    """The id llama.cpp puts first in each window: the file's BOS where its tokenizer adds one. The file's
    `tokenizer.ggml.add_bos_token` decides; without it, llama.cpp's default for a SentencePiece vocabulary
    (BOS) and for the others (none).
    """
    meta = GGUFFile(path).metadata
    add = meta.get("tokenizer.ggml.add_bos_token")
    if add is None:
        add = meta.get("tokenizer.ggml.model") == "llama"
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return int(bos) if add and bos is not None else None


def decode_activations(kernel: Kernel | None) -> str | None:
    """What one-row steps round activations to, per 32: the kernel's width where its integer dots take
    every type (VNNI; AVX2's byte dots at 8 bits), else 16 bits on the K-quants' own passes (AVX2) and
    float32 elsewhere."""
    if kernel is None:
        return None
    if kernel.fixed_point_activations or (kernel.byte_dots and kernel.activation_bits() == 8):
        return f"{kernel.activation_bits()}-bit activations"
    if kernel.decode_passes:
        return f"16-bit activations on {'/'.join(kernel.decode_passes)}, 32-bit elsewhere"
    return "32-bit activations"


class Logits:
    """A loaded model's logits over a window, through its engine's runner on a thread of its own that runs
    the steps (no scheduler): `prefill` and `decode` give the scored rows, [scored, vocab] float32.
    """

    def __init__(self, loaded: LoadedModel, settings: EngineSettings, n_ctx: int):
        options = dataclasses.replace(
            settings,
            kv_budget_mb=KV_BUDGET_MB,
            max_sequence_tokens=max(settings.max_sequence_tokens, n_ctx),
        )
        self.engine = Engine(loaded, options, release_dense_weights=True)  # as `rtserver serve` runs it
        self.runner = self.engine.runner
        self._steps = ThreadPoolExecutor(1, "rtserver-kld", initializer=self.engine.take_step_thread)

    def describe(self) -> dict[str, Any]:
        kernel = self.engine.loaded.kernel
        return {
            "dtype": self.engine.loaded.dtype_name,
            "activation_bits": None if kernel is None else kernel.activation_bits(),  # big steps
            "decode_activations": decode_activations(kernel),
            "kv": self.engine.kv_memory.describe(),
            "kernels": self.engine.kernels,
        }

    def prefill(self, ids: list[int], first: int) -> torch.Tensor:
        return self._steps.submit(self._prefill, ids, first).result()

    def decode(self, ids: list[int], first: int) -> torch.Tensor:
        return self._steps.submit(self._decode, ids, first).result()

    def close(self) -> None:
        self._steps.shutdown()

    @contextmanager
    def _sequence(self, ids: list[int]) -> Iterator[tuple[Sequence, KVHandle]]:
        """A sequence of the window's ids and its own KV, freed after."""
        seq = Sequence(ids, SamplingParams(), eos_token_ids=set())
        kv, _ = self.engine.kv.acquire(ids, len(ids))
        seq.kv = kv
        try:
            yield seq, kv
        finally:
            self.engine.kv.release(kv)

    def _prefill(self, ids: list[int], first: int) -> torch.Tensor:
        with self._sequence(ids) as (seq, kv):
            (logits,) = self.runner.forward([StepItem(seq, kv, 0, ids, "all")])
        assert logits is not None
        return logits[first : len(ids) - 1]

    def _decode(self, ids: list[int], first: int) -> torch.Tensor:
        with self._sequence(ids) as (seq, kv):
            self.runner.forward([StepItem(seq, kv, 0, ids[:first], "last")])  # its row is not scored
            rows = []
            for p in range(first, len(ids) - 1):
                (row,) = self.runner.forward([StepItem(seq, kv, p, [ids[p]], "last")])
                assert row is not None
                rows.append(row)
        return torch.cat(rows)


def text_ids(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer(text, add_special_tokens=False).input_ids
    return ids


def measure_rtserver(
    reference: Logits,
    default: Logits,
    windows: Windows,
    base: Path,
    say: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Every window through the reference, then the default path's prefill and decode. Writes the base file;
    returns each path's figures against its stored rows (llama.cpp's reference) and against the exact float32
    log-probabilities, and the reference's own against its stored rows (what storing costs).
    """
    vocab = reference.runner.vocab_size
    if default.runner.vocab_size != vocab:
        raise ValueError(
            f"the reference has {vocab} logits a row, the default path {default.runner.vocab_size}"
        )
    stored = {p: Divergence() for p in PATHS}
    exact = {p: Divergence() for p in PATHS}
    floor = Divergence()
    seconds = dict.fromkeys(("reference", *PATHS), 0.0)
    with BaseWriter(base, windows.n_ctx, vocab, windows.all_tokens()) as writer:
        for w in range(windows.count):
            say(f"    window {w + 1}/{windows.count}")
            ids = windows.inputs(w)
            started = time.perf_counter()
            ref = reference.prefill(ids, windows.first).numpy()
            seconds["reference"] += time.perf_counter() - started
            stored_lp = decode_rows(writer.write(ref), vocab)
            exact_lp = log_softmax(ref)
            floor.add(stored_lp, ref)
            for name in PATHS:
                started = time.perf_counter()
                ours = (default.prefill if name == "prefill" else default.decode)(ids, windows.first).numpy()
                seconds[name] += time.perf_counter() - started
                stored[name].add(stored_lp, ours)
                exact[name].add(exact_lp, ours)
    out: dict[str, Any] = {name: stored[name].summary() for name in PATHS}
    for name in PATHS:
        out[name]["against_exact_float32"] = exact[name].summary()
    out["reference_against_its_stored_rows"] = floor.summary()
    out["seconds"] = seconds
    return out


# -- llama.cpp ----------------------------------------------------------------------------------

LLAMA_FIGURES = {
    "mean_kld": r"Mean\s+KLD:\s+(\S+)",
    "median_kld": r"Median\s+KLD:\s+(\S+)",
    "p99_kld": r"99\.0%\s+KLD:\s+(\S+)",
    "max_kld": r"Maximum KLD:\s+(\S+)",
    "top1_agreement": r"Same top p:\s+(\S+)\s*±",
}


def parse_llama_kld(output: str, scored_per_window: int) -> dict[str, Any]:
    """llama-perplexity's KL-divergence statistics, as rtserver's are named. ValueError where it printed
    none (it prints them from 100 scored positions on).
    """
    out: dict[str, Any] = {}
    for key, pattern in LLAMA_FIGURES.items():
        found = re.findall(pattern, output)
        if not found:
            raise ValueError(f"llama-perplexity printed no {key} ({pattern})")
        out[key] = float(found[-1]) / (100 if key == "top1_agreement" else 1)
    chunks = re.search(r"computing over (\d+) chunks", output)
    out["tokens_scored"] = int(chunks.group(1)) * scored_per_window if chunks else None
    return out


def run_llama_kld(
    binary: Path, model: Path, base: Path, n_ctx: int, threads: int, log: Path, scored_per_window: int
) -> dict[str, Any]:
    """`llama-perplexity --kl-divergence` on the model file against the base file, one window a batch."""
    command = [str(binary), "-m", str(model), "--kl-divergence-base", str(base), "--kl-divergence"]
    command += ["-c", str(n_ctx), "-b", str(n_ctx), "-t", str(threads)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=LLAMA_TIMEOUT_S)
    seconds = time.perf_counter() - started
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        tail = " / ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"llama-perplexity exited {done.returncode}: {tail}")
    figures = parse_llama_kld(done.stdout + done.stderr, scored_per_window)
    return figures | {"command": " ".join(command), "log": str(log), "seconds": seconds}


# -- the bar and one file -------------------------------------------------------------------------


def bar(rtserver: dict[str, Any], llama: dict[str, Any]) -> dict[str, bool | None]:
    """Issue 51's bar, per path: rtserver's mean KLD and top-1 disagreement at most llama.cpp's. None where
    a figure is missing.
    """
    out: dict[str, bool | None] = {}
    for name in PATHS:
        ours, theirs = rtserver.get(name) or {}, llama or {}
        figures = (ours.get("mean_kld"), theirs.get("mean_kld"), ours.get("top1_agreement"))
        if None in figures or theirs.get("top1_agreement") is None:
            out[name] = None
            continue
        out[name] = (
            ours["mean_kld"] <= theirs["mean_kld"] and ours["top1_agreement"] >= theirs["top1_agreement"]
        )
    return out


def measure_file(
    path: Path,
    dtype: str,
    settings: EngineSettings,
    threads: int,
    cache_dir: str,
    workdir: Path,
    llama_binary: Path | None,
    text: str,
    n_ctx: int = N_CTX,
    say: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """One model file: the float32 reference and the default path in-process, then llama.cpp (skipped when
    `llama_binary` is None). The base file is deleted at the end: gigabytes for a large vocabulary.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    base = workdir / "reference.kld"
    say("  loading the float32 reference and the default path")
    reference = Logits(load_model(str(path), "float32", threads, cache_dir), settings, n_ctx)
    default = Logits(load_model(str(path), dtype, threads, cache_dir), settings, n_ctx)
    try:
        ids = text_ids(default.engine.tokenizer, text)
        windows = Windows(ids, n_ctx, bos_id(path))
        out: dict[str, Any] = {
            "file": str(path),
            "file_mb": path.stat().st_size / (1 << 20),
            "text": {"sha256": hashlib.sha256(text.encode()).hexdigest(), "token_ids": len(ids)},
            "n_ctx": n_ctx,
            "windows": windows.count,
            "bos": windows.bos,
            "tokens_scored": windows.tokens_scored,
            "reference": reference.describe(),
        }
        say(f"  {windows.count} windows of {n_ctx}: reference, prefill, decode")
        rtserver = measure_rtserver(reference, default, windows, base, say)
        out["rtserver"] = default.describe() | rtserver
    finally:
        reference.close()
        default.close()
    if llama_binary is not None:
        say("  llama-perplexity --kl-divergence")
        try:
            out["llama.cpp"] = run_llama_kld(
                llama_binary, path, base, n_ctx, threads, workdir / "llama-perplexity.log", windows.scored
            )
        except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            out["llama.cpp"] = {"error": f"{type(exc).__name__}: {exc}"}
    base.unlink(missing_ok=True)
    out["bar"] = bar(out["rtserver"], out.get("llama.cpp") or {})
    return out


def run_kld_bench(
    names: list[str] | None,
    dtype: str,
    settings: EngineSettings,
    threads: int,
    cache_dir: str = "~/.cache/rtserver",
    workdir: Path | None = None,
    on_row: Callable[[dict[str, Any]], None] = lambda report: None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Each picked file (`--formats` names, the bar's two by default), one after another. `on_row` gets the
    report so far after each; a file that cannot be made or measured is its row's error.
    """
    from .formats_bench import matrix, pick
    from .llama_build import llama_perplexity

    spec, _, kv_dtype = dtype.partition(":kv=")
    if kv_dtype:
        settings = dataclasses.replace(settings, kv_dtype=kv_dtype)
    rows = pick(matrix(), names or list(DEFAULT_FILES))
    workdir = workdir or Path(tempfile.mkdtemp(prefix="rtserver-kld-"))
    text = read_text()
    report: dict[str, Any] = {
        "dtype": dtype,
        "threads": threads,
        "n_ctx": N_CTX,
        "text": str(TEXT.relative_to(Path(__file__).parent.parent)),
        "rows": {},
    }
    # no build (a failed one exits): rtserver's figures still come, the report says why llama.cpp's do not
    try:
        binary: Path | None = llama_perplexity()
    except (Exception, SystemExit) as exc:
        binary, report["llama_error"] = None, f"{type(exc).__name__}: {exc}"
    for row in rows:
        say(f"[kld] {row.name}")
        try:
            path = row.make()
            report["rows"][row.name] = measure_file(
                path, spec, settings, threads, cache_dir, workdir / row.name, binary, text, say=say
            )
        except (Exception, SystemExit) as exc:
            report["rows"][row.name] = {"error": f"{type(exc).__name__}: {exc}"}
        on_row(report)
    return report
