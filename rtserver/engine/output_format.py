"""What a generation's text must match: `OutputFormat` (free text, a JSON Schema, any JSON object, a
regex or a Lark grammar) and its llguidance grammar.

The format is plain data that crosses the inference seam. Compiling it against a tokenizer is the
engine's (`grammar.py`); here it is only checked, which needs no tokenizer.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass

KINDS = ("text", "json_schema", "json_object", "regex", "lark")
MAX_SOURCE_CHARS = 32_768  # a schema or grammar; the compile cost grows with it
# Compact JSON: a small model given free whitespace often fills the object with newlines.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class OutputFormatError(ValueError):
    """A format that cannot be compiled; the message says why, in the grammar engine's words."""


@dataclass(frozen=True)
class OutputFormat:
    """The shape a generation's text must have, enforced token by token while decoding."""

    kind: str = "text"
    source: str = ""  # the schema as JSON text, the regex or the Lark grammar

    @classmethod
    def json_schema(cls, schema: Mapping[str, object] | str) -> OutputFormat:
        text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
        return cls("json_schema", text)

    @classmethod
    def json_object(cls) -> OutputFormat:
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> OutputFormat:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> OutputFormat:
        return cls("lark", grammar)

    @property
    def free(self) -> bool:
        return self.kind == "text"

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_schema", "json_object")

    def problem(self) -> str | None:
        """Why this value is no format at all (wrong kind, size, or schema text), else None."""
        if self.kind not in KINDS:
            return f"kind {self.kind!r}: allowed {', '.join(KINDS)}"
        if not isinstance(self.source, str) or len(self.source) > MAX_SOURCE_CHARS:
            return f"the {self.kind} must be a string of at most {MAX_SOURCE_CHARS} characters"
        if self.kind in ("regex", "lark") and not self.source:
            return f"the {self.kind} is empty"
        return _schema_problem(self.source) if self.kind == "json_schema" else None

    def grammar(self) -> str:
        """llguidance's grammar for this format; raises OutputFormatError."""
        return _grammar(self)

    def check(self) -> None:
        """Raise OutputFormatError unless llguidance compiles this format (no tokenizer needed)."""
        from llguidance import LLMatcher

        if self.free:
            return
        error = LLMatcher.validate_grammar(self.grammar())
        if error:
            raise OutputFormatError(f"{self.kind}: {error}")

    def describe(self) -> dict[str, object]:
        """The format as a task's description shows it."""
        if self.is_json:
            return {"type": self.kind, "schema": json.loads(self.source) if self.source else {}}
        return {"type": self.kind, "source": self.source}


TEXT = OutputFormat()


@functools.lru_cache(maxsize=256)
def _schema_problem(source: str) -> str | None:
    """Why a schema text is no JSON Schema, else None; parsed once per text (every call checks it)."""
    try:
        schema = json.loads(source)
    except ValueError as exc:
        return f"the JSON Schema is not JSON ({exc})"
    if not isinstance(schema, (dict, bool)):
        return "a JSON Schema is an object (or true / false)"
    return None


@functools.lru_cache(maxsize=256)
def _grammar(fmt: OutputFormat) -> str:
    from llguidance import LLMatcher

    why = fmt.problem()
    if why is not None:
        raise OutputFormatError(f"output format: {why}")
    try:
        if fmt.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(fmt.source, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
        if fmt.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
        if fmt.kind == "regex":
            return LLMatcher.grammar_from_regex(fmt.source)
        if fmt.kind == "lark":
            return LLMatcher.grammar_from_lark(fmt.source)
    except ValueError as exc:
        raise OutputFormatError(f"{fmt.kind}: {exc}") from None
    raise OutputFormatError("free text has no grammar")
