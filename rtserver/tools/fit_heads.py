"""`rtserver fit-heads`: fit the learned heads of the tasks that name a fitted-heads file
(`LearnedHead.fitted`) on the configured model and write them there. A plugin ships that file so that a
server with the same model, prompt and examples loads its heads in milliseconds instead of computing the
examples' features at start-up (minutes); rerun this after editing a prompt or an examples file."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ..config import EngineSettings, Settings
from ..engine.core import Engine
from ..tasks.head import save_fitted
from ..tasks.registry import load_registry
from ..tasks.run import PromptTask


async def fit_heads(loaded: Any, settings: Settings, names: list[str] | None = None) -> list[Path]:
    """Prepare every (or every named) task with a fitted-heads file and write its heads; the files written."""
    registry, errors = load_registry(settings, loaded.tokenizer)
    for error in errors:
        print(f"  skipped: {error}", flush=True)
    tasks = {
        name: task
        for name, task in registry.tasks.items()
        if isinstance(task, PromptTask)
        and task.task.head is not None
        and task.task.head.fitted is not None
        and (not names or name in names)
    }
    if names and set(names) - set(tasks):
        missing = ", ".join(sorted(set(names) - set(tasks)))
        raise SystemExit(f"rtserver fit-heads: no loaded task with a fitted-heads file named {missing}")
    engine = Engine(loaded, EngineSettings())
    engine.start()
    written: list[Path] = []
    try:
        for name, task in tasks.items():
            spec = task.task.head
            assert spec is not None and spec.fitted is not None
            await task.prepare(engine, Path(settings.model.cache_dir).expanduser() / "heads", "local")
            if task.head_note is not None:
                raise SystemExit(f"rtserver fit-heads: {task.head_note}")
            path = Path(spec.fitted)
            save_fitted(path, task.fitted)
            model_id = engine.feature_model_id
            print(f"  {name}: {len(task.fitted)} heads ({model_id}) written to {path}", flush=True)
            written.append(path)
    finally:
        await engine.stop()
    return written


def run_fit_heads(loaded: Any, settings: Settings, names: list[str] | None = None) -> list[Path]:
    return asyncio.run(fit_heads(loaded, settings, names))
