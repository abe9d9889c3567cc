"""The bench's report: the table's rows for each workload, and the table printed.

`bench.py` runs the workloads and fills the report; this module only reads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .cells import fmt
from .stats import ratio

Report = dict[str, Any]  # the JSON object a workload returns
Row = tuple[str, str, str]  # figure, value, bar


def rate(result: Report | None) -> str:
    """A row's tokens/s, and whether it generated exactly the asked tokens. "n/a" when it did not run."""
    if not result or result.get("tokens_per_s") is None:
        return "n/a"
    exact = result.get("exact_token_counts")
    counted = f"{result.get('generated_tokens', 0):,} tokens"
    return f"{result['tokens_per_s']:,.1f} ({counted}, {'exact' if exact else 'NOT exact'})"


def _burst_rows(e: Report, b: Report, precision: str) -> list[Row]:
    rows: list[Row] = []
    if "burst" in e:
        eb = e["burst"]["tokens_per_s"]
        rows.append(("burst tokens/s (engine)", rate(e["burst"]), ""))
        for name in ("naive", "static4", "cb"):
            rows.append(
                (f"burst tokens/s baseline {name} ({precision})", rate(b.get("burst", {}).get(name)), "")
            )
        rows.append(
            (
                f"burst ratio vs cb (generate_batch, {precision})",
                fmt(ratio(eb, b.get("burst", {}).get("cb", {}).get("tokens_per_s")), "x"),
                ">= 3x",
            )
        )
        rows.append(
            (
                f"burst ratio vs naive ({precision})",
                fmt(ratio(eb, b.get("burst", {}).get("naive", {}).get("tokens_per_s")), "x"),
                ">= 20x",
            )
        )
        rows.append(
            (
                "burst TTFT p50 / p95 ms",
                f"{fmt(e['burst']['ttft_p50_ms'])} / {fmt(e['burst']['ttft_p95_ms'])}",
                "p95 <= 2000",
            )
        )
        rows.append(
            (
                "event-loop lag p95 / max ms (burst)",
                f"{fmt(e['burst']['loop_lag_p95_ms'])} / {fmt(e['burst']['loop_lag_max_ms'])}",
                "",
            )
        )
    return rows


def _single_rows(e: Report, b: Report, precision: str) -> list[Row]:
    rows: list[Row] = []
    if "single" in e:
        es = e["single"]["tokens_per_s"]
        rows.append(("single tokens/s (engine)", rate(e["single"]), ""))
        rows.append(
            (f"single tokens/s baseline naive ({precision})", rate(b.get("single", {}).get("naive")), "")
        )
        rows.append(
            (
                f"single ratio vs naive ({precision})",
                fmt(ratio(es, b.get("single", {}).get("naive", {}).get("tokens_per_s")), "x"),
                ">= 2.5x",
            )
        )
    return rows


def _arrival_rows(e: Report) -> list[Row]:
    rows: list[Row] = []
    if "arrival" in e:
        rows.append(
            (
                "arrival TTFT p50 / p95 ms (32 streams decoding)",
                f"{fmt(e['arrival']['ttft_p50_ms'])} / {fmt(e['arrival']['ttft_p95_ms'])}",
                "p95 <= 250",
            )
        )
    return rows


def _multi_turn_rows(e: Report) -> list[Row]:
    rows: list[Row] = []
    if "multi-turn" in e:
        mt = e["multi-turn"]
        p50 = mt["ttft_p50_ms_by_turn"]
        rows.append(("multi-turn TTFT p50 ms by turn", " ".join(fmt(p50[t]) for t in sorted(p50)), ""))
        rows.append(
            (
                "multi-turn prefilled tokens by turn",
                " ".join(fmt(v) for v in mt["mean_prefilled_tokens_by_turn"].values()),
                "",
            )
        )
        rows.append(("multi-turn tokens/s", fmt(mt["tokens_per_s"]), ""))
    return rows


def _sentiment_rows(e: Report, b: Report) -> list[Row]:
    rows: list[Row] = []
    if "sentiment" in e:
        s = e["sentiment"]
        rows.append(("sentiment fresh classifications/s", fmt(s["fresh_per_s"]), ""))
        if "prefilled_tokens_per_text" in s:
            rows.append(
                (
                    "sentiment tokens per text: prompt / prefix-cached / computed",
                    f"{fmt(s['prompt_tokens_per_text'])} / {fmt(s['prefix_cached_tokens_per_text'])} / "
                    f"{fmt(s['prefilled_tokens_per_text'])}",
                    "",
                )
            )
            rows.append(
                (
                    "sentiment fresh steps / mean step ms",
                    f"{s['fresh_steps']} / {fmt(s['fresh_step_ms'])}",
                    "",
                )
            )
        rows.append(("sentiment cached classifications/s", fmt(s["cached_per_s"]), ">= 20000"))
        plain = s.get("label_scoring")
        if plain:
            rows.append(
                (
                    "sentiment label scoring (no head) fresh / cached per s, same run",
                    f"{fmt(plain['fresh_per_s'])} / {fmt(plain['cached_per_s'])}",
                    "",
                )
            )
        base = b.get("sentiment", {}).get("per_s")
        rows.append(("sentiment baseline (generative, HF batches of 4)/s", fmt(base), ""))
        rows.append(("sentiment fresh ratio vs baseline", fmt(ratio(s["fresh_per_s"], base), "x"), ">= 10x"))
        if "agreement_with_float32" in s:
            rows.append(("sentiment labels equal to float32's", f"{s['agreement_with_float32']:.1%}", ""))
        at = s.get("auto_task")
        if at:
            rows.append(
                (
                    "chat TTFT p50 ms: alone / with sentiment auto-task / auto-task forced into its step",
                    f"{fmt(at['ttft_alone_p50_ms'])} / {fmt(at['ttft_auto_task_p50_ms'])} / "
                    f"{fmt(at['ttft_same_step_p50_ms'])}",
                    "",
                )
            )
            rows.append(
                (
                    f"auto-task added to chat TTFT in steps of {fmt(at['step_ms'])} ms: as the hub runs it / "
                    "forced same step",
                    f"{at['added_steps_auto_task']:.2f} / {at['added_steps_same_step']:.2f}",
                    "<= 1 step",
                )
            )
    return rows


def _kv_agreement_rows(e: Report) -> list[Row]:
    rows: list[Row] = []
    if "agreement_with_float32_kv" in e:
        a = e["agreement_with_float32_kv"]
        bits = e.get("kernels", {}).get("activation_bits")
        width = f", {bits}-bit activations" if bits else ""
        rows.append(
            (
                f"greedy agreement with float32 KV ({e['kv']['dtype']} KV{width}, burst prompts): "
                "identical outputs / tokens before divergence",
                f"{a['identical_outputs']:.0%} / {a['tokens_before_divergence']:.0%}",
                ">= 90% identical",
            )
        )
    return rows


def _sentiment_kv_agreement_rows(e: Report) -> list[Row]:
    rows: list[Row] = []
    if "agreement_with_float32_kv" in e.get("sentiment", {}):
        rows.append(
            (
                f"sentiment labels equal to float32 KV's ({e['kv']['dtype']} KV)",
                f"{e['sentiment']['agreement_with_float32_kv']:.1%}",
                ">= 99%",
            )
        )
    return rows


def _agreement_rows(e: Report) -> list[Row]:
    rows: list[Row] = []
    if "agreement_with_float32" in e:
        a = e["agreement_with_float32"]
        rows.append(
            (
                "greedy agreement with float32 (burst prompts): identical outputs / tokens before divergence",
                f"{a['identical_outputs']:.0%} / {a['tokens_before_divergence']:.0%}",
                "",
            )
        )
    return rows


def _e2e_rows(e: Report) -> list[Row]:
    rows: list[Row] = []
    if "e2e" in e and "e2e-engine-only" in e:
        ee, eo = e["e2e"], e["e2e-engine-only"]
        rows.append(
            (
                "e2e WebSocket tokens/s (32 sessions x 5 turns) / engine-only",
                f"{fmt(ee['tokens_per_s'])} / {fmt(eo['tokens_per_s'])}",
                "",
            )
        )
        rows.append(
            ("e2e ratio to engine-only", fmt(ratio(ee["tokens_per_s"], eo["tokens_per_s"]), "x"), ">= 0.85x")
        )
        rows.append(("e2e TTFT p50 turn 5 / turn 1", fmt(ee.get("turn_ratio_p50"), "x"), "<= 1.5x"))
        rows.append(("e2e errors", str(ee.get("errors") or 0), "0"))
    return rows


def _structured_rows(e: Report) -> list[Row]:
    rows: list[Row] = []
    if "structured" in e:
        st = e["structured"]
        rows.append(
            (
                f"structured: invalid of finished JSON Schema generations ({st['generations']}, "
                "greedy + t=0.7) / cut by the token limit",
                f"{st['invalid_of_finished']} of {st['finished']} / {st['cut_by_token_limit']}",
                "0 invalid",
            )
        )
        rows.append(
            (
                "structured: mask us per token (mean) / share of a batch-1 decode step",
                f"{fmt(st['mask_us_per_token_mean'])} / {st['mask_share_of_batch1_step']:.1%}",
                "<= 10%",
            )
        )
        rows.append(
            (
                "structured: batch-1 decode step ms, free / with a schema",
                f"{fmt(st['batch1_step_free_ms'])} / {fmt(st['batch1_step_constrained_ms'])}",
                "",
            )
        )
    return rows


def _peak_rss_rows(e: Report) -> list[Row]:
    rows: list[Row] = []
    if "peak_rss_mb" in e:
        rows.append(("peak RSS MB (load + engine workloads)", fmt(e["peak_rss_mb"]), "<= 1536"))
    return rows


def summarize(report: Report) -> list[Row]:
    """(figure, value, bar) rows for the printed table."""
    e, b = report["engine"], report.get("baselines", {})
    precision = report.get("baseline_dtype") or "n/a"  # what every ratio to a baseline is taken against
    return [
        *_burst_rows(e, b, precision),
        *_single_rows(e, b, precision),
        *_arrival_rows(e),
        *_multi_turn_rows(e),
        *_sentiment_rows(e, b),
        *_kv_agreement_rows(e),
        *_sentiment_kv_agreement_rows(e),
        *_agreement_rows(e),
        *_e2e_rows(e),
        *_structured_rows(e),
        *_peak_rss_rows(e),
    ]


def remote_rows(r: Report) -> list[Row]:
    """The hub in front of llama-server (rtbench/remote_bench.py)."""
    dc, di, h, mt = (
        r["burst_direct_chat"],
        r["burst_direct_token_ids"],
        r["burst_through_hub"],
        r["multi_turn"],
    )

    per_turn = mt["per_turn"]
    med = r["burst_tokens_per_s_median"]
    return [
        (
            "[remote] burst tokens/s, median of runs: llama-server chat / token ids / through the hub",
            " / ".join(fmt(med.get(k)) for k in ("chat", "ids", "hub")),
            "",
        ),
        (
            "[remote] burst token counts exact (chat / token ids / hub)",
            f"{dc['exact_token_counts']} / {di['exact_token_counts']} / {h['exact_token_counts']}",
            "",
        ),
        (
            "[remote] hub tokens/s ratio (vs the faster direct run)",
            fmt(r["hub_tokens_per_s_ratio"], "x"),
            ">= 0.9x",
        ),
        (
            "[remote] burst TTFT p50 ms: chat / token ids / hub",
            f"{fmt(dc['ttft_p50_ms'])} / {fmt(di['ttft_p50_ms'])} / {fmt(h['ttft_p50_ms'])}",
            "",
        ),
        ("[remote] hub added TTFT p50 ms", fmt(r["hub_added_ttft_p50_ms"]), "<= 30"),
        (
            "[remote] multi-turn TTFT p50 ms by turn (%d sessions)" % mt["sessions"],
            " ".join(fmt(per_turn[t]["ttft_p50_ms"]) for t in sorted(per_turn)),
            "",
        ),
        (
            "[remote] multi-turn cached prompt tokens by turn",
            " ".join(fmt(per_turn[t]["cached_tokens_mean"]) for t in sorted(per_turn)),
            "",
        ),
        (
            "[remote] multi-turn prefilled prompt tokens by turn",
            " ".join(
                fmt(per_turn[t]["prompt_tokens_mean"] - per_turn[t]["cached_tokens_mean"])
                for t in sorted(per_turn)
            ),
            "",
        ),
        (
            "[remote] multi-turn TTFT p50 turn 5 / turn 1",
            fmt(r.get("multi_turn_turn5_ratio"), "x"),
            "<= 1.5x",
        ),
        ("[remote] multi-turn errors", str(mt.get("errors") or 0), "0"),
    ]


def table(report: Report) -> list[Row]:
    """Every row of the run. Each engine dtype's come first, then the servers, formats, remote and kld
    ones."""
    rows: list[Row] = []
    for label, result in report["engine"].items():
        rows += [
            (f"[{label}] {name}", value, bar)
            for name, value, bar in summarize(
                {
                    "engine": result,
                    "baselines": report["baselines"],
                    "baseline_dtype": report.get("baseline_dtype"),
                }
            )
        ]
    if "servers" in report:
        from .servers_report import table_rows

        rows += table_rows(report["servers"])
    if "formats" in report:
        from .formats_report import table_rows as formats_rows

        rows += formats_rows(report["formats"])
    if "remote" in report:
        rows += remote_rows(report["remote"])
    if "kld" in report:
        from .kld_report import table_rows as kld_rows

        rows += kld_rows(report["kld"])
    if "speculation" in report:
        from .speculation_bench import table_rows as speculation_rows

        rows += speculation_rows(report["speculation"])
    return rows


def print_table(report: Report, path: Path, chart: Path | None) -> None:
    """The run's heading, its table, and where the JSON and the chart went."""
    width = max(len(r[0]) for r in report["table"])
    print(
        f"\nrtserver bench — {report['date']} commit {report['commit']} "
        f"model {report.get('model', 'embedded')} on {report['cpu']}, threads {report['threads']}; "
        f"baselines in {report.get('baseline_dtype', '-')}"
    )
    for name, value, bar in report["table"]:
        print(f"  {name:<{width}}  {value:>24}  {bar}")
    print(f"\nwritten to {path}" + (f" (chart: {chart})" if chart else ""))
