"""The chart `rtserver bench` writes beside its JSON. It has one panel per figure and one horizontal bar per
system. The figures are burst and single tokens/s, and burst and arrival TTFT p95. Each prompt set's panel
sits beside the other's. Then comes the formats matrix. It shows each model file's bars per server, and the
rtserver / llama-server ratios. It is a plain hand-written SVG. No plotting library is used: a few
rectangles and labels, readable in any browser and on GitHub.

`chart_rows(report)` picks the figures out of a bench report. `render_svg(rows, title)` draws them.
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

# (panel title, workload, key in that workload's result, scale to the unit shown, unit, higher is better);
# an empty workload: the key is in the system's result itself
PANELS = [
    ("burst: tokens/s (32 x 64 tokens), shared system prompt", "burst", "tokens_per_s", 1.0, "", True),
    ("burst-unique: tokens/s, unique prefixes", "burst-unique", "tokens_per_s", 1.0, "", True),
    ("single: tokens/s (1 x 128 tokens)", "single", "tokens_per_s", 1.0, "", True),
    ("burst: TTFT p95, shared system prompt", "burst", "ttft_p95_ms", 0.001, " s", False),
    ("burst-unique: TTFT p95, unique prefixes", "burst-unique", "ttft_p95_ms", 0.001, " s", False),
    ("arrival: TTFT p95 (new request beside 32 streams)", "arrival", "ttft_p95_ms", 0.001, " s", False),
    ("arrival-unique: TTFT p95, unique prefixes", "arrival-unique", "ttft_p95_ms", 0.001, " s", False),
]
FORMAT_PANELS = [
    ("formats: burst-unique tokens/s", "burst-unique", "tokens_per_s", 1.0, "", True),
    ("formats: single tokens/s", "single", "tokens_per_s", 1.0, "", True),
    ("formats: burst-unique TTFT p95", "burst-unique", "ttft_p95_ms", 0.001, " s", False),
    ("formats: arrival-unique TTFT p95", "arrival-unique", "ttft_p95_ms", 0.001, " s", False),
    ("formats: peak RSS", "", "peak_rss_mb", 1.0, " MB", False),
]
# (panel title, key in a formats row's ratios, higher is better)
RATIO_PANELS = [
    ("formats: rtserver / llama-server, burst tokens/s (bar 1.5x)", "burst_tokens_per_s", True),
    ("formats: rtserver / llama-server, single tokens/s (bar 1.0x)", "single_tokens_per_s", True),
    ("formats: rtserver / llama-server, burst TTFT p95 (bar 0.5x)", "burst_ttft_p95", False),
]
ALL_PANELS = (
    PANELS + FORMAT_PANELS + [(title, "", key, 1.0, "x", higher) for title, key, higher in RATIO_PANELS]
)
COLOURS = {
    "llama-server": "#d95f02",
    "rtserver": "#1b9e77",
    "engine": "#66a61e",
    "transformers": "#7570b3",
    "ratio": "#e7298a",
}

Row = tuple[str, str, str, float]  # (system, family for the colour, panel title, value in the shown unit)


def chart_rows(report: dict[str, Any]) -> list[Row]:
    """Every figure of the report that has a panel. That is the servers comparison (llama-server and each
    rtserver dtype), and the in-process engine per dtype. It also holds the transformers baselines and the
    formats matrix. A server that refused a file has no bar there.
    """
    rows: list[Row] = []

    def add(system: str, family: str, results: dict[str, Any], panels: list[Any] = PANELS) -> None:
        for title, workload, key, scale, _, _ in panels:
            value = (results.get(workload) or {}).get(key) if workload else results.get(key)
            if isinstance(value, int | float):
                rows.append((system, family, title, value * scale))

    for name, s in (report.get("servers") or {}).get("systems", {}).items():
        if name == "llama-server":
            add("llama.cpp llama-server (Q4_1)", "llama-server", s)
        else:
            runs_as = f" = {s['runs_as']}" if s.get("runs_as") not in (None, s.get("dtype")) else ""
            add(f"rtserver serve {s.get('dtype', '')}{runs_as}", "rtserver", s)
    for label, result in (report.get("engine") or {}).items():
        add(f"engine {label} (in-process)", "engine", result)
    base = report.get("baselines") or {}
    precision = report.get("baseline_dtype", "")
    names = {"cb": "generate_batch", "static4": "generate, batches of 4", "naive": "generate one by one"}
    for key, name in names.items():
        figures = {w: base[w][key] for w in ("burst", "single") if key in (base.get(w) or {})}
        add(f"transformers {name} {precision}".strip(), "transformers", figures)
    for model, r in (report.get("formats") or {}).get("rows", {}).items():
        for system, figures in (r.get("systems") or {}).items():
            add(f"{model}: {system}", system, figures, FORMAT_PANELS)
        for title, key, _ in RATIO_PANELS:
            value = (r.get("ratios") or {}).get(key)
            if isinstance(value, int | float):
                rows.append((model, "ratio", title, value))
    return rows


def render_svg(rows: list[Row], title: str, width: int = 760) -> str:
    """The panels stacked. Each has its bars scaled to its largest value, with the value printed."""
    label_w, value_w, bar_h, gap, head = 290, 70, 18, 4, 26
    plot_w = width - label_w - value_w - 20
    parts: list[str] = []
    y = 34
    for panel, _, _, _, unit, higher in ALL_PANELS:
        bars = [r for r in rows if r[2] == panel]
        if not bars:
            continue
        hint = "higher is better" if higher else "lower is better"
        parts.append(
            f'<text x="10" y="{y + 16}" font-weight="bold">{escape(panel)}</text>'
            f'<text x="{width - 10}" y="{y + 16}" text-anchor="end" fill="#666">{hint}</text>'
        )
        y += head
        top = max(r[3] for r in bars) or 1.0
        for system, family, _, value in bars:
            w = max(1.0, plot_w * value / top)
            colour = COLOURS.get(family, "#999")
            shown = f"{value:,.{2 if unit in (' s', 'x') else 1}f}{unit}"  # seconds and ratios: 2 decimals
            parts.append(
                f'<text x="{label_w - 6}" y="{y + bar_h - 5}" text-anchor="end">{escape(system)}</text>'
                f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{colour}"/>'
                f'<text x="{label_w + w + 4:.1f}" y="{y + bar_h - 5}">{shown}</text>'
            )
            y += bar_h + gap
        y += 14
    height = y + 10
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">'
        f'<rect width="{width}" height="{height}" fill="white"/>'
        f'<text x="10" y="20" font-size="14" font-weight="bold">{escape(title)}</text>'
        + "".join(parts)
        + "</svg>\n"
    )


def write_chart(report: dict[str, Any], path: Path) -> Path | None:
    """The report's chart at `path`, an .svg beside the JSON. None when it has no charted figure."""
    rows = chart_rows(report)
    if not rows:
        return None
    title = (
        f"rtserver bench {report.get('date', '')} commit {report.get('commit', '?')}, "
        f"{report.get('threads', '?')} threads, {report.get('cpu', '')}"
    )
    path.write_text(render_svg(rows, title))
    return path
