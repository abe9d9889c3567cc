"""The task registry. It finds plugins: files in `tasks.plugin_dirs`, and `rtserver.tasks` entry points. It
applies `[task.<name>]` config overrides, validates, and keeps the enabled tasks by name. A broken plugin is
reported, never fatal. Start-up goes on without it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import logging
import re
import sys
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ..config import ConfigError, Settings
from ..engine.backend import InferenceBackend, StructuredOutput, Tokenizer
from .actions import Action
from .chat import CHAT, ChatTask, Conversation, chat_task
from .declare import Task, TaskError, TaskOutput
from .fitting import FULL, Pace
from .head import store_fitted, stored_path
from .kb_index import KnowledgeBase
from .run import Deltas, PromptTask, no_deltas

log = logging.getLogger("rtserver.tasks")


@dataclass
class PluginError:
    source: str
    reason: str

    def __str__(self) -> str:
        return f"{self.source}: {self.reason}"


GENERIC_OVERRIDES = (
    "description",
    "prompt",
    "system_prompt",
    "max_input_chars",
    "max_input_tokens",
    "truncate",
    "max_new_tokens",
    "stop",
    "decoding",
    "overridable",
    "cache_size",
    "cache_ttl_s",
    "max_history_turns",
    "max_history_tokens",
    "priority",
    "conversation_prompt",
    "audience",
)
OVERRIDE_TYPES: dict[str, Any] = {
    "description": str,
    "prompt": str,
    "system_prompt": str,
    "max_input_chars": int,
    "max_input_tokens": int,
    "truncate": str,
    "max_new_tokens": int,
    "stop": list,
    "decoding": dict,
    "overridable": dict,
    "cache_size": int,
    "cache_ttl_s": (int, float),
    "max_history_turns": int,
    "max_history_tokens": int,
    "priority": str,
    "conversation_prompt": str,
    "audience": list,
}


def _task_from(obj: object, options: dict[str, object], source: str) -> Task:
    """A Task from a module (TASK or make_task), from a Task, or from a factory callable."""
    factory = getattr(obj, "make_task", None)
    if factory is None and callable(obj) and not isinstance(obj, Task):
        factory = obj
    if factory is not None:
        task = factory(dict(options))
    else:
        task = getattr(obj, "TASK", obj)
        if options:
            raise ValueError(
                f"unknown settings {', '.join(sorted(options))} (this task takes no options of "
                f"its own; settable: {', '.join(GENERIC_OVERRIDES)})"
            )
    if not isinstance(task, Task):
        raise ValueError("defines neither TASK = Task(...) nor make_task(options) -> Task")
    return task


def _apply_overrides(task: Task, table: dict[str, Any]) -> Task:
    generic = {k: v for k, v in table.items() if k in GENERIC_OVERRIDES}
    for key, value in generic.items():
        expected = OVERRIDE_TYPES[key]
        if (
            isinstance(value, bool)
            or not isinstance(value, expected)
            or (key == "stop" and not all(isinstance(v, str) for v in value))
        ):
            names = {
                str: "a string",
                int: "an integer",
                (int, float): "a number",
                list: "a list of strings",
                dict: "a table",
            }
            raise ValueError(f"[task.{task.name}] {key} = {value!r}: expected {names[expected]}")
        if key == "cache_ttl_s":
            generic[key] = float(value)
        if key == "audience":
            generic[key] = tuple(value)
    for key in ("decoding", "overridable"):  # a table's keys replace the plugin's, the others stay
        if key in generic:
            generic[key] = {**getattr(task, key), **generic[key]}
    return dataclasses.replace(task, **generic)


# `[task.<name>] backend = "local" | "openai"`: where the task runs, a deployment choice the web layer
# reads (not part of the declaration)
PLACEMENT_KEY = "backend"


class CacheCounts(NamedTuple):
    """A task's result cache, as /metrics counts it."""

    hits: int
    misses: int


class TaskRegistry:
    """The enabled stateless tasks by name, and those run on every user chat message. Also the backend each
    is placed on, when its `[task.<name>]` table names one. Also the chat (`[chat]`).
    """

    def __init__(
        self,
        tasks: dict[str, PromptTask],
        auto_tasks: list[str],
        placements: dict[str, str] | None = None,
        chat: ChatTask | None = None,
        actions: dict[str, Action] | None = None,
    ):
        self.tasks = tasks
        self.auto_tasks = auto_tasks
        self.placements = placements or {}
        self._chat = chat
        self.actions = actions or {}  # what the bot may do, by name (plugins' `Action`s)

    def placement(self, name: str) -> str | None:
        """The backend named for this task in the config. None means the default backend."""
        return self.placements.get(name)

    @property
    def chat(self) -> ChatTask:
        if self._chat is None:
            raise TaskError("unknown_task", "this registry has no chat")
        return self._chat

    def names(self) -> list[str]:
        """The stateless tasks' names."""
        return sorted(self.tasks)

    def declarations(self) -> dict[str, Task]:
        """Every task a client may name, the chat included, by name."""
        found = {name: task.task for name, task in self.tasks.items()}
        if self._chat is not None:
            found[self._chat.task.name] = self._chat.task
        return dict(sorted(found.items()))

    def describe(self, caller: str | None = None) -> list[dict[str, Any]]:
        """Every task, the chat included, or those `caller` may call."""
        tasks = self.declarations().values()
        return [t.describe() for t in tasks if caller is None or caller in t.callers]

    def check_caller(self, name: str, caller: str) -> None:
        """Raise `unknown_task` or `task_not_allowed` unless `caller` may call the task `name`."""
        declared = self.declarations().get(name) if isinstance(name, str) else None
        if declared is None:
            raise self._unknown(name)
        declared.check_caller(caller)

    def get(self, name: str) -> PromptTask:
        """A stateless task. The chat is a session's (`chat`), not a task call."""
        task = self.tasks.get(name) if isinstance(name, str) else None
        if task is not None:
            return task
        if self._chat is not None and name == self._chat.task.name:
            raise TaskError("invalid_input", f"{name} is stateful: use a chat session, not a task call")
        raise self._unknown(name)

    def _unknown(self, name: object) -> TaskError:
        available = ", ".join(self.declarations())
        return TaskError("unknown_task", f"no task named {name!r} (available: {available})")

    async def run(
        self,
        backend: InferenceBackend,
        name: str,
        raw_input: object,
        overrides: dict[str, object] | None = None,
        *,
        scope: Hashable | None = None,
        on_delta: Deltas = no_deltas,
        conversation: Conversation | None = None,
        caller: str | None = None,
    ) -> TaskOutput:
        """Run a stateless task. `scope` keeps its cached results apart. `on_delta` sees its replies stream
        (see `PromptTask.run`). A task may have a `conversation_prompt` and be given the live `conversation`
        its input is about. It then continues that conversation instead (`PromptTask.follow`). A `caller`
        (customers, agents, api) must be in the task's audience. The call runs at its priority
        (`Task.sampling`). None: the server's own call (auto-tasks).
        """
        task = self.get(name)
        if caller is not None:
            task.task.check_caller(caller)
        instruction = task.task.conversation_prompt
        if conversation is not None and instruction is not None:
            prompt = self.chat.continued(conversation, instruction)
            if prompt is not None:
                return await task.follow(
                    backend, prompt, conversation.session_key, overrides, on_delta, caller=caller
                )
        return await task.run(backend, raw_input, overrides, scope=scope, on_delta=on_delta, caller=caller)

    def cost(self, name: str, overrides: dict[str, object] | None = None) -> int:
        """The most tokens one call of a stateless task can take. Admission holds that much for it."""
        return self.get(name).cost(overrides)

    async def prepare(
        self,
        backend_for: Callable[[str], tuple[str, InferenceBackend]],
        cache_dir: Path | None,
        *,
        fit: bool = True,
        pace: Pace = FULL,
    ) -> list[PluginError]:
        """Load the learned heads of the tasks that declare one. Each loads on the backend that runs it
        (`backend_for(task) -> (backend name, backend)`). With `fit`, fit those without a stored fit. A task
        whose examples file is broken is dropped. It is reported like a broken plugin. One without hidden
        states or without a fit keeps label scoring. `PromptTask.prepare` logs it.
        """
        errors: list[PluginError] = []
        for name, task in list(self.tasks.items()):
            if task.task.head is None:
                continue
            backend_name, backend = backend_for(name)
            try:
                await task.prepare(backend, cache_dir, backend_name, fit=fit, pace=pace)
            except Exception as exc:
                log.error("task %s: learned head failed: %s", name, exc)
                errors.append(PluginError(f"task {name}", f"learned head: {exc}"))
                self._drop(name)
        return errors

    async def prepare_knowledge(self, backend_for: Callable[[str], tuple[str, InferenceBackend]]) -> None:
        """Index the chat's articles and compile its citation grammars. Knowledge is turned off, with an
        error logged, where the chat's backend cannot constrain output. A folder that fails to index leaves
        the chat answering without sources until it indexes.
        """
        from . import citations

        kb = self.chat.knowledge
        if kb is None:
            return
        backend = backend_for(CHAT)[1]
        if not isinstance(backend, StructuredOutput):
            log.error(
                "knowledge: off: the chat's backend cannot constrain output (only the local engine can)"
            )
            self.chat.knowledge = None
            return
        await asyncio.to_thread(kb.load)
        for n in range(kb.settings.top_k + 1):
            await backend.prepare_output(citations.answer_format(n), pin=True)
            if n:
                await backend.prepare_output(citations.ending_format(n), pin=True)

    async def prepare_outputs(
        self, backend_for: Callable[[str], tuple[str, InferenceBackend]]
    ) -> list[PluginError]:
        """Compile each task's output format for good on the backend that runs it. Some tasks are dropped
        and reported like a broken plugin. Their format does not compile for this model, or their backend
        cannot constrain output.
        """
        errors: list[PluginError] = []
        for name, task in list(self.tasks.items()):
            fmt = task.task.output_format
            if fmt is None or fmt.free:
                continue
            backend = backend_for(name)[1]
            if not isinstance(backend, StructuredOutput):  # not the task's fault: here it is unavailable
                why = "its backend cannot constrain output (only the local engine can)"
                log.warning("task %s: not loaded: %s", name, why)
                errors.append(PluginError(f"task {name}", f"output format: {why}"))
                self._drop(name)
                continue
            try:
                await backend.prepare_output(fmt, pin=True)
            except Exception as exc:
                log.error("task %s: output format failed: %s", name, exc)
                errors.append(PluginError(f"task {name}", f"output format: {exc}"))
                self._drop(name)
        return errors

    def _drop(self, name: str) -> None:
        del self.tasks[name]
        if name in self.auto_tasks:
            self.auto_tasks.remove(name)

    async def fit_missing(
        self,
        backend_for: Callable[[str], tuple[str, InferenceBackend]],
        cache_dir: Path,
        pace: Pace,
    ) -> None:
        """Fit the heads that had no fit for this model. Store them for the next start. Switch each task to
        its head when done. A failure leaves that task on label scoring (logged).
        """
        for name, task in list(self.tasks.items()):
            if not task.fit_missing:
                continue
            why = task.head_note
            task.head_note = f"{why} (fitting in the background)"
            try:
                backend_name, backend = backend_for(name)
                await task.prepare(backend, cache_dir, backend_name, pace=pace)
                store_task_fit(task, cache_dir)
            except Exception as exc:
                log.error("task %s: background head fit failed: %s", name, exc)
                task.head_note = f"{why} (the background fit failed: {exc})"
                continue
            log.info("task %s: switched to its learned head, fitted in the background", name)

    def heads_off(self, why: str) -> None:
        """Learned heads are not used at all. Every task with one says why on /health."""
        for task in self.tasks.values():
            if task.task.head is not None:
                task.head_note = why

    def head_states(self) -> dict[str, dict[str, str]]:
        """Per task with a learned head: the scoring it uses (`head` or `labels`), and why."""
        out: dict[str, dict[str, str]] = {}
        for name, task in self.tasks.items():
            state = task.head_state()
            if state is not None:
                out[name] = state
        return out

    async def calibrate(self, backend_for: Callable[[str], tuple[str, InferenceBackend]]) -> None:
        """Compute the calibration offsets of the label-scoring tasks. Each runs on its backend, alone,
        before the server takes requests. A backend may fail here (a remote server down at start). Then they
        are left to the task's first call.
        """
        for name, task in self.tasks.items():
            backend_name, backend = backend_for(name)
            try:
                await task.calibrate(backend)
            except Exception as exc:
                log.warning(
                    "task %s: calibration on backend %s failed (%s); its first call computes it",
                    name,
                    backend_name,
                    exc,
                )

    def cache_stats(self) -> dict[str, CacheCounts]:
        return {
            n: CacheCounts(t.cache_hits, t.cache_misses) for n, t in self.tasks.items() if t.cache is not None
        }


def store_task_fit(task: PromptTask, cache_dir: Path) -> Path:
    """Store a prepared task's heads in the cache. The next start loads them there."""
    path = stored_path(cache_dir, task.task.name)
    assert path is not None
    store_fitted(path, task.fitted)
    return path


def _discover(settings: Settings) -> list[tuple[str, object]]:
    """(source, module-or-object) for every plugin file and entry point. Import errors are returned."""
    found: list[tuple[str, object]] = []
    for folder in settings.tasks.plugin_dirs:
        path = Path(folder).expanduser()
        if not path.is_absolute() and not path.exists():
            path = Path(__file__).resolve().parents[2] / folder  # the project's own plugins/
        if not path.is_dir():
            found.append(
                (str(folder), PluginError(str(folder), "plugin folder not found (tasks.plugin_dirs)"))
            )
            continue
        for file in sorted(path.glob("*.py")):
            if file.name.startswith("_"):
                continue
            # A unique module name per file, registered while it runs: dataclasses (and pickling) in a
            # plugin look their module up in sys.modules.
            digest = hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:10]
            mod_name = f"rtserver_plugin_{re.sub(r'[^0-9a-zA-Z_]', '_', file.stem)}_{digest}"
            try:
                spec = importlib.util.spec_from_file_location(mod_name, file)
                if spec is None or spec.loader is None:
                    raise ImportError("not a loadable Python file")
                module = importlib.util.module_from_spec(spec)
                sys.modules[mod_name] = module
                spec.loader.exec_module(module)
                found.append((str(file), module))
            except BaseException as exc:
                sys.modules.pop(mod_name, None)
                if not isinstance(exc, Exception) and not isinstance(exc, SystemExit):
                    raise
                found.append(
                    (str(file), PluginError(str(file), f"import failed: {type(exc).__name__}: {exc}"))
                )
    for ep in importlib.metadata.entry_points(group="rtserver.tasks"):
        source = f"entry point {ep.name} ({ep.value})"
        try:
            found.append((source, ep.load()))
        except Exception as exc:
            found.append((source, PluginError(source, f"import failed: {type(exc).__name__}: {exc}")))
    return found


def _declared_name(obj: object) -> str | None:
    """The task name a plugin declares before it is built. It is TASK.name, NAME, or the NAME of the module
    an entry-point factory lives in.
    """
    if isinstance(obj, Task):
        return obj.name
    task = getattr(obj, "TASK", None)
    if isinstance(task, Task):
        return task.name
    name = getattr(obj, "NAME", None)
    if name is None and callable(obj):
        name = getattr(sys.modules.get(getattr(obj, "__module__", None) or ""), "NAME", None)
    return name


def load_registry(settings: Settings, tokenizer: Tokenizer) -> tuple[TaskRegistry, list[PluginError]]:
    """Discover, configure and validate every task. A broken plugin is reported, never fatal."""
    chat = _load_chat(settings, tokenizer)  # core: a bad [chat] stops the start
    errors: list[PluginError] = []
    tasks: dict[str, PromptTask] = {}
    overrides: dict[str, Any] = dict(settings.task)
    enabled, disabled = set(settings.tasks.enabled), set(settings.tasks.disabled)
    seen: set[str] = set()  # every task name a plugin declared, loaded or not
    actions: dict[str, Action] = {}
    for source, obj in _discover(settings):
        if isinstance(obj, PluginError):
            errors.append(obj)
            continue
        if _declares_action(obj):
            _load_action(source, obj, overrides, seen, actions, errors, disabled)
            continue
        try:
            name = _declared_name(obj)
            if name is None:  # a factory that does not say its name: ask it with no options
                name = _task_from(obj, {}, source).name
            table = {k: v for k, v in overrides.get(name, {}).items() if k != PLACEMENT_KEY}
            if not isinstance(name, str):
                raise ValueError(f"name {name!r}: expected a string")
            seen.add(name)
            options = {k: v for k, v in table.items() if k not in GENERIC_OVERRIDES}
            task = _task_from(obj, options, source)
            task = _apply_overrides(task, table)
            task.validate()
            if task.name != name and name in overrides:
                raise ValueError(f"declares NAME {name!r} but builds task {task.name!r}")
        except Exception as exc:
            errors.append(PluginError(source, f"invalid task: {exc}"))
            continue
        seen.add(task.name)
        if task.name == CHAT:
            errors.append(PluginError(source, "the name 'chat' is the chat's own ([chat] in config.toml)"))
            continue
        if task.name in tasks:
            errors.append(PluginError(source, f"task {task.name!r} is already defined; this one is ignored"))
            continue
        if task.name in disabled or (enabled and task.name not in enabled):
            continue
        tasks[task.name] = PromptTask(task, tokenizer)
    auto = [n for n in settings.tasks.auto_tasks if n in tasks]
    errors += _config_errors(overrides, seen, settings.tasks.auto_tasks, auto)
    for err in errors:
        log.error("plugin problem: %s", err)
    placements = {
        name: table[PLACEMENT_KEY]
        for name, table in overrides.items()
        if name in tasks and isinstance(table, dict) and PLACEMENT_KEY in table
    }
    return TaskRegistry(tasks, auto, placements, chat, actions), errors


def _config_errors(
    overrides: dict[str, Any], seen: set[str], wanted: list[str], auto: list[str]
) -> list[PluginError]:
    """config.toml's task tables and auto-tasks that name no loaded task."""
    errors = []
    for name in overrides:
        if name == CHAT:
            errors.append(PluginError("config.toml", f"[task.{name}]: the chat's settings are [chat]"))
        elif name not in seen:
            errors.append(PluginError("config.toml", f"[task.{name}]: no such task"))
    for n in wanted:
        if n not in auto:
            why = f"tasks.auto_tasks: {n!r} is not an enabled stateless task"
            errors.append(PluginError("config.toml", why))
    return errors


def _declares_action(obj: object) -> bool:
    return isinstance(obj, Action) or hasattr(obj, "ACTION") or hasattr(obj, "make_action")


def _load_action(
    source: str,
    obj: object,
    overrides: dict[str, Any],
    seen: set[str],
    actions: dict[str, Action],
    errors: list[PluginError],
    disabled: set[str],
) -> None:
    """An action plugin: `ACTION = Action(...)`, or `NAME` and `make_action(options)` given its
    `[task.<name>]` table. A broken one is reported like a broken task.
    """
    try:
        factory = getattr(obj, "make_action", None)
        declared = getattr(obj, "ACTION", obj)
        name = getattr(obj, "NAME", None) if factory is not None else getattr(declared, "name", None)
        if not isinstance(name, str):
            raise ValueError("an action plugin with make_action declares NAME")
        seen.add(name)
        options = dict(overrides.get(name, {}))
        if factory is not None:
            action = factory(options)
        else:
            action = declared
            if options:
                raise ValueError(f"unknown settings {', '.join(sorted(options))} (this action takes none)")
        if not isinstance(action, Action):
            raise ValueError("ACTION or make_action(options) must give an Action")
        if action.name != name:
            raise ValueError(f"declares NAME {name!r} but builds action {action.name!r}")
    except Exception as exc:
        errors.append(PluginError(source, f"invalid action: {exc}"))
        return
    if action.name in actions or action.name == CHAT:
        errors.append(PluginError(source, f"action {action.name!r} is already defined; this one is ignored"))
    elif action.name not in disabled:
        actions[action.name] = action


def _load_chat(settings: Settings, tokenizer: Tokenizer) -> ChatTask:
    """The chat of `[chat]`; ConfigError where its settings cannot be used."""
    try:
        knowledge = (
            KnowledgeBase(settings.knowledge, settings.model.cache_dir)
            if settings.knowledge.enabled
            else None
        )
        return ChatTask(chat_task(settings.chat), tokenizer, knowledge)
    except ValueError as exc:
        raise ConfigError(f"[chat]: {exc}") from None
