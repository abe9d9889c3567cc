"""The kld workload's rows in the bench's table (`kld_bench.py` runs it)."""

from __future__ import annotations

from typing import Any

from .kld_bench import PATHS

FIGURES = "mean KLD / p99 KLD / top-1 agreement / tokens scored"
BAR = "mean KLD and top-1 disagreement <= llama.cpp's"


def figures_cell(s: dict[str, Any] | None) -> str:
    """One system's figures against the reference, or its error. KLDs to three significant digits: they
    run from 1e-7 (float rounding) to 1e-2 (4-bit weights)."""
    if not s:
        return "n/a"
    if "error" in s:
        return f"error: {s['error']}"

    def number(key: str, spec: str) -> str:
        v = s.get(key)
        return "n/a" if v is None else format(v, spec)

    return (
        f"{number('mean_kld', '.3g')} / {number('p99_kld', '.3g')} / {number('top1_agreement', '.2%')} / "
        f"{number('tokens_scored', ',')}"
    )


def held_cell(held: bool | None) -> str:
    return "n/a" if held is None else "held" if held else "NOT held"


def table_rows(kld: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(figure, value, bar) rows per model file: rtserver's prefill and decode, llama.cpp, the reference's
    own storage cost, and the bar per path.
    """
    rows: list[tuple[str, str, str]] = []
    if kld.get("llama_error"):
        rows.append(("[kld] llama-perplexity", f"error: {kld['llama_error']}", ""))
    for name, r in kld.get("rows", {}).items():
        if "error" in r and "rtserver" not in r:
            rows.append((f"[kld] {name}", f"error: {r['error']}", ""))
            continue
        ours = r["rtserver"]
        bits = ours.get("activation_bits")
        big = f"{bits}-bit activations" if bits else None
        how = {"prefill": big, "decode": ours.get("decode_activations") or big}
        rows.append(
            (
                f"[kld] {name}: windows x n_ctx; token ids of the text",
                f"{r['windows']} x {r['n_ctx']}; {r['text']['token_ids']:,}",
                "reference: float32 path",
            )
        )
        for path in PATHS:
            rows.append(
                (
                    f"[kld] {name} rtserver {path} ({ours['dtype']}"
                    + (f", {how[path]}" if how[path] else "")
                    + f"): {FIGURES}",
                    figures_cell(ours.get(path)),
                    "",
                )
            )
        rows.append(
            (f"[kld] {name} llama.cpp (llama-perplexity): {FIGURES}", figures_cell(r.get("llama.cpp")), "")
        )
        floor = ours.get("reference_against_its_stored_rows") or {}
        rows.append(
            (
                f"[kld] {name} float32 reference against its stored rows: mean KLD",
                figures_cell(floor).split(" / ")[0],
                "the 16-bit rows' own cost",
            )
        )
        held = r.get("bar") or {}
        rows.append(
            (
                f"[kld] {name} bar: prefill; decode",
                f"{held_cell(held.get('prefill'))}; {held_cell(held.get('decode'))}",
                BAR,
            )
        )
    return rows
