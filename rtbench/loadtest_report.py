"""The load test's report: its pass/fail checks, the printed table and the JSON file.

`loadtest.py` runs the phases and fills the report; this module only reads it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

Report = dict[str, Any]  # one JSON object per phase, as the phases return it
Check = tuple[str, bool]
Row = tuple[str, str]


def _load_checks(load: Report) -> list[Check]:
    return [
        (
            "idle connections all open and alive",
            load["idle_open_failed"] == 0 and load["idle_alive_after_chat"] == load["idle_connections"],
        ),
        (
            "every chat reply completed, zero errors",
            load["completed_turns"] == load["expected_turns"] and not load["errors"],
        ),
        ("idle connections cost <= 300 MB RSS", load["rss_idle_extra_mb"] <= 300),
    ]


def _slow_client_checks(slow: Report) -> list[Check]:
    return [
        (
            "slow client dropped (server closed it: 4008, or 1006 when it read nothing)",
            slow["slow_client_close_code"] in (4008, 1006) and slow["slow_client_closes"] >= 1,
        ),
        ("others unaffected by the slow client (no errors)", not slow["others_errors"]),
    ]


def _disconnect_checks(disc: Report) -> list[Check]:
    return [
        (
            f"disconnects {kind.replace('_', ' ')}: running and KV back to baseline",
            disc[kind]["running_after"] == 0 and disc[kind]["seconds_to_kv_baseline"] is not None,
        )
        for kind in ("one_after_another", "all_at_once")
    ]


def _overload_checks(over: Report) -> list[Check]:
    return [
        ("overload: each request done or overloaded", set(over["outcomes"]) <= {"done", "overloaded"}),
        (
            "overload: latency back to unloaded level (<= 1.5x)",
            over["ttft_after_over_before"] is not None and over["ttft_after_over_before"] <= 1.5,
        ),
    ]


def _fault_checks(faults: Report) -> list[Check]:
    return [
        (
            "faults: other requests complete",
            faults["normal_done"] == faults["normal"] and faults["after_done"] == faults["after"],
        ),
        (
            "faults: only the affected requests fail with internal",
            faults["step_fault_outcome"] == "internal"
            and all(o == "internal" for o in faults["parser_fault_outcomes"]),
        ),
        ("faults: no internals sent to clients", not faults["internal_details_leaked"]),
    ]


def _shutdown_checks(down: Report) -> list[Check]:
    return [
        (
            "SIGTERM: shutting_down sent, short reply finished, long one ended",
            bool(down["shutting_down_event"])
            and down["short_reply"] == "done"
            and down["long_reply"] in ("done", "shutting_down"),
        ),
        (
            "SIGTERM: sockets closed 1001, exit 0",
            down["close_codes"] == [1001, 1001] and down["exit_code"] == 0,
        ),
    ]


def _load_failure_checks(fail: Report) -> list[Check]:
    return [
        (
            f"load failure ({name}): exit != 0, names the file, no traceback",
            f["exit_code"] != 0 and bool(f["names_file"]) and not f["traceback"],
        )
        for name, f in fail.items()
    ]


PHASE_CHECKS = (
    ("load", _load_checks),
    ("slow_client", _slow_client_checks),
    ("disconnects", _disconnect_checks),
    ("overload", _overload_checks),
    ("faults", _fault_checks),
    ("shutdown", _shutdown_checks),
    ("load_failure", _load_failure_checks),
)


def checks(report: Report) -> list[Check]:
    """Each bar of the phases that ran, and whether it held."""
    return [check for key, of in PHASE_CHECKS if report.get(key) for check in of(report[key])]


def _load_rows(L: Report) -> list[Row]:
    return [
        (
            "idle connections (after hello)",
            f"{L['idle_connections']} open, {L['idle_alive_after_chat']} alive after",
        ),
        ("RSS growth for idle connections", f"{L['rss_idle_extra_mb']} MB"),
        (
            f"{L['chatting_sessions']} sessions chatting: replies",
            f"{L['completed_turns']}/{L['expected_turns']}, errors {L['errors'] or 0}",
        ),
        ("  TTFT p50 / p95 (both turns)", f"{L['ttft_p50_ms']:.0f} / {L['ttft_p95_ms']:.0f} ms"),
        (
            f"  phase 1 burst: {L['chatting_sessions']} new chats at once + their auto tasks "
            f"({', '.join(L['auto_tasks']) or 'none'}): first-turn TTFT p50 / p95 (bar: p95 <= 4 s)",
            f"{L['first_turn_ttft_p50_ms']:.0f} / {L['first_turn_ttft_p95_ms']:.0f} ms",
        ),
    ]


def _overload_rows(ov: Report) -> list[Row]:
    return [
        (f"overload: {ov['submitted']} chats at once (4x max_running)", json.dumps(ov["outcomes"])),
        ("  `overloaded` answered within (p95)", f"{ov['overloaded_answer_p95_ms']} ms"),
        (
            "  unloaded TTFT before / after",
            f"{ov['unloaded_before']['ttft_ms']} / {ov['unloaded_after']['ttft_ms']} ms",
        ),
    ]


def _slow_client_rows(S: Report) -> list[Row]:
    return [
        ("slow client: closed with", str(S["slow_client_close_code"])),
        (
            "  others' tokens/s without / with it",
            f"{S['others_tokens_per_s_before']} / {S['others_tokens_per_s_during']}",
        ),
        ("  server RSS before / during", f"{S['rss_before_mb']} / {S['rss_during_mb']} MB"),
    ]


def _disconnect_rows(D: Report) -> list[Row]:
    return [
        (
            f"{D['count']} disconnects {kind.replace('_', ' ')}",
            f"running after {D[kind]['running_after']:.0f}, "
            f"KV back to baseline in {D[kind]['seconds_to_kv_baseline']} s",
        )
        for kind in ("one_after_another", "all_at_once")
    ]


def _fault_rows(F: Report) -> list[Row]:
    return [
        (
            "faults: step / parser raise",
            f"{F['step_fault_outcome']} / {','.join(F['parser_fault_outcomes'])}",
        ),
        (
            "  other requests done",
            f"{F['normal_done']}/{F['normal']} during, {F['after_done']}/{F['after']} after",
        ),
    ]


def _shutdown_rows(S: Report) -> list[Row]:
    return [
        ("SIGTERM: short / long reply", f"{S['short_reply']} / {S['long_reply']}"),
        (
            "  close codes, exit code, time",
            f"{S['close_codes']}, {S['exit_code']}, {S['seconds_to_exit']} s",
        ),
    ]


def _load_failure_rows(fail: Report) -> list[Row]:
    return [
        (f"model load failure ({name})", f"exit {f['exit_code']}: {f['message'][:70]}")
        for name, f in fail.items()
    ]


PHASE_ROWS = (
    ("load", _load_rows),
    ("overload", _overload_rows),
    ("slow_client", _slow_client_rows),
    ("disconnects", _disconnect_rows),
    ("faults", _fault_rows),
    ("shutdown", _shutdown_rows),
    ("load_failure", _load_failure_rows),
)


def print_report(r: Report) -> None:
    """The table of the phases that ran, then each check."""
    rows = [row for key, of in PHASE_ROWS if key in r for row in of(r[key])]
    width = max(len(a) for a, _ in rows) if rows else 0
    print()
    for a, b in rows:
        print(f"{a:<{width}}  {b}")
    print()
    for c in r.get("checks", []):
        print(f"[{'PASS' if c['passed'] else 'FAIL'}] {c['check']}")


def write_report(report: Report, out_dir: str) -> Path:
    """The checks' verdict into the report, then the JSON file and the table."""
    report["checks"] = [{"check": name, "passed": ok} for name, ok in checks(report)]
    report["passed"] = all(c["passed"] for c in report["checks"])
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / f"loadtest-{time.strftime('%Y-%m-%dT%H%M%S%z')}.json"
    path.write_text(json.dumps(report, indent=2))
    print_report(report)
    print(f"\nJSON: {path}")
    return path


def write_assist_report(report: Report, out_dir: str) -> Path:
    """`loadtest --assist`: the JSON file, and the same JSON printed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"loadtest-assist-{time.strftime('%Y-%m-%dT%H%M%S%z')}.json"
    path.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print(f"written to {path}")
    return path


# -- many nodes (clusterload.py) ---------------------------------------------------------------------


def cluster_checks(r: Report, overhead_bar_ms: float = 5.0) -> list[Check]:
    """`loadtest --nodes`: each bar of the phases that ran, and whether it held."""
    out: list[tuple[str, bool]] = []
    L = r.get("load")
    if L:
        n = L["nodes"]
        out += [
            (f"{n}x{L['idle_per_node']} idle connections opened", L["idle_open_failed"] == 0),
            (
                "all idle connections alive after the chat load",
                L["idle_alive_after_chat"] == n * L["idle_per_node"],
            ),
            (
                "every chatting turn completed, 0 errors",
                L["completed_turns"] == L["expected_turns"] and not L["errors"],
            ),
            (f"/health counts {n} nodes alive", L["health_nodes_alive"] == n),
        ]
    R = r.get("resume")
    if R:
        out.append(
            (
                "cross-node resume: every acknowledged turn present",
                R["present_on_other_node"] == R["acknowledged_turns"] > 0,
            )
        )
    over = r.get("overhead")
    if over:
        out.append(
            (
                f"Redis adds <= {overhead_bar_ms:g} ms to TTFT p50",
                over["errors"] == 0
                and over["ttft_p50_diff_ms"] is not None
                and over["ttft_p50_diff_ms"] <= overhead_bar_ms,
            )
        )
    for name in ("nodes", "overhead_nodes"):
        for node in r.get(name, []):
            out.append(
                (
                    f"{node['name']}: exit 0, no ERROR in its log",
                    node["exit_code"] == 0 and not node["errors_logged"],
                )
            )
    return out


def write_cluster_report(report: Report, out_dir: str) -> Path:
    """`loadtest --nodes`: the checks' verdict into the report, the JSON file, then each check."""
    report["checks"] = [{"check": name, "passed": ok} for name, ok in cluster_checks(report)]
    report["passed"] = all(c["passed"] for c in report["checks"])
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / f"loadtest-cluster-{time.strftime('%Y-%m-%dT%H%M%S%z')}.json"
    path.write_text(json.dumps(report, indent=2))
    for c in report["checks"]:
        print(f"  [{'PASS' if c['passed'] else 'FAIL'}] {c['check']}")
    print(f"\nJSON: {path}")
    return path
