"""The OpenAI door's body: `/v1/chat/completions` as OpenAI's clients send it (bodies.py: how)."""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import BeforeValidator, ValidationInfo, WithJsonSchema

from ...engine.backend import TEXT, OutputFormat
from ...tasks import bounds as B
from .bodies import (
    Door,
    Flag,
    Message,
    Metadata,
    MinTokens,
    Short,
    Streaming,
    flag,
    number,
    only_one,
    refuse,
    stops,
)


def refused(param: str, why: str) -> BeforeValidator:
    """A field whose truthy value asks for what this server does not do."""

    def check(value: object) -> object:
        if value:
            refuse(param, f"'{param}' is not supported: {why}", "unsupported")
        return value

    return BeforeValidator(check)


def _tool_choice(value: object) -> object:
    if value not in (None, "none"):
        refuse("tool_choice", "'tool_choice' is not supported: tool calling is not available", "unsupported")
    return value


def _logprobs(value: object) -> object:
    if value is not None and B.flag("logprobs", value):
        refuse("logprobs", "'logprobs' is not supported: log-probabilities are not returned", "unsupported")
    return value


def _top_logprobs(value: object) -> object:
    if value is not None and B.number("top_logprobs", value, B.DECODING["top_logprobs"]):
        refuse(
            "top_logprobs",
            "'top_logprobs' is not supported: log-probabilities are not returned",
            "unsupported",
        )
    return value


def _penalty(value: object, info: ValidationInfo) -> object:
    name = str(info.field_name)
    if value is not None and B.number(name, value, B.DECODING[name]) != 0:
        refuse(name, f"'{name}' is not supported: use repetition_penalty instead", "unsupported")
    return value


def _response_format(value: object) -> OutputFormat:
    """`response_format` as an output format: text, any JSON object, or JSON under a schema."""
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "text":
        return TEXT
    if kind == "json_object":
        return OutputFormat.json_object()
    if kind == "json_schema" and isinstance(value, dict):
        spec = value.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            what = "response_format.json_schema must be an object with a 'schema' object"
            refuse("response_format", what)
        out = OutputFormat.json_schema(json.dumps(schema, ensure_ascii=False))
        why = out.problem()
        if why is not None:
            refuse("response_format", f"response_format: {why}", "bad_output_format")
        return out
    refuse("response_format", "response_format.type: allowed text, json_object, json_schema")


def _messages_size(messages: list[object]) -> None:
    """At most SIZES["messages"] messages and SIZES["text_chars"] characters, before any rendering."""
    count, chars = B.SIZES["messages"], B.SIZES["text_chars"]
    if len(messages) > count:
        refuse(
            "messages", f"'messages' has {len(messages)} messages, the limit is {count}", "request_too_large"
        )
    total = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        parts = content if isinstance(content, list) else [content]
        if len(parts) > count:
            refuse("messages", f"a message has more than {count} parts", "request_too_large")
        for part in parts:
            text = part.get("text") if isinstance(part, dict) else part
            total += len(text) if isinstance(text, str) else 0
        if total > chars:
            refuse("messages", f"'messages' has more than {chars} characters of content", "request_too_large")


def _content(m: dict[str, object], i: int) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        refuse("messages", f"messages[{i}].content must be a string or a list of text parts")
    parts = []
    for p in c:
        text = p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None
        if not isinstance(text, str):
            refuse("messages", f"messages[{i}].content: only text parts are supported", "unsupported")
        parts.append(text)
    return "".join(parts)


def _messages(value: object) -> list[Message]:
    """Every message {role, content} with only text; `developer` is `system`."""
    if isinstance(value, list):
        _messages_size(value)
    if not isinstance(value, list) or not value:
        refuse("messages", "'messages' must be a non-empty list")
    out: list[Message] = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            refuse("messages", f"messages[{i}] must be an object")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            roles = "system, developer, user, assistant"
            refuse("messages", f"messages[{i}].role {role!r}: supported roles are {roles}", "unsupported")
        out.append({"role": str(role), "content": _content(m, i)})
    return out


OPENAI_FIELDS = frozenset(
    {
        "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
        "temperature", "top_p", "top_k", "repetition_penalty", "min_tokens", "ignore_eos", "seed",
        "stop", "user", "n", "store", "metadata", "service_tier", "parallel_tool_calls",
        "presence_penalty", "frequency_penalty", "logprobs", "response_format", "tool_choice",
        "tools", "functions", "function_call", "top_logprobs", "logit_bias",
    }
)  # fmt: skip
OPENAI_REFUSED = {"tools", "functions", "function_call", "top_logprobs", "logit_bias"}  # not listed
NO_TOOLS = "tool and function calling are not available"
RESPONSE_FORMAT_SCHEMA = {
    "type": ["object", "null"],
    "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "properties": {"schema": {"type": ["object", "boolean"]}}},
    },
}


class ChatCompletion(Door):
    """`POST /v1/chat/completions`: OpenAI's chat body. The cheap checks come first; the messages
    last, so that no bad request has its messages read. Context: the chat task's `ranges` and its
    `max_tokens`."""

    ACCEPTED = OPENAI_FIELDS
    UNKNOWN = (
        "'{}' is not supported: unknown field for this server (supported: "
        + ", ".join(sorted(OPENAI_FIELDS - OPENAI_REFUSED))
        + ")"
    )
    CHECKED_ABSENT = ("messages",)

    n: Annotated[int | None, only_one("only n = 1 (one choice per request)")] = None
    tools: Annotated[object, refused("tools", NO_TOOLS)] = None
    functions: Annotated[object, refused("functions", NO_TOOLS)] = None
    function_call: Annotated[object, refused("functions", NO_TOOLS)] = None
    tool_choice: Annotated[object, BeforeValidator(_tool_choice)] = None
    logprobs: Annotated[bool | None, BeforeValidator(_logprobs)] = None
    top_logprobs: Annotated[int | None, BeforeValidator(_top_logprobs)] = None
    presence_penalty: Annotated[float | None, BeforeValidator(_penalty)] = None
    frequency_penalty: Annotated[float | None, BeforeValidator(_penalty)] = None
    stream: Flag = None
    store: Flag = None
    parallel_tool_calls: Flag = None
    logit_bias: Annotated[object, refused("logit_bias", "logit bias is not available")] = None
    model: Short = None
    user: Short = None
    service_tier: Short = None
    metadata: Metadata = None
    stream_options: Streaming = None
    temperature: Annotated[float | None, number()] = None
    top_p: Annotated[float | None, number()] = None
    top_k: Annotated[int | None, number()] = None
    repetition_penalty: Annotated[float | None, number()] = None
    seed: Annotated[int | None, number()] = None
    max_tokens: Annotated[int | None, number("max_new_tokens")] = None
    max_completion_tokens: Annotated[int | None, number("max_new_tokens")] = None
    stop: Annotated[list[str] | None, stops("stop")] = None
    min_tokens: MinTokens = None
    ignore_eos: Annotated[bool | None, flag()] = None
    response_format: Annotated[
        OutputFormat, BeforeValidator(_response_format), WithJsonSchema(RESPONSE_FORMAT_SCHEMA)
    ] = TEXT
    messages: Annotated[list[Message], BeforeValidator(_messages)]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def overrides(self) -> dict[str, object]:
        """The chat task's decoding settings this body sets."""
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "max_new_tokens": self.max_completion_tokens or self.max_tokens,
            "stop": self.stop,
        }
        return {key: value for key, value in given.items() if value is not None}
