"""`rtserver eval`'s report: the progress line per run, the accuracy table and the JSON file.

`evaluate.py` runs the tasks and fills the rows; this module only reads them.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_table(rows: list[dict[str, Any]], languages: tuple[str, ...]) -> str:
    """The markdown table. It has a row per task and method, each language's figures side by side."""
    by: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        by.setdefault((r.get("task", "sentiment"), r["config"]), {})[r["lang"]] = r
    head = (
        "| task | method | EN accuracy | EN invalid | EN ex/s | ZH accuracy | ZH invalid | ZH ex/s |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for (task, name), langs in by.items():
        cells = []
        for lang in languages:
            got = langs.get(lang)
            cells += (
                [
                    _fmt(got["accuracy"], ".3f"),
                    _fmt(got["invalid_rate"], ".1%"),
                    _fmt(got["examples_per_s"], ".1f"),
                ]
                if got
                else ["-", "-", "-"]
            )
        lines.append(f"| {task} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def progress_line(row: dict[str, Any]) -> str:
    """One task, method and language's figures, as they come."""
    return (
        f"  {row['task']:9s} {row['config']:34s} {row['lang']}: acc {_fmt(row['accuracy'], '.3f')}  "
        f"invalid {_fmt(row['invalid_rate'], '.3f')}  {_fmt(row['examples_per_s'], '.1f')} ex/s"
    )


def write_report(report: dict[str, Any], out_dir: str | Path) -> Path:
    """The JSON file of the day's eval in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"eval-{_dt.date.today().isoformat()}.json"
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False), encoding="utf-8")
    print(f"written {path}")
    return path
