"""`rtserver bench --workloads formats`: llama-server and `rtserver serve` on the model files people run.

One row per model file: the embedded model as shipped and requantized, a Qwen3-0.6B-shaped random
model, and Gemma 3 270M (a base model: plain-text completions). Each row runs llama-server, then
`rtserver serve`, one at a time, through burst-unique, single and arrival-unique, and follows each
server's peak RSS from its start. A file that cannot be made, or a server that refuses the model, is
that row's error, and the run goes on.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import model_files
from .server_bench import LLAMA_CTX_PER_SLOT, LLAMA_SLOTS, Prompts, fmt, run_llama_server, run_rtserver, times
from .stats import ratio

ROW_WORKLOADS = ("burst-unique", "single", "arrival-unique")
REQUANTIZED = ("Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
RANDOM_SHAPE, RANDOM_TYPES = "qwen3-0.6b", ("Q4_K_M", "Q8_0")
RSS_ALLOWANCE_MB = 600  # the bar: peak RSS <= file size + KV budget + this
# bar -> (ratio key, the ratio it must reach: at least for speed, at most for TTFT)
RATIO_BARS = {
    "single >= 1.0x": ("single_tokens_per_s", 1.0, True),
    "burst >= 1.5x": ("burst_tokens_per_s", 1.5, True),
    "burst TTFT p95 <= 0.5x": ("burst_ttft_p95", 0.5, False),
}
RSS_BAR = f"peak RSS <= file + KV budget + {RSS_ALLOWANCE_MB} MB"


@dataclass(frozen=True)
class FormatRow:
    """A model file of the matrix: how to make it, and how to serve it."""

    name: str
    make: Callable[[], Path] = field(compare=False)
    spec: str | None = None  # rtserver's `model` setting; None: the file's path
    completion: bool = False  # a base model: plain-text completions, not chat

    def prompts(self) -> Prompts:
        return Prompts(completion=self.completion)


def random_model(shape: str, qtype: str) -> Path:
    """The random model of `shape` in `qtype` (made once, cached)."""
    return model_files.random_gguf(shape, qtype)


def matrix() -> list[FormatRow]:
    """Every row, in the order they run."""
    from ..engine.model import embedded_model_path

    rows = [FormatRow("embedded", embedded_model_path, spec="embedded")]
    rows += [FormatRow(q.lower(), functools.partial(model_files.requantized, q)) for q in REQUANTIZED]
    rows += [
        FormatRow(f"{RANDOM_SHAPE}-{q.lower()}", functools.partial(random_model, RANDOM_SHAPE, q))
        for q in RANDOM_TYPES
    ]
    rows.append(FormatRow("gemma3-270m-q4_k_m", model_files.gemma3_270m, completion=True))
    return rows


def pick(rows: list[FormatRow], names: list[str] | None) -> list[FormatRow]:
    """The rows `names` asks for (case-insensitive), in the matrix's order; all of them for none."""
    if not names:
        return rows
    wanted = {n.strip().lower() for n in names if n.strip()}
    unknown = wanted - {r.name for r in rows}
    if unknown:
        known = ", ".join(r.name for r in rows)
        raise ValueError(f"unknown formats rows {', '.join(sorted(unknown))} (known: {known})")
    return [r for r in rows if r.name in wanted]


# -- one row (pure but for the runners) ---------------------------------------------------------

Runner = Callable[[FormatRow, Path, Path, float], dict]  # (row, file, log folder, KV budget MB) -> figures


def row_ratios(systems: dict) -> dict[str, float | None]:
    """rtserver / llama-server on the row's headline figures (None where either lacks one)."""
    ours, theirs = systems.get("rtserver", {}), systems.get("llama-server", {})

    def of(s: dict, workload: str, key: str) -> Any:
        return (s.get(workload) or {}).get(key)

    return {
        "burst_tokens_per_s": ratio(
            of(ours, "burst-unique", "tokens_per_s"), of(theirs, "burst-unique", "tokens_per_s")
        ),
        "single_tokens_per_s": ratio(
            of(ours, "single", "tokens_per_s"), of(theirs, "single", "tokens_per_s")
        ),
        "burst_ttft_p95": ratio(
            of(ours, "burst-unique", "ttft_p95_ms"), of(theirs, "burst-unique", "ttft_p95_ms")
        ),
    }


def row_bars(ratios: dict[str, float | None], rss_mb: float | None, rss_bar_mb: float) -> dict[str, Any]:
    """Whether each bar holds: True, False, or None when its figure is missing; `met` when all hold."""
    bars: dict[str, bool | None] = {}
    for name, (key, target, at_least) in RATIO_BARS.items():
        value = ratios.get(key)
        bars[name] = None if value is None else (value >= target if at_least else value <= target)
    bars[RSS_BAR] = None if rss_mb is None else rss_mb <= rss_bar_mb
    return {**bars, "met": all(v is True for v in bars.values())}


def kv_budget_for(path: Path, configured_mb: float) -> float:
    """rtserver's KV budget for a file: at least llama-server's context (its slots' tokens) in rtserver's
    float32 K/V, so both hold the same number of tokens; never below the configured budget."""
    from ..engine.gguf_file import GGUFFile
    from ..engine.gguf_load import gguf_config

    cfg = gguf_config(GGUFFile(path))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    needed = LLAMA_SLOTS * LLAMA_CTX_PER_SLOT * per_token / (1 << 20)
    return float(max(configured_mb, -(-needed // 16) * 16))  # in whole 16 MB


def run_row(row: FormatRow, kv_budget_mb: float, runners: dict[str, Runner], workdir: Path) -> dict:
    """The row's file made, then each server's figures, a failure of either being its error. rtserver
    gets a KV budget that holds what llama-server's context holds (`kv_budget_for`)."""
    out: dict[str, Any] = {"model": row.name, "prompts": "completion" if row.completion else "chat"}
    # a missing tool, package or maker is this row's error (a failed llama.cpp build exits); the run goes on
    try:
        path = row.make()
    except (Exception, SystemExit) as exc:
        return out | {"error": f"cannot make the model file: {type(exc).__name__}: {exc}"}
    file_mb = path.stat().st_size / (1 << 20)
    try:
        kv_budget_mb = kv_budget_for(path, kv_budget_mb)
    except Exception as exc:  # an unreadable or refused file: rtserver's run says why
        out["kv_budget_error"] = str(exc)
    out |= {
        "file": str(path),
        "file_mb": file_mb,
        "kv_budget_mb": kv_budget_mb,
        "rss_bar_mb": file_mb + kv_budget_mb + RSS_ALLOWANCE_MB,
    }
    folder = workdir / row.name
    folder.mkdir(parents=True, exist_ok=True)
    systems: dict[str, dict] = {}
    for name, runner in runners.items():
        try:
            systems[name] = runner(row, path, folder, kv_budget_mb)
        except Exception as exc:  # a refusal or a crash: recorded, the other server still runs
            systems[name] = {"error": str(exc)}
    out["systems"] = systems
    out["ratios"] = row_ratios(systems)
    out["bars"] = row_bars(out["ratios"], systems.get("rtserver", {}).get("peak_rss_mb"), out["rss_bar_mb"])
    return out


# -- the run ------------------------------------------------------------------------------------


def server_runners(
    binary: Path, dtype: str, threads: int, config: str | None, arrivals: int
) -> dict[str, Runner]:
    """llama-server and `rtserver serve` on a row's file, both on the row's prompts."""

    def llama(row: FormatRow, path: Path, folder: Path, kv_budget_mb: float) -> dict:
        return run_llama_server(binary, path, threads, ROW_WORKLOADS, folder, arrivals, row.prompts())

    def rtserver(row: FormatRow, path: Path, folder: Path, kv_budget_mb: float) -> dict:
        spec = row.spec or str(path)
        # a new model's first start builds its kernels before /ready
        return run_rtserver(
            dtype,
            threads,
            config,
            ROW_WORKLOADS,
            folder,
            arrivals,
            spec,
            row.prompts(),
            timeout_s=1200,
            kv_budget_mb=kv_budget_mb,
        )

    return {"llama-server": llama, "rtserver": rtserver}


def run_formats_bench(
    names: list[str] | None,
    dtype: str,
    threads: int,
    kv_budget_mb: float,
    config: str | None = None,
    arrivals: int = 20,
    llama_binary: Path | None = None,
    workdir: Path | None = None,
    on_row: Callable[[dict], None] = lambda report: None,
) -> dict:
    """Every picked row, one after another; `on_row` gets the report so far after each (the bench
    rewrites its JSON there)."""
    from .llama_build import build

    rows = pick(matrix(), names)
    workdir = workdir or Path(tempfile.mkdtemp(prefix="rtserver-formats-bench-"))
    binary = llama_binary or build()
    runners = server_runners(binary, dtype, threads, config, arrivals)
    report: dict[str, Any] = {
        "dtype": dtype,
        "threads": threads,
        "workloads": list(ROW_WORKLOADS),
        "kv_budget_mb": kv_budget_mb,
        "rows": {},
    }
    for row in rows:
        print(f"[formats] {row.name}: llama-server, then rtserver serve {dtype}", flush=True)
        report["rows"][row.name] = run_row(row, kv_budget_mb, runners, workdir)
        on_row(report)
    return report


# -- the printed table --------------------------------------------------------------------------


def system_cell(s: dict) -> str:
    """A server's figures on one row, or its error."""
    if "error" in s:
        return f"error: {s['error']}"
    b, one, a = s.get("burst-unique") or {}, s.get("single") or {}, s.get("arrival-unique") or {}
    exact = all(w.get("exact_token_counts") for w in (b, one) if w)
    return (
        f"{fmt(b.get('tokens_per_s'))} / {fmt(one.get('tokens_per_s'))}"
        f"{'' if exact else ' (NOT exact)'}; {fmt(b.get('ttft_p95_ms'))}; {fmt(a.get('ttft_p95_ms'))}; "
        f"{fmt(s.get('peak_rss_mb'))}"
    )


def bars_cell(bars: dict[str, Any]) -> str:
    failed = [name for name, held in bars.items() if name != "met" and held is False]
    missing = [name for name, held in bars.items() if name != "met" and held is None]
    if bars.get("met"):
        return "all met"
    return "; ".join(
        part
        for part in (
            f"NOT met: {', '.join(failed)}" if failed else "",
            f"no figure: {', '.join(missing)}" if missing else "",
        )
        if part
    )


def table_rows(formats: dict) -> list[tuple[str, str, str]]:
    """(figure, value, bar) rows: per model file its size and RSS bar, each server's figures, the
    ratios and which bars hold."""
    rows: list[tuple[str, str, str]] = []
    for name, r in formats.get("rows", {}).items():
        if "error" in r:
            rows.append((f"[formats] {name}", f"error: {r['error']}", ""))
            continue
        rows.append(
            (
                f"[formats] {name} file MB + KV budget MB + {RSS_ALLOWANCE_MB} = RSS bar MB",
                f"{fmt(r['file_mb'])} + {fmt(r['kv_budget_mb'])} + {RSS_ALLOWANCE_MB} = "
                f"{fmt(r['rss_bar_mb'])}",
                "",
            )
        )
        for system, s in r["systems"].items():
            rows.append(
                (
                    f"[formats] {name} {system}: burst / single tokens/s; burst TTFT p95 ms; "
                    "arrival TTFT p95 ms; peak RSS MB",
                    system_cell(s),
                    f"RSS <= {fmt(r['rss_bar_mb'])}" if system == "rtserver" else "",
                )
            )
        q = r["ratios"]
        rows.append(
            (
                f"[formats] {name} rtserver / llama-server: burst, single tokens/s; burst TTFT p95",
                f"{times(q['burst_tokens_per_s'])}, {times(q['single_tokens_per_s'])}; "
                f"{times(q['burst_ttft_p95'])}",
                ">= 1.5x, >= 1.0x; <= 0.5x",
            )
        )
        rows.append((f"[formats] {name} bars", bars_cell(r["bars"]), ""))
    return rows
