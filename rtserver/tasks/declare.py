"""The task declaration that plugin authors write. It holds `Task`, `Choices`, `JSONSchema`, `Regex`,
`Grammar`, `Variant` and `LearnedHead`.

A declaration checks itself. It owns its limits, its input cleaning, and its decoding with client overrides.
How it runs: `run.py` and `chat.py`. How plugins are found: `registry.py`.
"""

from __future__ import annotations

import dataclasses
import re
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from ..engine.backend import (
    OutputFormat,
    OutputFormatError,
    Priority,
    SamplingError,
    SamplingParams,
    Tokenizer,
)
from . import bounds

TRUNCATE_MODES = ("reject", "head", "tail")
PRIORITIES = {p.name.lower(): p for p in Priority}
# Who may call a task: customers on /ws, agents in the console, integrations on the HTTP API. A call
# runs at its caller's priority, never more urgent than the task's own (an agent's waits for customers).
AUDIENCES = ("customers", "agents", "api")
CUSTOMERS, AGENTS, API = AUDIENCES
CALLER_PRIORITY = {"customers": Priority.CUSTOMER, "agents": Priority.ASSIST, "api": Priority.CUSTOMER}
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
DECODING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "max_new_tokens",
    "min_new_tokens",
    "seed",
    "stop",
)


class TaskError(Exception):
    """A request a task cannot take. `code` is stable. `message` says what to change. `param` names the
    client's field at fault, when one is.
    """

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def require_chat_template(tokenizer: Tokenizer) -> None:
    """Raises TaskError where the model's tokenizer has no chat template (many base models' files)."""
    if not getattr(tokenizer, "chat_template", "not a transformers tokenizer: it may render one"):
        raise TaskError(
            "no_chat_template",
            "the model has no chat template: send a plain prompt to /v1/completions, or serve a model"
            " whose tokenizer has one",
        )


@dataclass
class Choices:
    """A closed set of outputs. Each is scored as the log-probability of its verbalizer after the prompt.

    `calibration` lists content-free inputs (e.g. "N/A"). Their mean label scores are subtracted. So the
    model's prior liking for one label word does not decide the answer (contextual calibration).
    """

    labels: dict[str, str]  # output label -> continuation text scored after the prompt
    calibration: list[str] = field(default_factory=list)


@dataclass
class JSONSchema:
    """Generated text that is valid JSON under `schema`. Every token is masked while decoding, so the text
    stays valid. The call's output is the parsed value.
    """

    schema: dict[str, object]

    def format(self) -> OutputFormat:
        return OutputFormat.json_schema(self.schema)


@dataclass
class Regex:
    """Generated text that matches `pattern` (whole), enforced while decoding."""

    pattern: str

    def format(self) -> OutputFormat:
        return OutputFormat.regex(self.pattern)


@dataclass
class Grammar:
    """Generated text in the language of a Lark grammar, enforced while decoding. The dialect is
    llguidance's.
    """

    lark: str

    def format(self) -> OutputFormat:
        return OutputFormat.lark(self.lark)


Output = JSONSchema | Regex | Grammar


@dataclass
class LearnedHead:
    """Labeled examples a scoring task ships. `rtserver fit-heads` fits them into a classifier on hidden
    states.

    Calls then answer from the same forward pass as label scoring, at no extra tokens. A start loads a fit
    whose hash matches, and never fits. The fit is stored in the cache, or in the plugin's `fitted` file.
    Without one, or on a backend without hidden states, the task scores labels.
    """

    examples: str | Path  # the JSONL file; a relative path is relative to the working directory
    labels: dict[str, str] = field(default_factory=dict)  # the file's label -> the task's label
    l2: float = 1e-2  # L2 penalty on the standardised weights (chosen on the dev splits for sentiment)
    use_scores: bool = True  # the calibrated label scores join the hidden features
    min_examples: int = 20  # a prompt with fewer examples (or one label only) keeps label scoring
    fitted: str | Path | None = None  # the fitted heads it ships (.npz, `fit-heads --ship`), or none


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
    decoding: dict[str, object] = field(default_factory=dict)  # defaults, e.g. {"temperature": 0.7}
    overridable: dict[str, tuple[float, float]] = field(default_factory=dict)  # client-settable ranges
    choices: Choices | None = None
    output: Output | None = None  # a generating task's text constrained while decoding
    priority: str = "customer"  # customer | assist | background: who waits for its calls
    # who may call it (AUDIENCES); None: everyone, except customers for a task below customer priority
    audience: tuple[str, ...] | None = None
    samples: int = 1  # a generating task's replies per call, side by side (output {"samples": [...]})
    parser: Callable[[str], dict[str, object]] | None = None
    variants: list[Variant] = field(default_factory=list)
    head: LearnedHead | None = None  # a learned head over hidden states, fitted on shipped examples
    cache_size: int = 0  # 0 = no result cache
    cache_ttl_s: float = 600.0
    max_history_turns: int = 20
    max_history_tokens: int = 1500
    # An assist task on a live conversation of this node: the call's prompt is the conversation as
    # the chat task renders it, then this instruction as a system message ("": none, so the model
    # writes the next reply), so it starts from that session's cached KV. None: always `prompt`.
    conversation_prompt: str | None = None
    # Its replies may be drafted from their own text's n-grams (engine.speculate_max_live): the same
    # output, sooner where it copies from the prompt, as a summary or an extraction does.
    speculate: bool = False

    # -- checks ---------------------------------------------------------------------------------
    def validate(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9_-]{0,39}", self.name or ""):
            raise ValueError(f"name {self.name!r}: use lowercase letters, digits, - or _")
        if self.truncate not in TRUNCATE_MODES:
            raise ValueError(f"truncate {self.truncate!r}: allowed {', '.join(TRUNCATE_MODES)}")
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority {self.priority!r}: allowed {', '.join(PRIORITIES)}")
        if self.audience is not None and (
            not isinstance(self.audience, (tuple, list))
            or not self.audience
            or any(a not in AUDIENCES for a in self.audience)
        ):
            raise ValueError(f"audience {self.audience!r}: a non-empty list of {', '.join(AUDIENCES)}")
        if self.input_kind not in ("text", "chat"):
            raise ValueError(f"input_kind {self.input_kind!r}: allowed text, chat")
        if not self.stateful and self.prompt.count("{text}") != 1:
            raise ValueError("prompt must contain {text} exactly once")
        for key in list(self.decoding) + list(self.overridable):
            if key not in DECODING_KEYS:
                raise ValueError(f"decoding key {key!r}: allowed {', '.join(DECODING_KEYS)}")
        self._validate_overridable()
        _check_choices(self.choices, "choices")
        if self.conversation_prompt is not None and (
            not isinstance(self.conversation_prompt, str) or self.choices is not None or self.stateful
        ):
            raise ValueError("conversation_prompt: a string, on a generating task (no choices, not stateful)")
        if not isinstance(self.speculate, bool):
            raise ValueError(f"speculate {self.speculate!r}: true or false")
        if self.parser is not None and not callable(self.parser):
            raise ValueError("parser must be a function text -> dict")
        if self.choices is not None and self.parser is not None:
            raise ValueError("declare either choices (scoring) or a parser (generation), not both")
        self._validate_output()
        self._validate_head()
        self._validate_variants()
        self._validate_sizes()
        try:
            self.sampling(None)
        except TaskError as exc:
            raise ValueError(f"decoding: {exc.message}") from None

    def _validate_overridable(self) -> None:
        """Each overridable range is (low, high). It lies within what a client may set at all."""
        for key, span in self.overridable.items():
            if (
                not isinstance(span, (tuple, list))
                or len(span) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in span)
                or span[0] > span[1]
            ):
                raise ValueError(f"overridable {key!r}: expected a (low, high) range, got {span!r}")
            widest = bounds.DECODING.get(key, bounds.Bound(True, 0, bounds.SIZES["stop"]))
            if not widest.lo <= span[0] <= span[1] <= widest.hi:
                raise ValueError(
                    f"overridable {key!r}: {tuple(span)!r} is wider than a client may set "
                    f"({widest.lo:g}..{widest.hi:g})"
                )

    def _validate_output(self) -> None:
        """The output format is one of ours and llguidance compiles it."""
        if self.output is None:
            return
        if not isinstance(self.output, (JSONSchema, Regex, Grammar)):
            raise ValueError("output: expected JSONSchema({...}), Regex('...') or Grammar('...')")
        if self.choices is not None:
            raise ValueError("output: a scoring task (with choices) generates no text to constrain")
        if isinstance(self.output, JSONSchema) and not isinstance(self.output.schema, dict):
            raise ValueError("output: JSONSchema takes the schema as a dict")
        fmt = self.output.format()
        why = fmt.problem()
        if why is not None:
            raise ValueError(f"output: {why}")
        try:
            fmt.check()
        except OutputFormatError as exc:
            raise ValueError(f"output: {exc}") from None

    @property
    def callers(self) -> tuple[str, ...]:
        """Who may call the task: its `audience`. The default depends on priority. A customer-priority task
        is open to everyone. A less urgent one (an agent's copilot task) is open to agents and the API.
        """
        if self.audience is not None:
            return tuple(self.audience)
        return AUDIENCES if self.priority == "customer" else ("agents", "api")

    def check_caller(self, caller: str) -> None:
        """Raise `task_not_allowed` unless `caller` (one of AUDIENCES) may call the task."""
        if caller not in self.callers:
            raise TaskError(
                "task_not_allowed",
                f"task {self.name!r} is not available to {caller} (it serves {', '.join(self.callers)})",
            )

    @property
    def output_format(self) -> OutputFormat:
        """What the task's generated text must match (free text without an `output`)."""
        return OutputFormat() if self.output is None else self.output.format()

    def _validate_head(self) -> None:
        if self.head is not None:
            if not isinstance(self.head, LearnedHead) or not isinstance(self.head.examples, (str, Path)):
                raise ValueError("head: expected LearnedHead(examples=path to a JSONL file)")
            if self.head.fitted is not None and not isinstance(self.head.fitted, (str, Path)):
                raise ValueError(f"head.fitted = {self.head.fitted!r}: expected a path to a .npz file")
            if self.choices is None:
                raise ValueError("head: only a scoring task (with choices) can have a learned head")
            if not (isinstance(self.head.l2, (int, float)) and self.head.l2 >= 0):
                raise ValueError(f"head.l2 = {self.head.l2!r}: must be a number >= 0")

    def _validate_variants(self) -> None:
        for i, v in enumerate(self.variants):
            if not isinstance(v, Variant) or not callable(v.when):
                raise ValueError(f"variants[{i}]: expected Variant(when=callable, prompt=...)")
            if not isinstance(v.prompt, str) or v.prompt.count("{text}") != 1:
                raise ValueError(f"variants[{i}]: prompt must contain {{text}} exactly once")
            _check_choices(v.choices, f"variants[{i}].choices")
            if v.choices is not None and self.choices is None:
                raise ValueError(f"variants[{i}]: choices given but the task itself declares none")

    def _validate_sizes(self) -> None:
        """The limits are positive integers; the cache's size and lifetime are sane."""
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or not 1 <= self.samples <= 5:
            raise ValueError(f"samples = {self.samples!r}: an integer 1..5")
        if self.samples > 1 and self.choices is not None:
            raise ValueError("samples: a scoring task (with choices) generates no replies")
        for key in (
            "max_input_chars",
            "max_input_tokens",
            "max_new_tokens",
            "max_history_turns",
            "max_history_tokens",
        ):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} = {value!r}: must be an integer of at least 1")
        if isinstance(self.cache_size, bool) or not isinstance(self.cache_size, int) or self.cache_size < 0:
            raise ValueError(f"cache_size = {self.cache_size!r}: must be an integer >= 0 (0 = no cache)")
        if (
            isinstance(self.cache_ttl_s, bool)
            or not isinstance(self.cache_ttl_s, (int, float))
            or not self.cache_ttl_s > 0
        ):
            raise ValueError(f"cache_ttl_s = {self.cache_ttl_s!r}: must be a number > 0")

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "description": self.description,
            "stateful": self.stateful,
            "input": {
                "type": "object",
                "required": ["text"],
                "properties": {"text": {"type": "string", "maxLength": self.max_input_chars}},
            }
            if self.input_kind == "text"
            else {"type": "object", "required": ["history"], "properties": {"history": {"type": "array"}}},
            "output": "choices" if self.choices else "text",
            "format": self.output_format.describe() if self.output is not None else None,
            "labels": list(self.choices.labels) if self.choices else None,
            "limits": {
                "max_input_tokens": self.max_input_tokens,
                "truncate": self.truncate,
                "max_new_tokens": self.max_new_tokens,
            },
            "decoding": dict(self.decoding),
            "overridable": {k: list(v) for k, v in self.overridable.items()},
            "audience": list(self.callers),
        }

    # -- input --------------------------------------------------------------------------------
    def clean_text(self, text: object) -> str:
        """Strip control characters (keeping newlines and tabs), check emptiness and size."""
        if not isinstance(text, str):
            raise TaskError("invalid_input", f"{self.name}: 'text' must be a string")
        return self._clean(text)

    def _clean(self, text: str) -> str:
        if not text.isprintable():  # printable text has no control/format characters: nothing to strip
            text = "".join(c for c in text if c in "\n\t" or unicodedata.category(c)[0] != "C")
        text = text.strip()
        if not text:
            raise TaskError("empty_text", f"{self.name}: text is empty")
        if len(text) > self.max_input_chars:
            if self.truncate == "reject":
                raise TaskError(
                    "input_too_long",
                    f"{self.name}: text has {len(text)} characters, the limit is {self.max_input_chars}",
                )
            text = text[: self.max_input_chars] if self.truncate == "head" else text[-self.max_input_chars :]
        return text

    def sampling(self, overrides: Mapping[str, object] | None, caller: str | None = None) -> SamplingParams:
        """Decoding for one call. The task's defaults come first, then client overrides within allowed
        ranges. The priority is the caller's where that is less urgent than the task's own.
        """
        priority = PRIORITIES[self.priority]
        if caller is not None:
            priority = max(priority, CALLER_PRIORITY[caller])
        params = SamplingParams(
            max_new_tokens=self.max_new_tokens,
            stop=list(self.stop),
            output=self.output_format,
            priority=priority,
            speculate=self.speculate,
        )
        values = dict(self.decoding)
        if overrides is not None and not isinstance(overrides, dict):
            raise TaskError("bad_decoding", f"{self.name}: decoding options must be an object")
        for key, value in (overrides or {}).items():
            values[key] = self._override(key, value)
        try:  # the values' types too are checked by `validate`
            for key, value in values.items():
                if key not in SAMPLING_FIELDS:
                    raise TypeError(f"SamplingParams has no field {key!r}")
                setattr(params, key, value)
            params.validate()
        except (SamplingError, TypeError) as exc:
            raise TaskError("bad_decoding", f"{self.name}: {exc}") from None
        return params

    def _override(self, key: str, value: object) -> object:
        """A client's decoding value, checked against the task's range for it."""
        if key not in self.overridable:
            allowed = ", ".join(sorted(self.overridable)) or "none"
            raise TaskError("bad_decoding", f"{self.name}: '{key}' cannot be set (settable: {allowed})", key)
        lo, hi = self.overridable[key]
        try:  # the task's range within the widest one any client may set (bounds.DECODING)
            if key == "stop":
                return list(self.stop) + bounds.stop_list(key, value, int(hi))
            return bounds.number(key, value, bounds.DECODING[key], lo, hi)
        except bounds.BoundError as exc:
            raise TaskError("bad_decoding", f"{self.name}: {exc.message}", key) from None

    def variant_of(self, text: str) -> int:
        """Which variant this input selects. Its index, or -1 for the task's own prompt."""
        for i, v in enumerate(self.variants):
            if v.when(text):
                return i
        return -1

    def select(self, text: str) -> tuple[str, Choices | None, bool]:
        """(prompt template, choices, use chat template) for this input."""
        i = self.variant_of(text)
        if i < 0:
            return self.prompt, self.choices, self.chat_template
        v = self.variants[i]
        return (
            v.prompt,
            v.choices if v.choices is not None else self.choices,
            self.chat_template if v.chat_template is None else v.chat_template,
        )


def _check_choices(choices: object, where: str) -> None:
    if choices is None:
        return
    if not isinstance(choices, Choices) or not isinstance(choices.labels, dict):
        raise ValueError(f"{where}: expected Choices(labels={{label: text scored}}, calibration=[...])")
    if len(choices.labels) < 2:
        raise ValueError(f"{where}: need at least two labels")
    for label, words in choices.labels.items():
        if not isinstance(label, str) or not label or not isinstance(words, str) or not words:
            raise ValueError(
                f"{where}: label {label!r} -> {words!r}: labels and the text scored for them "
                "must be non-empty strings"
            )
    if not isinstance(choices.calibration, list) or not all(
        isinstance(c, str) and c for c in choices.calibration
    ):
        raise ValueError(f"{where}: calibration must be a list of non-empty strings")


def has_cjk(text: str) -> bool:
    return any("\u4e00" <= c <= "\u9fff" or "\u3400" <= c <= "\u4dbf" for c in text)


class LabelOutput(TypedDict):
    """A scoring call's output: the best label and every label's probability."""

    label: str
    probs: dict[str, float]


class Timing(TypedDict, total=False):
    """How long a task call took (a scored call has only `total_ms`)."""

    queued_ms: float
    ttft_ms: float | None
    total_ms: float


@dataclass
class TaskOutput:
    """One call's answer as clients get it (`to_json`)."""

    task: str
    output: Mapping[str, object]  # a label and its probabilities, or the parsed reply
    text: str
    usage: dict[str, int]  # token counts (`Usage`'s fields for a generating call)
    timing: Timing
    cached: bool = False

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)
