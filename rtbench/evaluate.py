"""`rtserver eval`: accuracy of the classification tasks by method and language on the shipped data.

Every configuration runs through the real engine, prepared as the server prepares it. The data is
`data/<task>/{en,zh}_<split>.jsonl`. It reports accuracy, the invalid-label rate and classifications/s. The
sentiment methods are the shipped task, and label scoring alone. They also include the write-ups' generative
method and other prompt wordings. Intent compares its head, label scoring and the label names.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as _dt
import json
import time
from pathlib import Path
from typing import Any

from rtserver.config import EngineSettings, Settings
from rtserver.engine.backend import Tokenizer
from rtserver.engine.core import Engine
from rtserver.engine.model import LoadedModel
from rtserver.tasks import Choices, Task, Variant, has_cjk
from rtserver.tasks.registry import load_registry
from rtserver.tasks.run import PromptTask

from .eval_report import format_table, progress_line, write_report
from .stats import accuracy, fraction, per_second

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "sentiment"
DATA_DIRS = {"sentiment": DATA_DIR, "intent": DATA_DIR.parent / "intent"}
TASKS = ("sentiment", "intent")
LANGS = ("en", "zh")
CONCURRENCY = 128  # texts in flight at once (below the engine's waiting-queue bound)


def load_split(lang: str, split: str, data_dir: Path = DATA_DIR) -> list[dict[str, Any]]:
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


def previous_intent() -> Task:
    """The intent task as shipped before its verbalizers were chosen on dev. It is the comparison row."""
    names = ("billing", "technical", "shipping", "account", "other")
    return Task(
        name="intent-before",
        description="intent, the label names scored",
        prompt=f"Customer support categories: {', '.join(names)}.\nMessage: {{text}}\nCategory:",
        chat_template=False,
        max_input_tokens=256,
        truncate="head",
        choices=Choices({n: " " + n for n in names}, calibration=["N/A"]),
    )


def _registry_task(
    settings: Settings, tokenizer: Tokenizer, name: str, overrides: dict[str, Any]
) -> PromptTask:
    table = {**settings.task.get(name, {}), **overrides, "cache_size": 0}
    s = dataclasses.replace(
        settings,
        task={name: table},
        tasks=dataclasses.replace(settings.tasks, enabled=[name], disabled=[], auto_tasks=[]),
    )
    registry, errors = load_registry(s, tokenizer)
    if name not in registry.tasks:
        raise RuntimeError(f"{name} task did not load: " + "; ".join(map(str, errors)))
    task = registry.get(name)
    assert isinstance(task, PromptTask)
    return task


@dataclasses.dataclass
class Config:
    task: str  # which labeled data: data/<task>/
    method: str
    prompt_task: PromptTask
    back: dict[str, Any]  # shown label -> gold label


def configurations(settings: Settings, tokenizer: Tokenizer, tasks: tuple[str, ...] = TASKS) -> list[Config]:
    """Every configuration of the wanted tasks, the shipped one of each first."""
    out: list[Config] = []
    if "sentiment" in tasks:
        names = settings.task.get("sentiment", {}).get("label_names", {}) or {}
        back = {shown: key for key, shown in names.items()}
        back.update({k: k for k in ("positive", "negative", "neutral") if k not in names})
        ident = {"positive": "positive", "negative": "negative"}
        out += [
            Config(
                "sentiment",
                "shipped (score + learned head)",
                _registry_task(settings, tokenizer, "sentiment", {}),
                back,
            ),
            Config(
                "sentiment",
                "label scoring (no head)",
                _registry_task(settings, tokenizer, "sentiment", {"head": False}),
                back,
            ),
            Config(
                "sentiment",
                "generative (write-ups)",
                _registry_task(settings, tokenizer, "sentiment", {"mode": "generate"}),
                back,
            ),
        ]
        out += [
            Config("sentiment", f"wording: {t.name}", PromptTask(t, tokenizer), ident)
            for t in other_wordings()
        ]
    if "intent" in tasks:
        task = _registry_task(settings, tokenizer, "intent", {})
        choices = task.task.choices
        ident = {k: k for k in (choices.labels if choices is not None else {})}
        out.append(Config("intent", "shipped (score + learned head)", task, ident))
        out.append(
            Config(
                "intent",
                "label scoring (no head)",
                _registry_task(settings, tokenizer, "intent", {"head": False}),
                ident,
            )
        )
        out.append(
            Config("intent", "before: label names scored", PromptTask(previous_intent(), tokenizer), ident)
        )
    return out


async def _run_one(
    engine: Engine, task: PromptTask, examples: list[dict[str, Any]], back: dict[str, Any]
) -> dict[str, Any]:
    sem = asyncio.Semaphore(CONCURRENCY)
    choices = task.task.choices
    labels = set(choices.labels) if choices is not None else None

    async def one(ex: dict[str, Any]) -> tuple[bool, str | None]:
        """(valid, the gold label it stands for). The label is None when invalid or not one of the gold
        labels.
        """
        async with sem:
            out = await task.run(engine, {"text": ex["text"]})
        found = out.output.get("label")
        label = found if isinstance(found, str) else None
        if labels is not None:
            valid = label in labels
        else:
            valid = bool(out.output.get("valid", label is not None))
        return valid, back.get(label) if valid and label is not None else None

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
    loaded: LoadedModel,
    settings: Settings,
    split: str,
    tasks: tuple[str, ...] = TASKS,
    configs: list[Config] | None = None,
    limit: int | None = None,
) -> list[dict[str, Any]]:
    data = {
        (task, lang): load_split(lang, split, DATA_DIRS[task])[:limit] for task in tasks for lang in LANGS
    }
    configs = configs if configs is not None else configurations(settings, loaded.tokenizer, tasks)
    engine = Engine(loaded, EngineSettings())
    engine.start()
    cache_dir = Path(settings.model.cache_dir).expanduser() / "heads"
    rows = []
    try:
        for cfg in configs:
            # As the server does at start-up: a task with a learned head fits it (features cached).
            started = time.perf_counter()
            await cfg.prompt_task.prepare(engine, cache_dir, "local")
            if cfg.prompt_task.heads:
                print(
                    f"  {cfg.task}/{cfg.method}: head ready in {time.perf_counter() - started:.1f} s",
                    flush=True,
                )
            for lang in LANGS:
                result = await _run_one(engine, cfg.prompt_task, data[(cfg.task, lang)], cfg.back)
                row = {"task": cfg.task, "config": cfg.method, "lang": lang, **result}
                print(progress_line(row), flush=True)
                rows.append(row)
    finally:
        await engine.stop()
    return rows


def run_eval(
    loaded: LoadedModel, settings: Settings, split: str, out_dir: str | Path, tasks: tuple[str, ...] = TASKS
) -> dict[str, Any]:
    counts = {f"{t}/{lang}": len(load_split(lang, split, DATA_DIRS[t])) for t in tasks for lang in LANGS}
    print(
        f"eval on the {split} split ({', '.join(f'{k}: {v}' for k, v in counts.items())} texts), "
        f"model {getattr(loaded, 'name', '?')} {getattr(loaded, 'dtype', '')}",
        flush=True,
    )
    rows = asyncio.run(evaluate(loaded, settings, split, tasks))
    table = format_table(rows, LANGS)
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
    write_report(report, out_dir)
    return report
