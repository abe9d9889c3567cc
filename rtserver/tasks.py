"""Task plugins: the declarative `Task` form, how a task runs on the engine, and the registry that
discovers tasks in plugin folders and `rtserver.tasks` entry points and applies config overrides.

A plugin is a Python file that defines `TASK = Task(...)`, or `make_task(options) -> Task` when it takes
options of its own from its `[task.<name>]` table. Stateless tasks render a prompt from a template whose
part before `{text}` is a fixed prefix the engine shares between calls; they either generate text and
parse it, or score a closed set of `Choices` in one forward pass. The stateful `chat` task renders a
session's history through the tokenizer's chat template.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import inspect
import logging
import math
import re
import sys
import time
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cachetools import TTLCache

from .sequence import SamplingError, SamplingParams

log = logging.getLogger("rtserver.tasks")

TRUNCATE_MODES = ("reject", "head", "tail")
DECODING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens", "min_new_tokens",
                 "seed", "stop")


class TaskError(Exception):
    """A request a task cannot take; `code` is stable, `message` says what to change."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Choices:
    """A closed set of outputs, each scored as the log-probability of its verbalizer after the prompt.

    `calibration` lists content-free inputs (e.g. "N/A"); their mean label scores are subtracted so the
    model's prior preference for one label word does not decide the answer (contextual calibration).
    """

    labels: dict[str, str]  # output label -> continuation text scored after the prompt
    calibration: list[str] = field(default_factory=list)


@dataclass
class Variant:
    """An alternative prompt/choices used when `when(text)` is true (e.g. a prompt for Chinese text)."""

    when: Callable[[str], bool]
    prompt: str
    choices: Choices | None = None
    chat_template: bool | None = None


@dataclass
class Task:
    name: str
    description: str
    prompt: str = "{text}"  # the part before {text} is the shared prefix
    chat_template: bool = True  # wrap the prompt as a user turn of the tokenizer's chat template
    system_prompt: str | None = None
    stateful: bool = False
    input_kind: str = "text"  # "text" | "chat"
    max_input_chars: int = 4000
    max_input_tokens: int = 512
    truncate: str = "reject"  # reject | head (keep the start) | tail (keep the end)
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    decoding: dict[str, Any] = field(default_factory=dict)  # defaults, e.g. {"temperature": 0.7}
    overridable: dict[str, tuple[float, float]] = field(default_factory=dict)  # client-settable ranges
    choices: Choices | None = None
    parser: Callable[[str], dict] | None = None
    variants: list[Variant] = field(default_factory=list)
    cache_size: int = 0  # 0 = no result cache
    cache_ttl_s: float = 600.0
    max_history_turns: int = 20
    max_history_tokens: int = 1500

    # -- checks ---------------------------------------------------------------------------------
    def validate(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9_-]{0,39}", self.name or ""):
            raise ValueError(f"name {self.name!r}: use lowercase letters, digits, - or _")
        if self.truncate not in TRUNCATE_MODES:
            raise ValueError(f"truncate {self.truncate!r}: allowed {', '.join(TRUNCATE_MODES)}")
        if self.input_kind not in ("text", "chat"):
            raise ValueError(f"input_kind {self.input_kind!r}: allowed text, chat")
        if not self.stateful and self.prompt.count("{text}") != 1:
            raise ValueError("prompt must contain {text} exactly once")
        for key in list(self.decoding) + list(self.overridable):
            if key not in DECODING_KEYS:
                raise ValueError(f"decoding key {key!r}: allowed {', '.join(DECODING_KEYS)}")
        for key, bounds in self.overridable.items():
            if (not isinstance(bounds, (tuple, list)) or len(bounds) != 2
                    or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds)
                    or bounds[0] > bounds[1]):
                raise ValueError(f"overridable {key!r}: expected a (low, high) range, got {bounds!r}")
        _check_choices(self.choices, "choices")
        if self.parser is not None and not callable(self.parser):
            raise ValueError("parser must be a function text -> dict")
        if self.choices is not None and self.parser is not None:
            raise ValueError("declare either choices (scoring) or a parser (generation), not both")
        for i, v in enumerate(self.variants):
            if not isinstance(v, Variant) or not callable(v.when):
                raise ValueError(f"variants[{i}]: expected Variant(when=callable, prompt=...)")
            if not isinstance(v.prompt, str) or v.prompt.count("{text}") != 1:
                raise ValueError(f"variants[{i}]: prompt must contain {{text}} exactly once")
            _check_choices(v.choices, f"variants[{i}].choices")
            if v.choices is not None and self.choices is None:
                raise ValueError(f"variants[{i}]: choices given but the task itself declares none")
        for key in ("max_input_chars", "max_input_tokens", "max_new_tokens", "max_history_turns",
                    "max_history_tokens"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} = {value!r}: must be an integer of at least 1")
        if isinstance(self.cache_size, bool) or not isinstance(self.cache_size, int) or self.cache_size < 0:
            raise ValueError(f"cache_size = {self.cache_size!r}: must be an integer >= 0 (0 = no cache)")
        if (isinstance(self.cache_ttl_s, bool) or not isinstance(self.cache_ttl_s, (int, float))
                or not self.cache_ttl_s > 0):
            raise ValueError(f"cache_ttl_s = {self.cache_ttl_s!r}: must be a number > 0")
        try:
            self.sampling(None)
        except TaskError as exc:
            raise ValueError(f"decoding: {exc.message}") from None

    def describe(self) -> dict:
        return {
            "name": self.name, "description": self.description, "stateful": self.stateful,
            "input": {"type": "object", "required": ["text"],
                      "properties": {"text": {"type": "string", "maxLength": self.max_input_chars}}}
            if self.input_kind == "text" else
            {"type": "object", "required": ["history"], "properties": {"history": {"type": "array"}}},
            "output": "choices" if self.choices else "text",
            "labels": list(self.choices.labels) if self.choices else None,
            "limits": {"max_input_tokens": self.max_input_tokens, "truncate": self.truncate,
                       "max_new_tokens": self.max_new_tokens},
            "decoding": dict(self.decoding),
            "overridable": {k: list(v) for k, v in self.overridable.items()},
        }

    # -- input --------------------------------------------------------------------------------
    def clean_text(self, text: Any) -> str:
        """Strip control characters (keeping newlines and tabs), check emptiness and size."""
        if not isinstance(text, str):
            raise TaskError("invalid_input", f"{self.name}: 'text' must be a string")
        if not text.isprintable():  # printable text has no control/format characters: nothing to strip
            text = "".join(c for c in text if c in "\n\t" or unicodedata.category(c)[0] != "C")
        text = text.strip()
        if not text:
            raise TaskError("empty_text", f"{self.name}: text is empty")
        if len(text) > self.max_input_chars:
            if self.truncate == "reject":
                raise TaskError("input_too_long", f"{self.name}: text has {len(text)} characters, "
                                f"the limit is {self.max_input_chars}")
            text = text[:self.max_input_chars] if self.truncate == "head" else text[-self.max_input_chars:]
        return text

    def sampling(self, overrides: dict | None) -> SamplingParams:
        """Decoding for one call: the task's defaults, then client overrides within allowed ranges."""
        values: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "stop": list(self.stop)}
        values.update(self.decoding)
        if overrides is not None and not isinstance(overrides, dict):
            raise TaskError("bad_decoding", f"{self.name}: decoding options must be an object")
        for key, value in (overrides or {}).items():
            if key not in self.overridable:
                allowed = ", ".join(sorted(self.overridable)) or "none"
                raise TaskError("bad_decoding", f"{self.name}: '{key}' cannot be set (settable: {allowed})")
            lo, hi = self.overridable[key]
            if key == "stop":
                if not (isinstance(value, list) and all(isinstance(s, str) for s in value) and len(value) <= hi):
                    raise TaskError("bad_decoding", f"{self.name}: 'stop' must be a list of at most "
                                    f"{int(hi)} strings")
                values[key] = list(self.stop) + value
                continue
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or isinstance(value, float) and not math.isfinite(value)):  # a huge int has no float
                raise TaskError("bad_decoding", f"{self.name}: '{key}' must be a number")
            if not lo <= value <= hi:
                raise TaskError("bad_decoding", f"{self.name}: '{key}' = {value} is outside {lo}..{hi}")
            if key in ("top_k", "max_new_tokens", "min_new_tokens", "seed"):
                if value != int(value):
                    raise TaskError("bad_decoding", f"{self.name}: '{key}' must be an integer")
                value = int(value)
            values[key] = value
        try:
            params = SamplingParams(**values)
            params.validate()
        except (SamplingError, TypeError) as exc:
            raise TaskError("bad_decoding", f"{self.name}: {exc}") from None
        return params

    def select(self, text: str) -> tuple[str, Choices | None, bool]:
        """(prompt template, choices, use chat template) for this input."""
        for v in self.variants:
            if v.when(text):
                return (v.prompt, v.choices if v.choices is not None else self.choices,
                        self.chat_template if v.chat_template is None else v.chat_template)
        return self.prompt, self.choices, self.chat_template


def _check_choices(choices: Any, where: str) -> None:
    if choices is None:
        return
    if not isinstance(choices, Choices) or not isinstance(choices.labels, dict):
        raise ValueError(f"{where}: expected Choices(labels={{label: text scored}}, calibration=[...])")
    if len(choices.labels) < 2:
        raise ValueError(f"{where}: need at least two labels")
    for label, words in choices.labels.items():
        if not isinstance(label, str) or not label or not isinstance(words, str) or not words:
            raise ValueError(f"{where}: label {label!r} -> {words!r}: labels and the text scored for them "
                             "must be non-empty strings")
    if not isinstance(choices.calibration, list) or not all(isinstance(c, str) and c
                                                               for c in choices.calibration):
        raise ValueError(f"{where}: calibration must be a list of non-empty strings")


def has_cjk(text: str) -> bool:
    return any("\u4e00" <= c <= "\u9fff" or "\u3400" <= c <= "\u4dbf" for c in text)


@dataclass
class TaskOutput:
    task: str
    output: dict
    text: str
    usage: dict
    timing: dict
    cached: bool = False

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class PreparedTask:
    """A task bound to a tokenizer: renders prompts (caching the fixed prefix tokens) and runs calls."""

    def __init__(self, task: Task, tokenizer: Any):
        self.task = task
        self.tokenizer = tokenizer
        self._prefixes: dict[tuple[str, bool], tuple[list[int], str, str]] = {}
        self._suffixes: dict[str, list[int]] = {}
        self._candidates: dict[tuple, list[list[int]]] = {}
        self._calibration: dict[tuple, asyncio.Future] = {}
        self.cache: TTLCache | None = (TTLCache(task.cache_size, task.cache_ttl_s)
                                       if task.cache_size and not task.stateful else None)
        self.cache_hits = 0
        self.cache_misses = 0

    def __getattr__(self, name: str) -> Any:  # the declaration's fields read through
        return getattr(self.task, name)

    # -- prompts ------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _encode_input(self, text: str) -> list[int]:
        """User text: special-token strings in it (e.g. "<|im_end|>") stay plain text."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        except TypeError:  # a tokenizer without the option
            return self._encode(text)

    def _split_template(self, template: str, chat: bool) -> tuple[list[int], str, str]:
        """Token ids of everything before {text} (the shared prefix), text to put before the input when it
        is tokenized, and the raw text after it."""
        key = (template, chat)
        if key not in self._prefixes:
            marker = "\x00TEXT\x00"
            rendered = template.replace("{text}", marker)
            if chat:
                messages = [{"role": "user", "content": rendered}]
                if self.task.system_prompt:
                    messages.insert(0, {"role": "system", "content": self.task.system_prompt})
                rendered = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                              add_generation_prompt=True)
            before, after = rendered.split(marker)
            # The prefix keeps its trailing space as its own token ("Message: " + "great"): measured on
            # data/sentiment/en_dev, that scores better with this model (0.715) than letting the space
            # glue onto the text (" great", 0.605). `glue` is where that choice would go.
            glue = ""
            self._prefixes[key] = (self._encode(before), glue, after)
        return self._prefixes[key]

    def _suffix_ids(self, suffix: str) -> list[int]:
        ids = self._suffixes.get(suffix)
        if ids is None:
            ids = self._suffixes[suffix] = self._encode(suffix)
        return ids

    def _candidate_ids(self, choices: Choices) -> list[list[int]]:
        key = tuple(choices.labels.items())
        ids = self._candidates.get(key)
        if ids is None:
            ids = self._candidates[key] = [self._encode(words) for words in choices.labels.values()]
        return ids

    def render(self, text: str) -> tuple[list[int], Choices | None]:
        """(prompt ids, choices) for a cleaned input text, within the token limit. The fixed prefix is
        tokenized on its own so every call starts with the same tokens (and shares their KV)."""
        return self._render(text)[:2]

    def _render(self, text: str) -> tuple[list[int], Choices | None, str, bool]:
        template, choices, chat = self.task.select(text)
        prefix, glue, suffix = self._split_template(template, chat)
        body = self._encode_input(glue + text)
        if len(body) > self.task.max_input_tokens:
            if self.task.truncate == "reject":
                raise TaskError("input_too_long", f"{self.task.name}: text has {len(body)} tokens, the limit "
                                f"is {self.task.max_input_tokens}")
            keep = self.task.max_input_tokens
            body = body[:keep] if self.task.truncate == "head" else body[-keep:]
        return prefix + body + self._suffix_ids(suffix), choices, template, chat

    # -- running ------------------------------------------------------------------------------
    async def run(self, engine: Any, raw_input: Any, overrides: dict | None = None) -> TaskOutput:
        text = raw_input.get("text") if isinstance(raw_input, dict) else raw_input
        text = self.clean_text(text)
        # Overrides are checked before the cache is read (a bad one is an error, cached or not); without
        # any, the task's own decoding is valid by construction and only built when generating.
        params = None if overrides is None else self.sampling(overrides)
        key = (" ".join(text.split()).lower(), "[]" if not overrides else repr(sorted(overrides.items())))
        if self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None:
                self.cache_hits += 1
                return TaskOutput(hit.task, hit.output, hit.text, hit.usage, hit.timing, True)
            self.cache_misses += 1
        started = time.perf_counter()
        prompt, choices, template, chat = self._render(text)
        if choices is not None:
            output = await self._score(engine, prompt, choices, template, chat)
            out = TaskOutput(self.task.name, output, output["label"],
                             {"prompt_tokens": len(prompt), "generated_tokens": 0},
                             {"total_ms": (time.perf_counter() - started) * 1000})
        else:
            stream = engine.generate(prompt, params if params is not None else self.sampling(None))
            result = await stream.result()
            if result.error:
                raise TaskError("internal", f"{self.task.name}: generation failed")
            try:
                parsed = self.task.parser(result.text) if self.task.parser else {"text": result.text}
            except Exception as exc:  # a plugin bug: this request fails, nothing else does
                log.exception("%s: output parser failed on %r", self.task.name, result.text)
                raise TaskError("internal", f"{self.task.name}: the task's output parser failed "
                                f"({type(exc).__name__})") from exc
            if not isinstance(parsed, dict):
                parsed = {"value": parsed}
            out = TaskOutput(self.task.name, parsed, result.text, dataclasses.asdict(result.usage),
                             {"queued_ms": result.queued_ms, "ttft_ms": result.ttft_ms,
                              "total_ms": result.total_ms})
        if self.cache is not None:
            self.cache[key] = out
        return out

    async def _score(self, engine: Any, prompt: list[int], choices: Choices, template: str, chat: bool) -> dict:
        labels = list(choices.labels)
        candidates = self._candidate_ids(choices)
        # Only differences between the labels' scores matter below (calibration subtracts per label, the
        # softmax is across labels), so the engine may leave out the prompt's log-normaliser.
        relative = _scores_relative_ok(engine)
        scores = await _engine_score(engine, prompt, candidates, relative)
        if choices.calibration:
            offsets = await self._calibration_offsets(engine, template, chat, choices, candidates, relative)
            scores = [s - o for s, o in zip(scores, offsets)]
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        total = sum(weights)
        probs = {name: w / total for name, w in zip(labels, weights)}
        label = max(probs, key=probs.get)
        return {"label": label, "probs": probs}

    async def _calibration_offsets(self, engine: Any, template: str, chat: bool, choices: Choices,
                                   candidates: list[list[int]], relative: bool) -> list[float]:
        # One computation shared by every call that needs it (a burst of first calls must not each
        # score the calibration inputs); a failed one is retried by the next call.
        key = (template, chat, tuple(choices.labels.items()), tuple(choices.calibration), relative)
        fut = self._calibration.get(key)
        if fut is None or (fut.done() and (fut.cancelled() or fut.exception() is not None)):
            fut = asyncio.ensure_future(self._compute_calibration(engine, template, chat, choices, candidates,
                                                                  relative))
            self._calibration[key] = fut
        return await asyncio.shield(fut)

    async def _compute_calibration(self, engine: Any, template: str, chat: bool, choices: Choices,
                                   candidates: list[list[int]], relative: bool) -> list[float]:
        prefix, glue, suffix = self._split_template(template, chat)
        runs = [await _engine_score(engine, prefix + self._encode_input(glue + c) + self._suffix_ids(suffix),
                                    candidates, relative)
                for c in choices.calibration]
        return [sum(r[i] for r in runs) / len(runs) for i in range(len(candidates))]


_RELATIVE_OK: dict[Any, bool] = {}


def _scores_relative_ok(engine: Any) -> bool:
    """Whether the engine's `score` takes `normalize` (scores up to a per-prompt constant, cheaper);
    engines without it (test doubles, wrappers) get plain log-probabilities."""
    method = engine.score
    func = getattr(method, "__func__", method)
    ok = _RELATIVE_OK.get(func)
    if ok is None:
        try:
            ok = "normalize" in inspect.signature(method).parameters  # not **kwargs: a wrapper may not pass it on
        except (TypeError, ValueError):
            ok = False
        if len(_RELATIVE_OK) < 1024:
            _RELATIVE_OK[func] = ok
    return ok


async def _engine_score(engine: Any, prompt: list[int], candidates: list[list[int]], relative: bool) -> list[float]:
    if relative:
        return await engine.score(prompt, candidates, normalize=False)
    return await engine.score(prompt, candidates)


class ChatTask(PreparedTask):
    """The stateful chat task: renders a session's history window through the chat template."""

    def _messages(self, history: list[dict]) -> list[dict]:
        messages = list(history)
        if self.task.system_prompt and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": self.task.system_prompt})
        return messages

    def render_history(self, history: list[dict]) -> list[int]:
        return self.tokenizer.apply_chat_template(self._messages(history), tokenize=True,
                                                  add_generation_prompt=True, return_dict=False)

    def render_text(self, history: list[dict]) -> str:
        """The prompt as text (what `render_history` tokenizes)."""
        return self.tokenizer.apply_chat_template(self._messages(history), tokenize=False,
                                                  add_generation_prompt=True)

    def render(self, history: list[dict]) -> list[int]:  # type: ignore[override]
        return self.render_history(history)

    def parse(self, text: str) -> dict:
        return self.task.parser(text) if self.task.parser else {"reply": text}

    def count_tokens(self, text: str) -> int:
        return len(self._encode(text))


# -- discovery and configuration ----------------------------------------------------------------

@dataclass
class PluginError:
    source: str
    reason: str

    def __str__(self) -> str:
        return f"{self.source}: {self.reason}"


GENERIC_OVERRIDES = ("description", "prompt", "system_prompt", "max_input_chars", "max_input_tokens",
                     "truncate", "max_new_tokens", "stop", "decoding", "cache_size", "cache_ttl_s",
                     "max_history_turns", "max_history_tokens")
OVERRIDE_TYPES: dict[str, Any] = {
    "description": str, "prompt": str, "system_prompt": str, "max_input_chars": int, "max_input_tokens": int,
    "truncate": str, "max_new_tokens": int, "stop": list, "decoding": dict, "cache_size": int,
    "cache_ttl_s": (int, float), "max_history_turns": int, "max_history_tokens": int}


def _task_from(obj: Any, options: dict, source: str) -> Task:
    """A Task from a module (TASK or make_task), a Task, or a factory callable."""
    factory = getattr(obj, "make_task", None)
    if factory is None and callable(obj) and not isinstance(obj, Task):
        factory = obj
    if factory is not None:
        task = factory(dict(options))
    else:
        task = getattr(obj, "TASK", obj)
        if options:
            raise ValueError(f"unknown settings {', '.join(sorted(options))} (this task takes no options of "
                             f"its own; settable: {', '.join(GENERIC_OVERRIDES)})")
    if not isinstance(task, Task):
        raise ValueError("defines neither TASK = Task(...) nor make_task(options) -> Task")
    return task


def _apply_overrides(task: Task, table: dict) -> Task:
    generic = {k: v for k, v in table.items() if k in GENERIC_OVERRIDES}
    for key, value in generic.items():
        expected = OVERRIDE_TYPES[key]
        if isinstance(value, bool) or not isinstance(value, expected) or (
                key == "stop" and not all(isinstance(v, str) for v in value)):
            names = {str: "a string", int: "an integer", (int, float): "a number", list: "a list of strings",
                     dict: "a table"}
            raise ValueError(f"[task.{task.name}] {key} = {value!r}: expected {names[expected]}")
        if key == "cache_ttl_s":
            generic[key] = float(value)
    if "decoding" in generic:
        generic["decoding"] = {**task.decoding, **generic["decoding"]}
    return dataclasses.replace(task, **generic)


class TaskRegistry:
    def __init__(self, tasks: dict[str, PreparedTask], auto_tasks: list[str]):
        self.tasks = tasks
        self.auto_tasks = auto_tasks

    @property
    def chat(self) -> ChatTask:
        task = self.tasks.get("chat")
        if not isinstance(task, ChatTask):
            raise TaskError("unknown_task", "the chat task is not enabled")
        return task

    def names(self) -> list[str]:
        return sorted(self.tasks)

    def describe(self) -> list[dict]:
        return [self.tasks[n].task.describe() for n in self.names()]

    def get(self, name: str) -> PreparedTask:
        task = self.tasks.get(name) if isinstance(name, str) else None
        if task is None:
            raise TaskError("unknown_task", f"no task named {name!r} (available: {', '.join(self.names())})")
        return task

    async def run(self, engine: Any, name: str, raw_input: Any, overrides: dict | None = None) -> TaskOutput:
        task = self.get(name)
        if task.task.stateful:
            raise TaskError("invalid_input", f"{name} is stateful: use a chat session, not a task call")
        return await task.run(engine, raw_input, overrides)

    def cache_stats(self) -> dict[str, tuple[int, int]]:
        return {n: (t.cache_hits, t.cache_misses) for n, t in self.tasks.items() if t.cache is not None}


def _discover(settings: Any) -> list[tuple[str, Any]]:
    """(source, module-or-object) for every plugin file and entry point; import errors are returned."""
    found: list[tuple[str, Any]] = []
    for folder in settings.tasks.plugin_dirs:
        path = Path(folder).expanduser()
        if not path.is_absolute() and not path.exists():
            path = Path(__file__).resolve().parent.parent / folder  # the project's own plugins/
        if not path.is_dir():
            found.append((str(folder), PluginError(str(folder), "plugin folder not found (tasks.plugin_dirs)")))
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
                module = importlib.util.module_from_spec(spec)
                sys.modules[mod_name] = module
                spec.loader.exec_module(module)
                found.append((str(file), module))
            except BaseException as exc:
                sys.modules.pop(mod_name, None)
                if not isinstance(exc, Exception) and not isinstance(exc, SystemExit):
                    raise
                found.append((str(file), PluginError(str(file), f"import failed: {type(exc).__name__}: {exc}")))
    for ep in importlib.metadata.entry_points(group="rtserver.tasks"):
        source = f"entry point {ep.name} ({ep.value})"
        try:
            found.append((source, ep.load()))
        except Exception as exc:
            found.append((source, PluginError(source, f"import failed: {type(exc).__name__}: {exc}")))
    return found


def _declared_name(obj: Any) -> str | None:
    """The task name a plugin declares before it is built: TASK.name, NAME, or the NAME of the module
    an entry-point factory lives in."""
    if isinstance(obj, Task):
        return obj.name
    task = getattr(obj, "TASK", None)
    if isinstance(task, Task):
        return task.name
    name = getattr(obj, "NAME", None)
    if name is None and callable(obj):
        name = getattr(sys.modules.get(getattr(obj, "__module__", None) or ""), "NAME", None)
    return name


def load_registry(settings: Any, tokenizer: Any) -> tuple[TaskRegistry, list[PluginError]]:
    """Discover, configure and validate every task. A broken plugin is reported, never fatal."""
    errors: list[PluginError] = []
    tasks: dict[str, PreparedTask] = {}
    overrides: dict = dict(settings.task)
    enabled, disabled = set(settings.tasks.enabled), set(settings.tasks.disabled)
    seen: set[str] = set()  # every task name a plugin declared, loaded or not
    for source, obj in _discover(settings):
        if isinstance(obj, PluginError):
            errors.append(obj)
            continue
        try:
            name = _declared_name(obj)
            if name is None:  # a factory that does not say its name: ask it with no options
                name = _task_from(obj, {}, source).name
            table = dict(overrides.get(name, {}))
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
        if task.name in tasks:
            errors.append(PluginError(source, f"task {task.name!r} is already defined; this one is ignored"))
            continue
        if task.name in disabled or (enabled and task.name not in enabled):
            continue
        tasks[task.name] = (ChatTask if task.stateful else PreparedTask)(task, tokenizer)
    for name in overrides:
        if name not in seen:
            errors.append(PluginError("config.toml", f"[task.{name}]: no such task"))
    auto = [n for n in settings.tasks.auto_tasks if n in tasks and not tasks[n].task.stateful]
    for n in settings.tasks.auto_tasks:
        if n not in auto:
            errors.append(PluginError("config.toml", f"tasks.auto_tasks: {n!r} is not an enabled stateless task"))
    for err in errors:
        log.error("plugin problem: %s", err)
    return TaskRegistry(tasks, auto), errors
