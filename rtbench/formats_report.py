"""The formats matrix's rows in the bench's table (`formats_bench.py` runs it)."""

from __future__ import annotations

from typing import Any

from .cells import fmt, times
from .formats_bench import BURST_SPEEDUP, BURST_TTFT_RATIO, FLOOR_SHARE, RSS_ALLOWANCE_MB, SINGLE_SPEEDUP

SYSTEM_FIGURES = (
    "burst / single first / single after burst tokens/s; burst TTFT p95 ms; arrival TTFT p95 ms; "
    "peak RSS MB; refused or failed"
)


def system_cell(s: dict[str, Any], refused: int | None) -> str:
    """A server's figures on one run, or its error."""
    if "error" in s:
        return f"error: {s['error']}"
    b, first, one = s.get("burst-unique") or {}, s.get("single-first") or {}, s.get("single") or {}
    a = s.get("arrival-unique") or {}
    exact = all(w.get("exact_token_counts") for w in (b, first, one) if w)
    return (
        f"{fmt(b.get('tokens_per_s'))} / {fmt(first.get('tokens_per_s'))} / {fmt(one.get('tokens_per_s'))}"
        f"{'' if exact else ' (NOT exact)'}; {fmt(b.get('ttft_p95_ms'))}; {fmt(a.get('ttft_p95_ms'))}; "
        f"{fmt(s.get('peak_rss_mb'))}; {'n/a' if refused is None else refused}"
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


def pair_rows(name: str, p: dict[str, Any], file_mb: float) -> list[tuple[str, str, str]]:
    """(figure, value, bar) rows of one run of both servers."""
    rows = [
        (
            f"[formats] {name} {system}: {SYSTEM_FIGURES}",
            system_cell(s, p["refused_or_failed"].get(system)),
            "0 refused" if system == "rtserver" else "",
        )
        for system, s in p["systems"].items()
    ]
    q, one = p["ratios"], p["single"]
    rows.append(
        (
            f"[formats] {name} rtserver / llama-server: burst tokens/s; burst TTFT p95; single, "
            "rtserver's lower / llama-server's better (first, after burst)",
            f"{times(q['burst_tokens_per_s'])}; {times(q['burst_ttft_p95'])}; "
            f"{times(q['single_tokens_per_s'])} ({times(q['single_first_tokens_per_s'])}, "
            f"{times(q['single_after_burst_tokens_per_s'])})",
            f">= {BURST_SPEEDUP}x; <= {BURST_TTFT_RATIO}x; >= {SINGLE_SPEEDUP}x",
        )
    )
    rows.append(
        (
            f"[formats] {name} single: rtserver's lower tokens/s, needed, share of the floor; "
            "MB rtserver reads a token",
            f"{fmt(one['rtserver_lower'])}, {fmt(one['needed_tokens_per_s'])} ({one['needed_by'] or 'n/a'}), "
            f"{'n/a' if one['share_of_floor'] is None else format(one['share_of_floor'], '.0%')}; "
            f"{fmt(p['rtserver_decode_weight_mb'])}",
            f">= the lower of {SINGLE_SPEEDUP}x llama-server's better and {FLOOR_SHARE:.0%} of the floor",
        )
    )
    rows.append(
        (
            f"[formats] {name} rtserver peak RSS MB; file MB + KV in use MB + {RSS_ALLOWANCE_MB}",
            f"{fmt(p['systems'].get('rtserver', {}).get('peak_rss_mb'))}; {fmt(file_mb)} + "
            f"{fmt(p['kv_in_use_mb'])} + {RSS_ALLOWANCE_MB} = {fmt(p['rss_bar_mb'])}",
            f"KV: {p['kv_in_use_source'] or 'n/a'}",
        )
    )
    return rows


def table_rows(formats: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(figure, value, bar) rows. Per model file: its size and floor, and each pair's figures, ratios and
    RSS bar. Also which bars hold over every pair.
    """
    rows: list[tuple[str, str, str]] = []
    read = formats.get("read_bandwidth") or {}
    if read:
        rows.append(
            (
                "[formats] read bandwidth GB/s",
                fmt(read.get("gb_per_s")),
                read.get("method") or read.get("error", ""),
            )
        )
    for name, r in formats.get("rows", {}).items():
        if "error" in r:
            rows.append((f"[formats] {name}", f"error: {r['error']}", ""))
            continue
        rows.append(
            (
                f"[formats] {name} file MB; matmul MB a token; floor tokens/s",
                f"{fmt(r['file_mb'])}; {fmt(r.get('file_matmul_mb'))}; {fmt(r.get('floor_tokens_per_s'))}",
                r.get("floor_error", ""),
            )
        )
        pairs = r["pairs"]
        for i, p in enumerate(pairs):
            label = f"{name} pair {i + 1}" if len(pairs) > 1 else name
            rows += pair_rows(label, p, r["file_mb"])
        rows.append(
            (f"[formats] {name} bars" + (" (every pair)" if len(pairs) > 1 else ""), bars_cell(r["bars"]), "")
        )
    return rows
