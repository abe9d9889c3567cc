"""The servers comparison's rows in the bench's table (`server_bench.py` runs it)."""

from __future__ import annotations

from typing import Any

from .cells import fmt, times
from .server_bench import SERVER_WORKLOADS, ratios

Row = tuple[str, str, str]  # figure, value, bar


def _exact(r: dict[str, Any]) -> str:
    refused = f", {r['errors']} refused or failed" if r.get("errors") else ""
    return ("exact" if r.get("exact_token_counts") else "NOT exact") + refused


def _system_rows(name: str, s: dict[str, Any]) -> list[Row]:
    """One server's rows: errors, burst and single speeds, arrival first tokens, peak RSS."""
    rows: list[Row] = []
    rtserver = name != "llama-server"
    for w in SERVER_WORKLOADS:
        if "error" in (s.get(w) or {}):
            rows.append((f"[servers] {name} {w}", f"error: {s[w]['error']}", ""))
    for w in ("burst", "burst-unique", "single"):
        r = s.get(w)
        if r and "error" not in r:
            rows.append(
                (
                    f"[servers] {name} {w} tokens/s; TTFT p50 / p95 ms",
                    f"{fmt(r['tokens_per_s'])} ({_exact(r)}); "
                    f"{fmt(r['ttft_p50_ms'])} / {fmt(r['ttft_p95_ms'])}",
                    "TTFT p95 <= 1000" if rtserver and w.startswith("burst") else "",
                )
            )
    for w in ("arrival", "arrival-unique"):
        a = s.get(w)
        if a and "error" not in a:
            rows.append(
                (
                    f"[servers] {name} {w} TTFT p50 / p95 ms; decode step ms; p95 in steps",
                    f"{fmt(a['ttft_p50_ms'])} / {fmt(a['ttft_p95_ms'])}; {fmt(a['decode_step_ms'])}; "
                    f"{fmt(a['ttft_p95_in_steps'], 'x')}"
                    + (
                        f" ({a['background_restarts']} background streams sent again)"
                        if a.get("background_restarts")
                        else ""
                    ),
                    "<= 1.5x" if rtserver else "",
                )
            )
    rows.append((f"[servers] {name} peak RSS MB", fmt(s.get("peak_rss_mb")), "<= 1536" if rtserver else ""))
    return rows


def _ratio_rows(systems: dict[str, Any]) -> list[Row]:
    """Each rtserver against llama-server, on both prompt sets where the unique one ran."""
    rows: list[Row] = []
    unique_ran = any("burst-unique" in s for s in systems.values())
    for name, r in ratios(systems).items():
        rows.append(
            (
                f"[servers] {name} / llama-server: burst tokens/s, single tokens/s",
                f"{fmt(r['burst_tokens_per_s'], 'x')}, {fmt(r['single_tokens_per_s'], 'x')}",
                ">= 2.5x, >= 1.0x",
            )
        )
        rows.append(
            (
                f"[servers] {name} / llama-server: burst TTFT p95, arrival TTFT p95",
                f"{fmt(r['burst_ttft_p95'], 'x')}, {fmt(r['arrival_ttft_p95'], 'x')}",
                "",
            )
        )
        if unique_ran:
            rows.append(
                (
                    f"[servers] {name} / llama-server, unique prefixes: burst tokens/s; burst TTFT p95, "
                    "arrival TTFT p95",
                    f"{times(r['burst_unique_tokens_per_s'])}; {times(r['burst_unique_ttft_p95'])}, "
                    f"{times(r['arrival_unique_ttft_p95'])}",
                    ">= 1.5x; <= 0.5x",
                )
            )
    return rows


def table_rows(servers: dict[str, Any]) -> list[Row]:
    """(figure, value, bar) rows of the servers comparison for the bench's printed table, each prompt
    set's row beside the other's; the shared set's bars are issue 12's, the unique set's issue 25's."""
    systems = servers.get("systems", {})
    return [row for name, s in systems.items() for row in _system_rows(name, s)] + _ratio_rows(systems)
