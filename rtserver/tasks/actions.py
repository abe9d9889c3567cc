"""Actions: what the bot may do on a business's own systems, as a plugin declares it.

An `Action` has a name, a description, its parameters as a JSON Schema and an async handler (typically an
HTTP call) with a timeout. A `Rule` says when it runs without a model call: an intent plus fields read
from the customer's message by regular expressions. `call` validates the arguments against the schema,
runs the handler within its timeout and turns the outcome into the customer's sentence.

Arguments never come from text a customer typed as a call: `looks_like_call` refuses such messages, and
only a rule's fields or a grammar-constrained model call give arguments. How a turn runs them:
rtserver/web/bot_actions.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import string
import time
import unicodedata
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import jsonschema

from . import bounds
from .tool_calls import check_tool

Arguments = dict[str, object]
Result = dict[str, object]
Handler = Callable[[Arguments], Awaitable[Mapping[str, object]]]
ReplyFn = Callable[[Arguments, Result], str]
Status = Literal["ok", "timeout", "failed", "invalid_arguments", "invalid_result", "limited"]

NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")
MAX_VALUE_CHARS = 200  # of one argument or result value put in a reply
FAILED_REPLY = "Sorry, I could not look that up right now. Please try again in a moment."
TIMEOUT_REPLY = "Sorry, our system is taking too long to answer. Please try again in a few minutes."
INVALID_REPLY = "Sorry, I could not read that. Could you check it and send it again?"
LIMITED_REPLY = "Sorry, I cannot look that up again right now. A person can help you with it."
# Markup of tool calls in the chat templates rtserver knows, JSON call fields, and call-like syntax.
# A customer message with any of these never runs an action.
CALL_MARKUP = re.compile(
    r"<\s*/?\s*tool_call|<\|python_tag\|>|\[TOOL_CALLS\]|<\|?tool|<\s*/?\s*function"
    r"|\"(?:name|arguments|function|tool_calls|parameters)\"\s*:|\btool_calls?\b|\bfunction_call\b",
    re.IGNORECASE,
)


class ActionError(ValueError):
    """A declaration that cannot be used, naming the action and what is wrong."""


@dataclass(frozen=True)
class Rule:
    """When an action runs without a model call.

    Every field the schema requires must be found in the message: `fields` maps an argument to a regular
    expression (its first group, else the whole match, is the value). Then `words`, a regular expression on
    the message, fires it; or else the `intent` task's label must be in `intents`. With neither, the fields
    alone fire it. `unless`, a regular expression, keeps it from firing (another request about the same
    thing, e.g. a refund). `upper` names fields uppercased once read.
    """

    fields: Mapping[str, str]
    intents: tuple[str, ...] = ()
    words: str | None = None
    upper: tuple[str, ...] = ()
    unless: str | None = None

    def extract(self, text: str) -> Arguments:
        """The fields found in `text`, as strings."""
        found: Arguments = {}
        for name, pattern in self.fields.items():
            match = re.search(pattern, text)
            if match is None:
                continue
            value = match.group(1) if match.re.groups else match.group(0)
            if value:
                found[name] = value.upper() if name in self.upper else value
        return found

    def words_match(self, text: str) -> bool:
        return self.words is not None and re.search(self.words, text, re.IGNORECASE) is not None

    def excluded(self, text: str) -> bool:
        return self.unless is not None and re.search(self.unless, text, re.IGNORECASE) is not None


@dataclass(frozen=True)
class Action:
    """What the bot may do, as a plugin declares it. `reply` makes the customer's sentence from the
    arguments and the result: a `str.format` template over both (result keys win), or a function.
    """

    name: str
    description: str
    parameters: dict[str, object]
    handler: Handler
    timeout_s: float = 5.0
    rule: Rule | None = None
    reply: str | ReplyFn = ""
    failed_reply: str = FAILED_REPLY
    timeout_reply: str = TIMEOUT_REPLY
    invalid_reply: str = INVALID_REPLY  # the rule read arguments the schema refuses
    validator: jsonschema.protocols.Validator = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()
        checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
        object.__setattr__(
            self, "validator", jsonschema.Draft202012Validator(self.parameters, format_checker=checker)
        )

    def validate(self) -> None:
        """Raise ActionError where the declaration cannot be used."""
        if not isinstance(self.name, str) or not NAME.fullmatch(self.name):
            raise ActionError(f"action {self.name!r}: a name of 1..40 lowercase letters, digits and _")
        where = f"action {self.name}"
        if not isinstance(self.description, str) or not 0 < len(self.description) <= 1000:
            raise ActionError(f"{where}: a description of 1..1000 characters")
        if not callable(self.handler):
            raise ActionError(f"{where}: handler must be an async function")
        try:
            bounds.number("timeout_s", self.timeout_s, bounds.ACTION_TIMEOUT_S)
        except bounds.BoundError as exc:
            raise ActionError(f"{where}: {exc.message}") from None
        self._check_schema(where)
        if self.rule is not None:
            self._check_rule(where, self.rule)
        if isinstance(self.reply, str):
            _check_template(where, self.reply)
        elif not callable(self.reply):
            raise ActionError(f"{where}: reply must be a template string or a function")

    def _check_schema(self, where: str) -> None:
        """The parameters as a model's tool takes them (size, depth, $refs, llguidance), and valid."""
        schema = self.parameters
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise ActionError(f"{where}: parameters must be a JSON Schema of type object")
        try:
            check_tool(self.name, self.description, schema, "parameters", where)
        except bounds.BoundError as exc:
            raise ActionError(exc.message) from None
        except (TypeError, ValueError):
            raise ActionError(f"{where}: parameters must be JSON") from None
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise ActionError(f"{where}: parameters are not a valid JSON Schema ({exc.message})") from None

    def _check_rule(self, where: str, rule: Rule) -> None:
        properties = self.properties
        for name, pattern in rule.fields.items():
            if name not in properties:
                raise ActionError(f"{where}: rule field {name!r} is not one of the parameters")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ActionError(f"{where}: rule field {name!r}: not a regular expression ({exc})") from None
        missing = [n for n in self.required if n not in rule.fields]
        if missing:
            raise ActionError(f"{where}: the rule reads no value for the required {', '.join(missing)}")
        for key, optional in (("words", rule.words), ("unless", rule.unless)):
            try:
                re.compile(optional or "")
            except re.error as exc:
                raise ActionError(f"{where}: rule {key}: not a regular expression ({exc})") from None
        if not all(isinstance(i, str) for i in rule.intents):
            raise ActionError(f"{where}: rule intents must be labels (strings)")

    @property
    def properties(self) -> dict[str, object]:
        props = self.parameters.get("properties")
        return props if isinstance(props, dict) else {}

    @property
    def required(self) -> list[str]:
        req = self.parameters.get("required")
        return [r for r in req if isinstance(r, str)] if isinstance(req, list) else []

    def argument_errors(self, arguments: object) -> list[str]:
        """What makes `arguments` invalid under the schema (none: valid)."""
        return [
            f"{'.'.join(str(p) for p in e.absolute_path) or '(arguments)'}: {e.message}"[:200]
            for e in self.validator.iter_errors(arguments)
        ][:5]


@dataclass(frozen=True)
class Outcome:
    """One action call as it ended. `error` is for agents (the console), `reply` for the customer."""

    action: str
    arguments: Arguments
    status: Status
    reply: str
    result: Result | None = None
    error: str | None = None
    ms: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> dict[str, object]:
        return {
            "action": self.action,
            "arguments": self.arguments,
            "status": self.status,
            "result": self.result,
            "error": self.error,
            "ms": round(self.ms, 1),
        }


def looks_like_call(text: str, names: tuple[str, ...] = ()) -> bool:
    """Whether a message looks like a tool call, or names an action: such text never runs one."""
    if CALL_MARKUP.search(text):
        return True
    lowered = text.lower()
    return any(name in lowered for name in names)


async def call(action: Action, arguments: Arguments) -> Outcome:
    """Run `action` on `arguments`: checked against its schema, the handler within its timeout, the
    result checked. Never raises: every way it can fail is an Outcome with a sentence for the customer.
    """
    errors = action.argument_errors(arguments)
    if errors:
        return Outcome(
            action.name, arguments, "invalid_arguments", action.invalid_reply, error="; ".join(errors)
        )
    start = time.monotonic()

    def ended(status: Status, reply: str, result: Result | None = None, error: str | None = None) -> Outcome:
        ms = (time.monotonic() - start) * 1000
        return Outcome(action.name, arguments, status, reply, result, error, ms)

    try:
        raw = await asyncio.wait_for(action.handler(dict(arguments)), action.timeout_s)
    except TimeoutError:
        return ended("timeout", action.timeout_reply, error=f"no answer within {action.timeout_s:g} s")
    except Exception as exc:  # the handler's own failure: the customer gets a sentence, agents the cause
        return ended("failed", action.failed_reply, error=_describe(exc))
    result, why = _checked_result(raw)
    if result is None:
        return ended("invalid_result", action.failed_reply, error=why)
    try:
        reply = reply_text(action, arguments, result)
    except Exception as exc:
        return ended("invalid_result", action.failed_reply, result, f"reply: {_describe(exc)}")
    return ended("ok", reply, result)


def reply_text(action: Action, arguments: Arguments, result: Result) -> str:
    """The customer's sentence for a result. Values are cleaned and cut to MAX_VALUE_CHARS each."""
    if callable(action.reply):
        text = action.reply(dict(arguments), dict(result))
        if not isinstance(text, str):
            raise TypeError("the reply function must return a string")
    elif action.reply:
        values = {k: _shown(v) for k, v in {**arguments, **result}.items()}
        text = action.reply.format_map(values)
    else:
        shown = ", ".join(f"{k}: {_shown(v)}" for k, v in result.items())
        text = f"Here is what I found: {shown}." if shown else action.failed_reply
    return _clean(text, 2000)


def _checked_result(raw: object) -> tuple[Result | None, str]:
    """The handler's result as a JSON object within its size bound, or None and why not."""
    if not isinstance(raw, Mapping):
        return None, f"the handler returned {type(raw).__name__}, not a mapping"
    try:
        encoded = json.dumps(dict(raw), allow_nan=False)
    except (TypeError, ValueError) as exc:
        return None, f"the result is not JSON ({exc})"[:200]
    limit = bounds.SIZES["action_result_bytes"]
    if len(encoded.encode()) > limit:
        return None, f"the result takes {len(encoded.encode())} bytes, the limit is {limit}"
    loaded = json.loads(encoded)
    return (loaded, "") if isinstance(loaded, dict) else (None, "the result is not an object")


def _shown(value: object) -> str:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return _clean(text, MAX_VALUE_CHARS)


def _clean(text: str, limit: int) -> str:
    """Control characters out, cut to `limit` characters."""
    if not text.isprintable():
        text = "".join(c if unicodedata.category(c)[0] != "C" else " " for c in text)
    return text.strip()[:limit]


def _describe(exc: BaseException) -> str:
    return _clean(f"{type(exc).__name__}: {exc}", 300)


def _check_template(where: str, template: str) -> None:
    """A reply template's fields must be plain names: no attribute or index lookups."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ActionError(f"{where}: reply template: {exc}") from None
    for _, name, _, _ in parsed:
        if name is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ActionError(f"{where}: reply template field {{{name}}}: only plain names")
