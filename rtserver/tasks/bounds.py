"""The bounds of every number and size a client may send, in one table that every front door reads.

`DECODING` gives each decoding field its type and widest range; a surface may narrow a range (a task's
`overridable`, `security.api_max_tokens`), never widen it. `SIZES` bounds counts and lengths. `number`,
`flag` and `stop_list` turn a client's value into a checked one or raise `BoundError` naming the field,
so the HTTP API can put it in the error's `param` and the WebSocket error can say it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


class BoundError(ValueError):
    """A client value of the wrong type or out of its range; `param` names the field."""

    def __init__(self, param: str, message: str, code: str = "bad_decoding"):
        super().__init__(message)
        self.param, self.message, self.code = param, message, code


@dataclass(frozen=True)
class Bound:
    """A number's type and range. `above`: `lo` itself is excluded. `tiny`: positive values below it
    are refused, where the engine's float32 arithmetic would overflow or round them to 0."""

    integer: bool
    lo: float
    hi: float
    above: bool = False
    tiny: float = 0.0


DECODING: dict[str, Bound] = {
    "temperature": Bound(False, 0.0, 2.0, tiny=1e-3),  # OpenAI's range; 0 is greedy
    "top_p": Bound(False, 0.0, 1.0, above=True, tiny=1e-6),  # a float32 of 0 would keep no token
    "top_k": Bound(True, 0, 1000),  # 0 = off
    "min_p": Bound(False, 0.0, 1.0),
    "repetition_penalty": Bound(False, 0.05, 10.0),
    "presence_penalty": Bound(False, -2.0, 2.0),
    "frequency_penalty": Bound(False, -2.0, 2.0),
    "max_new_tokens": Bound(True, 1, 1_000_000),  # each surface caps it lower
    "min_new_tokens": Bound(True, 0, 1_000_000),  # and at most max_new_tokens
    "seed": Bound(True, 0, 2**63 - 1),  # what a torch generator takes
    "top_logprobs": Bound(True, 0, 20),
    "logprobs": Bound(True, 0, 5),  # /v1/completions' count (OpenAI's legacy completions)
}

SIZES: dict[str, int] = {
    "stop": 4,  # stop strings from a client (OpenAI's count)
    "node_stop": 16,  # on /v1/completions: a hub sends its task's stops with its client's
    "stop_chars": 256,  # characters in one stop string
    "messages": 256,  # OpenAI chat messages
    "history": 256,  # /chat history messages
    "text_chars": 65536,  # all messages, a history, a text prompt or /tokenize content
    "candidates": 32,  # score_candidates lists
    "candidate_tokens": 64,  # tokens in one candidate
    "candidates_tokens": 1024,  # tokens in all candidates of one request
    "session_chars": 128,  # an rtserver_session key
    "short_chars": 256,  # model, user and other echoed or ignored strings
    "email_chars": 254,  # the e-mail a customer leaves for a person (RFC 5321's longest path)
    "tools": 64,  # functions offered in one request
    "tool_name_chars": 64,  # a function's name (OpenAI's limit)
    "tool_description_chars": 1024,  # a function's description
    "tool_schema_chars": 8192,  # one function's parameters schema, as compact JSON
    "tools_chars": 16384,  # all functions' definitions, as compact JSON (the call grammar holds them)
    "schema_depth": 12,  # nesting of objects and lists in one parameters schema
    "tool_calls": 8,  # calls in one assistant message of a history
    "action_result_bytes": 4096,  # an action handler's result, as JSON
}
# how long an action's handler may run (its declared timeout, rtserver/tasks/actions.py)
ACTION_TIMEOUT_S = Bound(False, 0.05, 60.0)


def _range(bound: Bound, lo: float, hi: float) -> str:
    def show(x: float) -> str:
        return str(int(x)) if bound.integer else f"{x:g}"

    excluded = bound.above and lo == bound.lo
    if bound.tiny and lo <= 0 < bound.tiny <= hi:
        return f"{show(bound.tiny)}..{show(hi)}" if excluded else f"0 or {show(bound.tiny)}..{show(hi)}"
    if excluded:
        return f"greater than {show(lo)} and at most {show(hi)}"
    return f"{show(lo)}..{show(hi)}"


def number(param: str, value: object, bound: Bound, lo: float | None = None, hi: float | None = None) -> Any:
    """`value` checked against `bound`, narrowed to lo..hi: an int for an integer field (an integral
    float such as 4.0 becomes 4), else a float; raises BoundError."""
    lo = bound.lo if lo is None else max(lo, bound.lo)
    hi = bound.hi if hi is None else min(hi, bound.hi)
    kind = "an integer" if bound.integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BoundError(param, f"'{param}' must be {kind} ({_range(bound, lo, hi)})")
    if isinstance(value, float):
        if not math.isfinite(value) or (bound.integer and not value.is_integer()):
            raise BoundError(param, f"'{param}' must be {kind} ({_range(bound, lo, hi)})")
    low_ok = value > lo if bound.above and lo == bound.lo else value >= lo
    if not (low_ok and value <= hi) or 0 < value < bound.tiny:
        shown = f"{value:g}" if isinstance(value, float) else str(value) if abs(value) < 10**24 else "huge"
        raise BoundError(param, f"'{param}' = {shown} is out of range (allowed {_range(bound, lo, hi)})")
    return int(value) if bound.integer else float(value) + 0.0  # + 0.0: -0.0 becomes 0.0


def flag(param: str, value: object) -> bool:
    """A JSON boolean (never 0/1 or a string); raises BoundError."""
    if not isinstance(value, bool):
        raise BoundError(param, f"'{param}' must be true or false", "invalid_field")
    return value


def stop_list(param: str, value: object, count: int, one_string: bool = False) -> list[str]:
    """A list of at most `count` strings of 1..SIZES["stop_chars"] characters (or, with `one_string`,
    a string alone); raises BoundError."""
    chars = SIZES["stop_chars"]
    items = [value] if one_string and isinstance(value, str) else value
    if not (
        isinstance(items, list)
        and len(items) <= count
        and all(isinstance(s, str) and 0 < len(s) <= chars for s in items)
    ):
        raise BoundError(
            param, f"'{param}' must be a list of at most {count} strings of 1..{chars} characters"
        )
    return list(items)


def text(param: str, value: object, chars: int, code: str = "invalid_field") -> str:
    """A string of at most `chars` characters; raises BoundError."""
    if not isinstance(value, str):
        raise BoundError(param, f"'{param}' must be a string", code)
    if len(value) > chars:
        raise BoundError(
            param, f"'{param}' has {len(value)} characters, the limit is {chars}", "request_too_large"
        )
    return value
