"""`rtserver eval`: sentiment accuracy of several methods on the shipped labeled data.

Every configuration runs through the real engine (batched, as the server runs it) on
`data/sentiment/{en,zh}_<split>.jsonl` (see data/sentiment/SOURCES.md). Reported per language:
accuracy (an invalid answer counts as wrong), invalid-output rate (an answer that is not one of the
labels) and examples/s (all texts submitted together, wall clock). Configurations:

- `shipped (score)`: the `sentiment` task as configured (plugins/sentiment.py + [task.sentiment]);
- `generative`: the same task with `mode = "generate"` (the write-ups' method: strict-format
  instruction, greedy, 3 new tokens, strict parser);
- other prompt wordings in scoring mode, declared below as plain `Task` objects.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as _dt
import json
import time
from pathlib import Path
from typing import Any

from ..config import EngineSettings, Settings
from ..engine.core import Engine
from ..tasks import Choices, Task, Variant, has_cjk
from ..tasks.registry import load_registry
from ..tasks.run import PromptTask
from .stats import accuracy, fraction, per_second

DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "sentiment"
LANGS = ("en", "zh")
CONCURRENCY = 128  # texts in flight at once (below the engine's waiting-queue bound)


def load_split(lang: str, split: str, data_dir: Path = DATA_DIR) -> list[dict]:
    path = data_dir / f"{lang}_{split}.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _wording(
    name: str,
    en_prompt: str,
    en_words: tuple[str, str],
    zh_prompt: str,
    zh_words: tuple[str, str],
    chat_template: bool = False,
    calibration: list[str] | None = None,
) -> Task:
    cal = list(calibration or [])
    return Task(
        name=name,
        description=f"sentiment wording {name}",
        prompt=en_prompt,
        chat_template=chat_template,
        max_input_tokens=256,
        truncate="head",
        choices=Choices({"positive": en_words[0], "negative": en_words[1]}, calibration=cal),
        variants=[
            Variant(
                when=has_cjk,
                prompt=zh_prompt,
                choices=Choices({"positive": zh_words[0], "negative": zh_words[1]}, calibration=cal),
            )
        ],
    )


def other_wordings() -> list[Task]:
    """Alternative prompts, scoring mode (the comparison the issue asks for)."""
    return [
        # An instruction through the chat template; the answer word starts the assistant's turn.
        _wording(
            "chat-instruction",
            "Is the sentiment of this message positive or negative?\nMessage: {text}",
            ("Positive", "Negative"),
            "这条评论的情感是正面还是负面？\n评论：{text}",
            ("正面", "负面"),
            chat_template=True,
        ),
        # A review-style completion with yes/no verbalizers, calibrated.
        _wording(
            "review-yes-no",
            "Review: {text}\nDid the reviewer like it? Answer:",
            (" yes", " no"),
            "评论：{text}\n买家满意吗？回答：",
            ("是", "否"),
            calibration=["N/A"],
        ),
        # A completion with good/bad verbalizers, uncalibrated.
        _wording(
            "completion-good-bad",
            "Text: {text}\nThe text is",
            (" good", " bad"),
            "文本：{text}\n这段文本是",
            ("好", "坏"),
            calibration=[],
        ),
    ]


def _registry_task(settings: Settings, tokenizer: Any, overrides: dict) -> PromptTask:
    table = {**settings.task.get("sentiment", {}), **overrides, "cache_size": 0}
    s = dataclasses.replace(
        settings,
        task={"sentiment": table},
        tasks=dataclasses.replace(settings.tasks, enabled=["sentiment"], disabled=[], auto_tasks=[]),
    )
    registry, errors = load_registry(s, tokenizer)
    if "sentiment" not in registry.tasks:
        raise RuntimeError("sentiment task did not load: " + "; ".join(map(str, errors)))
    task = registry.get("sentiment")
    assert isinstance(task, PromptTask)
    return task


def configurations(settings: Settings, tokenizer: Any) -> list[tuple[str, PromptTask, dict]]:
    """(name, prepared task, shown label -> gold label) for every configuration."""
    names = settings.task.get("sentiment", {}).get("label_names", {}) or {}
    back = {shown: key for key, shown in names.items()}
    back.update({k: k for k in ("positive", "negative", "neutral") if k not in names})
    out = [
        ("shipped (score)", _registry_task(settings, tokenizer, {"mode": "score"}), back),
        ("generative (write-ups)", _registry_task(settings, tokenizer, {"mode": "generate"}), back),
    ]
    ident = {"positive": "positive", "negative": "negative"}
    out += [(f"wording: {t.name}", PromptTask(t, tokenizer), ident) for t in other_wordings()]
    return out


async def _run_one(engine: Engine, task: PromptTask, examples: list[dict], back: dict) -> dict:
    sem = asyncio.Semaphore(CONCURRENCY)
    choices = task.task.choices
    labels = set(choices.labels) if choices is not None else None

    async def one(ex: dict) -> tuple[bool, str | None]:
        """(valid, the gold label it stands for: None when invalid or not one of the gold labels)."""
        async with sem:
            out = await task.run(engine, {"text": ex["text"]})
        label = out.output.get("label")
        if labels is not None:
            valid = label in labels
        else:
            valid = bool(out.output.get("valid", label is not None))
        return valid, back.get(label) if valid else None

    started = time.perf_counter()
    results = await asyncio.gather(*(one(ex) for ex in examples))
    wall = time.perf_counter() - started
    n = len(examples)
    return {
        "n": n,
        "accuracy": accuracy([gold for _, gold in results], [ex["label"] for ex in examples]),
        "invalid_rate": fraction(not valid for valid, _ in results),
        "examples_per_s": per_second(n, wall),
    }


async def evaluate(
    loaded: Any,
    settings: Settings,
    split: str,
    data_dir: Path = DATA_DIR,
    configs: list[tuple[str, PromptTask, dict]] | None = None,
    limit: int | None = None,
) -> list[dict]:
    data = {lang: load_split(lang, split, data_dir)[:limit] for lang in LANGS}
    configs = configs if configs is not None else configurations(settings, loaded.tokenizer)
    engine = Engine(loaded, EngineSettings())
    engine.start()
    rows = []
    try:
        for name, task, back in configs:
            for lang in LANGS:
                row = {"config": name, "lang": lang, **await _run_one(engine, task, data[lang], back)}
                print(
                    f"  {name:32s} {lang}: acc {_fmt(row['accuracy'], '.3f')}  "
                    f"invalid {_fmt(row['invalid_rate'], '.3f')}  {_fmt(row['examples_per_s'], '.1f')} ex/s",
                    flush=True,
                )
                rows.append(row)
    finally:
        await engine.stop()
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_table(rows: list[dict]) -> str:
    by = {}
    for r in rows:
        by.setdefault(r["config"], {})[r["lang"]] = r
    head = (
        "| configuration | EN accuracy | EN invalid | EN ex/s | ZH accuracy | ZH invalid | ZH ex/s |\n"
        "|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for name, langs in by.items():
        cells = []
        for lang in LANGS:
            r = langs.get(lang)
            cells += (
                [_fmt(r["accuracy"], ".3f"), _fmt(r["invalid_rate"], ".1%"), _fmt(r["examples_per_s"], ".1f")]
                if r
                else ["-", "-", "-"]
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_eval(loaded: Any, settings: Settings, split: str, out_dir: str | Path) -> dict:
    counts = {lang: len(load_split(lang, split)) for lang in LANGS}
    print(
        f"sentiment eval on the {split} split ({', '.join(f'{k}: {v}' for k, v in counts.items())} texts), "
        f"model {getattr(loaded, 'name', '?')} {getattr(loaded, 'dtype', '')}",
        flush=True,
    )
    rows = asyncio.run(evaluate(loaded, settings, split))
    table = format_table(rows)
    print(table)
    report = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "split": split,
        "model": str(getattr(loaded, "name", "")),
        "dtype": str(getattr(loaded, "dtype", "")),
        "counts": counts,
        "rows": rows,
        "table": table,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"eval-{_dt.date.today().isoformat()}.json"
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False), encoding="utf-8")
    print(f"written {path}")
    return report
