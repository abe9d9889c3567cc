"""`rtserver fit-heads`: fit the learned heads of the tasks that declare one on the configured model and
store them in the cache (`model.cache_dir/heads`), where the next start loads them in milliseconds. A
start never fits: without a stored or shipped fit for its model a task scores labels. `--ship` also
writes the file a plugin ships (`LearnedHead.fitted`): rerun that after editing a built-in prompt or
examples file."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

from ..config import EngineSettings, Settings
from ..engine.core import Engine
from ..engine.model import LoadedModel
from .fitting import BACKGROUND_NICE
from .head import save_fitted
from .registry import load_registry, store_task_fit
from .run import PromptTask


async def fit_heads(
    loaded: LoadedModel, settings: Settings, names: list[str] | None = None, *, ship: bool = False
) -> list[Path]:
    """Prepare every (or every named) task with a learned head and store its heads; the files written."""
    registry, errors = load_registry(settings, loaded.tokenizer)
    for error in errors:
        print(f"  skipped: {error}", flush=True)
    tasks = {
        name: task
        for name, task in registry.tasks.items()
        if isinstance(task, PromptTask)
        and task.task.head is not None
        and (not ship or task.task.head.fitted is not None)
        and (not names or name in names)
    }
    if names and set(names) - set(tasks):
        missing = ", ".join(sorted(set(names) - set(tasks)))
        what = "a fitted-heads file to ship" if ship else "a learned head"
        raise SystemExit(f"rtserver fit-heads: no loaded task with {what} named {missing}")
    cache_dir = Path(settings.model.cache_dir).expanduser() / "heads"
    engine = Engine(loaded, EngineSettings())
    engine.start()
    written: list[Path] = []
    try:
        for name, task in tasks.items():
            spec = task.task.head
            assert spec is not None
            await task.prepare(engine, cache_dir, "local")
            if task.head_note is not None:
                raise SystemExit(f"rtserver fit-heads: {task.head_note}")
            paths = [store_task_fit(task, cache_dir)]
            if ship and spec.fitted is not None:
                save_fitted(Path(spec.fitted), task.fitted)
                paths.append(Path(spec.fitted))
            model_id = engine.feature_model_id
            for path in paths:
                print(f"  {name}: {len(task.fitted)} heads ({model_id}) written to {path}", flush=True)
            written += paths
    finally:
        await engine.stop()
    return written


def lower_priority() -> None:
    """`--background`: this process yields the cores to a server beside it (threads started later
    inherit the nice value)."""
    with contextlib.suppress(OSError):
        os.nice(BACKGROUND_NICE)


def run_fit_heads(
    loaded: LoadedModel, settings: Settings, names: list[str] | None = None, *, ship: bool = False
) -> list[Path]:
    """`fit_heads` on its own event loop, for the command line."""
    return asyncio.run(fit_heads(loaded, settings, names, ship=ship))
