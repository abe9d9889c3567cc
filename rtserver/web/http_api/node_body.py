"""The node door's bodies: `/v1/completions`, `/tokenize` and `/v1/sessions/drop`, as a hub sends
them (bodies.py: how)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field, ValidationInfo

from ...tasks import bounds as B
from .bodies import (
    Door,
    Flag,
    MinTokens,
    Short,
    Streaming,
    context_value,
    flag,
    number,
    only_one,
    refuse,
    stops,
)


def _session_key(value: object) -> object:
    chars = B.SIZES["session_chars"]
    if value is not None and not (isinstance(value, str) and 0 < len(value) <= chars):
        refuse("rtserver_session", f"'rtserver_session' must be a string of 1..{chars} characters")
    return value


def _completion_logprobs(value: object) -> object:
    if value is not None and value is not False:
        if B.number("logprobs", value, B.DECODING["logprobs"]):
            why = "log-probabilities are not returned (score_candidates gives those of given continuations)"
            refuse("logprobs", f"'logprobs' is not supported: {why}", "unsupported")
    return value


def _top_k(value: object) -> object:
    if value == -1 and not isinstance(value, bool):
        return 0  # vLLM's spelling of "off"
    return 0 if value is None else B.number("top_k", value, B.DECODING["top_k"])


def _repeat_penalty(value: object, info: ValidationInfo) -> object:
    """llama-server's name, read only without `repetition_penalty`."""
    if value is None or info.data.get("repetition_penalty") is not None:
        return 1.0
    return B.number("repeat_penalty", value, B.DECODING["repetition_penalty"])


def _new_tokens(value: object, info: ValidationInfo) -> object:
    """`max_tokens` within the context's `max_tokens`; 16 at most when absent."""
    most = context_value(info, "max_tokens")
    hi = float(most) if isinstance(most, (int, float)) else None
    if value is None:
        return min(16, int(hi)) if hi is not None else 16
    return B.number("max_tokens", value, B.DECODING["max_new_tokens"], None, hi)


class Completion(Door):
    """`POST /v1/completions`: a node's completion over token ids (or text), or candidates scored.

    node.py checks the prompt, `rtserver_public_tokens` and `score_candidates` against the model's
    vocabulary. Context: `max_tokens`, the most a request may ask for."""

    ACCEPTED = frozenset(
        {
            "model", "prompt", "stream", "stream_options", "max_tokens", "temperature", "top_p",
            "top_k", "min_p", "repetition_penalty", "repeat_penalty", "min_tokens", "seed", "stop",
            "ignore_eos", "logprobs", "return_token_ids", "cache_prompt", "score_candidates",
            "rtserver_session", "rtserver_public_tokens", "n", "user",
        }
    )  # fmt: skip
    UNKNOWN = "'{}' is not supported by /v1/completions here"
    CHECKED_ABSENT = ("max_tokens",)

    n: Annotated[int | None, only_one("only n = 1")] = None
    stream: Flag = None
    return_token_ids: Flag = None
    cache_prompt: Flag = None
    logprobs: Annotated[object, BeforeValidator(_completion_logprobs)] = None
    model: Short = None
    user: Short = None
    stream_options: Streaming = None
    rtserver_session: Annotated[str | None, BeforeValidator(_session_key)] = None
    stop: Annotated[list[str], stops("node_stop", [])] = []
    min_p: Annotated[float, number(default=0.0)] = 0.0  # accepted for llama-server's and vLLM's clients
    repetition_penalty: Annotated[float | None, number()] = None
    max_tokens: Annotated[int, BeforeValidator(_new_tokens)]
    temperature: Annotated[float, number(default=1.0)] = 1.0
    top_p: Annotated[float, number(default=1.0)] = 1.0
    top_k: Annotated[int, BeforeValidator(_top_k)] = 0
    min_tokens: MinTokens = None
    repeat_penalty: Annotated[float, BeforeValidator(_repeat_penalty)] = 1.0
    seed: Annotated[int | None, number()] = None
    ignore_eos: Annotated[bool, flag(nullable=False)] = False
    prompt: Annotated[object, Field(description="token ids, or a text")] = None
    rtserver_public_tokens: Annotated[object, Field(description="an integer 0..the prompt's length")] = None
    score_candidates: Annotated[object, Field(description="1..32 lists of 1..64 token ids")] = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _content_text(value: object) -> object:
    return B.text("content", value, B.SIZES["text_chars"])


class Tokenize(Door):
    """`POST /tokenize` (llama-server's): a text's token ids."""

    CHECKED_ABSENT = ("content",)

    content: Annotated[str, BeforeValidator(_content_text)]
    add_special: Annotated[bool, flag(nullable=False)] = False


MAX_DROPS = 256  # keys in one request


def _session_keys(value: object) -> object:
    chars = B.SIZES["session_chars"]
    if not (
        isinstance(value, list)
        and 0 < len(value) <= MAX_DROPS
        and all(isinstance(k, str) and 0 < len(k) <= chars for k in value)
    ):
        what = f"a list of 1..{MAX_DROPS} strings of 1..{chars} characters"
        refuse("rtserver_sessions", f"'rtserver_sessions' must be {what}")
    return value


class DropSessions(Door):
    """`POST /v1/sessions/drop`: the hub's session keys whose kept KV to free."""

    CHECKED_ABSENT = ("rtserver_sessions",)

    rtserver_sessions: Annotated[list[str], BeforeValidator(_session_keys)]
