"""`rtserver bench --workloads formats`: llama-server and `rtserver serve` on the model files people run.

One row per model file: the embedded model as shipped and requantized (the README's headline row is
its Q4_K_M), random models in Qwen3-0.6B's, Llama-3.2-1B's and Qwen2.5-1.5B's real shapes, and Gemma
3 270M (a base model: plain-text completions). Each server, in a process of its own, takes one warm-up
request, `single-first`, the warm-up's wide batch, burst-unique, `single` (after the burst) and
arrival-unique; its peak RSS is followed from its start. rtserver runs its default config (the bench
sets only what `server_bench.BENCH_ENV` names), its KV in use followed through /metrics. A row of
`reps` runs the servers A B A B and reports every pair, never the best of them. The single-stream bar
compares rtserver's lower single figure with llama-server's better one, and knows the floor no single
stream beats: the file's matmul bytes read once a token at the machine's read bandwidth
(read_bandwidth.py). A file that cannot be made is that row's error, a server that refuses the model
that server's; the run goes on.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import model_files, read_bandwidth
from .server_bench import Prompts, failures, run_llama_server, run_rtserver
from .stats import ratio

ROW_WORKLOADS = ("single-first", "burst-unique", "single", "arrival-unique")
REQUANTIZED = ("Q4_0", "Q4_K_M", "IQ4_XS", "Q5_K_M", "Q6_K", "Q8_0")
HEADLINE = "q4_k_m"  # the README's row
# (shape, llama-quantize type) of the random-weight rows, in real vocabulary sizes
RANDOM_ROWS = (
    ("qwen3-0.6b", "Q4_K_M"),
    ("qwen3-0.6b", "Q8_0"),
    ("llama3.2-1b", "Q4_K_M"),
    ("qwen2.5-1.5b", "Q4_K_M"),
)

# The bars (issue 49), each against one run of both servers.
SINGLE_SPEEDUP, FLOOR_SHARE = 1.1, 0.92
BURST_SPEEDUP, BURST_TTFT_RATIO = 1.5, 0.8
RSS_ALLOWANCE_MB = 600
SINGLE_BAR = f"single >= {SINGLE_SPEEDUP}x (or >= {FLOOR_SHARE:.0%} of the floor where lower)"
BURST_BAR = f"burst >= {BURST_SPEEDUP}x"
TTFT_BAR = f"burst TTFT p95 <= {BURST_TTFT_RATIO}x"
REFUSAL_BAR = "no refused or failed request"
RSS_BAR = f"peak RSS <= file + KV in use + {RSS_ALLOWANCE_MB} MB"
BARS = (SINGLE_BAR, BURST_BAR, TTFT_BAR, REFUSAL_BAR, RSS_BAR)
KV_FROM_METRICS = "rtserver_kv_used_bytes in /metrics: the highest reading, every 0.5 s through the workloads"
KV_FROM_BUDGET = "the KV budget in /health (no /metrics reading)"


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
    from rtserver.engine.model import embedded_model_path

    rows = [FormatRow("embedded", embedded_model_path, spec="embedded")]
    rows += [FormatRow(q.lower(), functools.partial(model_files.requantized, q)) for q in REQUANTIZED]
    rows += [
        FormatRow(f"{shape}-{q.lower()}", functools.partial(random_model, shape, q))
        for shape, q in RANDOM_ROWS
    ]
    rows.append(FormatRow("gemma3-270m-q4_k_m", model_files.gemma3_270m, completion=True))
    return rows


def pick(rows: list[FormatRow], names: list[str] | None) -> list[FormatRow]:
    """The rows `names` asks for (case-insensitive), in the matrix's order. All of them for none."""
    if not names:
        return rows
    wanted = {n.strip().lower() for n in names if n.strip()}
    unknown = wanted - {r.name for r in rows}
    if unknown:
        known = ", ".join(r.name for r in rows)
        raise ValueError(f"unknown formats rows {', '.join(sorted(unknown))} (known: {known})")
    return [r for r in rows if r.name in wanted]


# -- the bars (pure) ----------------------------------------------------------------------------


def figure(system: dict[str, Any], workload: str, key: str) -> Any:
    return (system.get(workload) or {}).get(key)


def single_bar(
    ours: dict[str, Any], theirs: dict[str, Any], floor_tokens_per_s: float | None
) -> dict[str, Any]:
    """The single-stream bar. rtserver's lower of `single-first` and `single` (after the burst) is compared
    with llama-server's better of the two. It must be at least SINGLE_SPEEDUP times that. Or it must reach
    FLOOR_SHARE of the bandwidth floor, where that asks less. `held` is None where a figure is missing.
    """
    mine = [figure(ours, w, "tokens_per_s") for w in ("single-first", "single")]
    other = [figure(theirs, w, "tokens_per_s") for w in ("single-first", "single")]
    lower = min(mine) if None not in mine else None
    better = max(other) if None not in other else None
    needed, by = None, None
    if better is not None:
        needed, by = SINGLE_SPEEDUP * better, f"{SINGLE_SPEEDUP}x llama-server's better"
        if floor_tokens_per_s is not None and FLOOR_SHARE * floor_tokens_per_s < needed:
            needed, by = FLOOR_SHARE * floor_tokens_per_s, f"{FLOOR_SHARE:.0%} of the floor"
    speedup, share = ratio(lower, better), ratio(lower, floor_tokens_per_s)
    held = None
    if speedup is not None:  # compared as ratios, so a figure at the bar's edge holds it
        held = speedup >= SINGLE_SPEEDUP or (share is not None and share >= FLOOR_SHARE)
    return {
        "rtserver_first": mine[0],
        "rtserver_after_burst": mine[1],
        "rtserver_lower": lower,
        "llama_server_first": other[0],
        "llama_server_after_burst": other[1],
        "llama_server_better": better,
        "ratio": speedup,
        "floor_tokens_per_s": floor_tokens_per_s,
        "share_of_floor": share,
        "needed_tokens_per_s": needed,
        "needed_by": by,
        "held": held,
    }


def local_backend(ours: dict[str, Any]) -> dict[str, Any]:
    """rtserver's in-process engine as its /health describes it. Empty when it has none."""
    backends = ((ours.get("health") or {}).get("backends") or {}).values()
    return next((b for b in backends if b.get("kind") == "local"), {})


def kv_in_use(ours: dict[str, Any]) -> tuple[float | None, str | None]:
    """rtserver's KV in use for the RSS bar, and where it was read. That is its /metrics, else its budget."""
    if ours.get("kv_used_peak_mb") is not None:
        return ours["kv_used_peak_mb"], KV_FROM_METRICS
    budget = (local_backend(ours).get("kv") or {}).get("budget_mb")
    return (None, None) if budget is None else (float(budget), KV_FROM_BUDGET)


def at_most(value: float | None, limit: float | None) -> bool | None:
    return None if value is None or limit is None else value <= limit


def pair_figures(systems: dict[str, Any], file_mb: float, floor_tokens_per_s: float | None) -> dict[str, Any]:
    """One run of both servers on a row. It gives the ratios and the single-stream bar's figures. It gives
    each server's refused or failed requests, and the RSS bar. It says which bars hold (`met`: all of them).
    """
    ours, theirs = systems.get("rtserver", {}), systems.get("llama-server", {})
    single = single_bar(ours, theirs, floor_tokens_per_s)

    def both(workload: str, key: str) -> float | None:
        return ratio(figure(ours, workload, key), figure(theirs, workload, key))

    ratios = {
        "single_tokens_per_s": single["ratio"],  # rtserver's lower / llama-server's better
        "single_first_tokens_per_s": both("single-first", "tokens_per_s"),
        "single_after_burst_tokens_per_s": both("single", "tokens_per_s"),
        "burst_tokens_per_s": both("burst-unique", "tokens_per_s"),
        "burst_ttft_p95": both("burst-unique", "ttft_p95_ms"),
    }
    refused = {name: None if "error" in s else failures(s) for name, s in systems.items()}
    kv_mb, kv_source = kv_in_use(ours)
    rss_bar_mb = None if kv_mb is None else file_mb + kv_mb + RSS_ALLOWANCE_MB
    burst = ratios["burst_tokens_per_s"]
    bars: dict[str, bool | None] = {
        SINGLE_BAR: single["held"],
        BURST_BAR: None if burst is None else burst >= BURST_SPEEDUP,
        TTFT_BAR: at_most(ratios["burst_ttft_p95"], BURST_TTFT_RATIO),
        REFUSAL_BAR: None if refused.get("rtserver") is None else refused["rtserver"] == 0,
        RSS_BAR: at_most(ours.get("peak_rss_mb"), rss_bar_mb),
    }
    return {
        "systems": systems,
        "ratios": ratios,
        "single": single,
        "refused_or_failed": refused,
        # what one decode token of rtserver reads, beside the file's bytes the floor counts
        "rtserver_decode_weight_mb": (local_backend(ours).get("kernels") or {}).get("decode_weight_mb"),
        "kv_in_use_mb": kv_mb,
        "kv_in_use_source": kv_source,
        "rss_bar_mb": rss_bar_mb,
        "bars": {**bars, "met": all(v is True for v in bars.values())},
    }


def row_bars(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """A row's bars over every pair. False where any pair misses one. None where a pair lacks its figure
    (and none misses it). True where every pair holds it.
    """
    out: dict[str, bool | None] = {}
    for bar in BARS:
        held = [p["bars"][bar] for p in pairs]
        out[bar] = False if False in held else None if None in held or not held else True
    return {**out, "met": all(v is True for v in out.values())}


# -- one row (pure but for the runners) ---------------------------------------------------------

Runner = Callable[[FormatRow, Path, Path], dict[str, Any]]  # (row, file, log folder) -> figures


def floor_figures(path: Path, read_gb_per_s: float | None) -> dict[str, Any]:
    """The bytes of the file's tensors one token multiplies with, and the single stream's floor. The floor
    is the tokens/s at which reading them once a token takes all the measured read bandwidth.
    """
    from rtserver.engine.core import file_matmul_bytes
    from rtserver.engine.gguf_file import GGUFFile

    matmul = file_matmul_bytes(GGUFFile(path))
    floor = None if not read_gb_per_s or not matmul else read_gb_per_s * 1e9 / matmul
    return {"file_matmul_mb": matmul / (1 << 20), "read_gb_per_s": read_gb_per_s, "floor_tokens_per_s": floor}


def run_row(
    row: FormatRow,
    runners: dict[str, Runner],
    workdir: Path,
    reps: int = 1,
    read_gb_per_s: float | None = None,
) -> dict[str, Any]:
    """The row's file made, its floor, then `reps` pairs of runs. The servers alternate (A B A B). A failure
    of either is its error in that pair.
    """
    out: dict[str, Any] = {"model": row.name, "prompts": "completion" if row.completion else "chat"}
    # a missing tool, package or maker is this row's error (a failed llama.cpp build exits); the run goes on
    try:
        path = row.make()
    except (Exception, SystemExit) as exc:
        return out | {"error": f"cannot make the model file: {type(exc).__name__}: {exc}"}
    file_mb = path.stat().st_size / (1 << 20)
    out |= {"file": str(path), "file_mb": file_mb}
    try:
        out |= floor_figures(path, read_gb_per_s)
    except Exception as exc:  # an unreadable file: no floor; rtserver's run says why
        out["floor_error"] = f"{type(exc).__name__}: {exc}"
    pairs = []
    for rep in range(reps):
        folder = workdir / row.name / (f"pair{rep + 1}" if reps > 1 else "")
        folder.mkdir(parents=True, exist_ok=True)
        systems: dict[str, dict[str, Any]] = {}
        for name, runner in runners.items():
            try:
                systems[name] = runner(row, path, folder)
            except Exception as exc:  # a refusal or a crash: recorded, the other server still runs
                systems[name] = {"error": str(exc)}
        pairs.append(pair_figures(systems, file_mb, out.get("floor_tokens_per_s")))
    out["pairs"] = pairs
    # the first pair's figures at the row's top, where the chart reads them
    out["systems"], out["ratios"] = pairs[0]["systems"], pairs[0]["ratios"]
    out["bars"] = row_bars(pairs)
    return out


# -- the run ------------------------------------------------------------------------------------


def server_runners(
    binary: Path, dtype: str, threads: int, config: str | None, arrivals: int
) -> dict[str, Runner]:
    """llama-server and `rtserver serve` (its default config) on a row's file and prompts."""

    def llama(row: FormatRow, path: Path, folder: Path) -> dict[str, Any]:
        return run_llama_server(binary, path, threads, ROW_WORKLOADS, folder, arrivals, row.prompts())

    def rtserver(row: FormatRow, path: Path, folder: Path) -> dict[str, Any]:
        spec = row.spec or str(path)
        # a new model's first start builds its kernels before /ready; the KV budget and every door's
        # share of it are the configured ones
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
            api_kv_share=None,
        )

    return {"llama-server": llama, "rtserver": rtserver}


def run_formats_bench(
    names: list[str] | None,
    dtype: str,
    threads: int,
    config: str | None = None,
    arrivals: int = 20,
    reps: int = 1,
    llama_binary: Path | None = None,
    workdir: Path | None = None,
    on_row: Callable[[dict[str, Any]], None] = lambda report: None,
    bandwidth: Callable[[int], dict[str, Any]] = read_bandwidth.measure,
) -> dict[str, Any]:
    """The read bandwidth, then every picked row, one after another. `on_row` gets the report so far after
    each. The bench rewrites its JSON there.
    """
    from .llama_build import build

    if reps < 1:
        raise ValueError(f"reps = {reps}: a row runs at least once")
    rows = pick(matrix(), names)
    workdir = workdir or Path(tempfile.mkdtemp(prefix="rtserver-formats-bench-"))
    binary = llama_binary or build()
    runners = server_runners(binary, dtype, threads, config, arrivals)
    print(f"[formats] read bandwidth, {threads} threads", flush=True)
    try:
        read = bandwidth(threads)
    except Exception as exc:  # no memory for the array: the rows go on without a floor
        read = {"error": f"{type(exc).__name__}: {exc}"}
    report: dict[str, Any] = {
        "dtype": dtype,
        "threads": threads,
        "workloads": list(ROW_WORKLOADS),
        "reps": reps,
        "read_bandwidth": read,
        "bars": list(BARS),
        "rows": {},
    }
    for row in rows:
        print(f"[formats] {row.name}: {reps} x (llama-server, then rtserver serve {dtype})", flush=True)
        report["rows"][row.name] = run_row(row, runners, workdir, reps, read.get("gb_per_s"))
        on_row(report)
    return report


# -- the printed table --------------------------------------------------------------------------
