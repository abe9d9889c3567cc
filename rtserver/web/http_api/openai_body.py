"""The OpenAI door's body: `/v1/chat/completions` as OpenAI's clients send it (bodies.py: how).

Tool calling: `tools` and `tool_choice` are read by tasks/tool_calls.py. Messages may be `tool`
results and assistant messages with `tool_calls`; each result answers an earlier call by its id, and
each call names one of `tools`.
"""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import BeforeValidator, Field, ValidationInfo, WithJsonSchema

from ...engine.backend import TEXT, OutputFormat
from ...tasks import bounds as B
from ...tasks.tool_calls import NONE, ChatMessage, Tool, ToolCall, ToolChoice, read_choice, read_tools
from .bodies import (
    Door,
    Flag,
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


def _tools(value: object) -> list[Tool]:
    return read_tools(value)


def _tool_choice(value: object, info: ValidationInfo) -> ToolChoice:
    tools = info.data.get("tools")
    return read_choice(value, tools if isinstance(tools, list) else [])


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
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        total += len(json.dumps(calls)) if isinstance(calls, list) else 0
        if total > chars:
            refuse("messages", f"'messages' has more than {chars} characters of content", "request_too_large")


def _content(m: dict[str, object], i: int) -> str:
    c = m.get("content")
    if c is None and m.get("role") == "assistant" and m.get("tool_calls"):
        return ""  # a message of calls alone
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


def _short_id(value: object, where: str) -> str:
    chars = B.SIZES["short_chars"]
    if not isinstance(value, str) or not 0 < len(value) <= chars:
        refuse("messages", f"{where} must be a string of 1..{chars} characters")
    return value


def _tool_calls(value: object, i: int, tools: list[Tool]) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls`: each names one of `tools`, its arguments a JSON object."""
    if value is None:
        return ()
    most = B.SIZES["tool_calls"]
    if not isinstance(value, list) or not 0 < len(value) <= most:
        refuse("messages", f"messages[{i}].tool_calls must be a list of 1..{most} calls")
    calls = []
    for j, call in enumerate(value):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or call.get("type", "function") != "function"
            or not isinstance(fn, dict)
        ):
            refuse(
                "messages",
                f'{where} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}',
            )
        name, arguments = fn.get("name"), fn.get("arguments")
        if not any(t.name == name for t in tools):
            shown = json.dumps(name)[:80] if isinstance(name, str) else "missing"
            refuse("messages", f"{where}.function.name {shown} is not one of 'tools'")
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else None
        except ValueError:
            args = None
        if not isinstance(args, dict):
            refuse("messages", f"{where}.function.arguments must be a JSON object in a string")
        calls.append(ToolCall(str(name), str(arguments), _short_id(call.get("id"), f"{where}.id")))
    return tuple(calls)


def _messages(value: object, info: ValidationInfo) -> list[ChatMessage]:
    """Every message with only text; `developer` is `system`. A `tool` message answers a call."""
    if isinstance(value, list):
        _messages_size(value)
    if not isinstance(value, list) or not value:
        refuse("messages", "'messages' must be a non-empty list")
    given = info.data.get("tools")
    tools = given if isinstance(given, list) else []
    out: list[ChatMessage] = []
    pending: set[str] = set()  # ids of calls not answered yet
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            refuse("messages", f"messages[{i}] must be an object")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            roles = "system, developer, user, assistant, tool"
            refuse("messages", f"messages[{i}].role {role!r}: supported roles are {roles}", "unsupported")
        calls = _tool_calls(m.get("tool_calls"), i, tools) if role == "assistant" else ()
        call_id = ""
        if role == "tool":
            call_id = _short_id(m.get("tool_call_id"), f"messages[{i}].tool_call_id")
            if call_id not in pending:
                shown = json.dumps(call_id)[:80]
                refuse(
                    "messages", f"messages[{i}].tool_call_id {shown} answers no earlier assistant tool call"
                )
            pending.discard(call_id)
        pending.update(c.id for c in calls)
        out.append(ChatMessage(str(role), _content(m, i), calls, call_id))
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
OPENAI_REFUSED = {"functions", "function_call", "top_logprobs", "logit_bias"}  # not listed
NO_FUNCTIONS = "use 'tools' and 'tool_choice'"
RESPONSE_FORMAT_SCHEMA = {
    "type": ["object", "null"],
    "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "properties": {"schema": {"type": ["object", "boolean"]}}},
    },
}


TOOLS_SCHEMA = {
    "type": ["array", "null"],
    "maxItems": B.SIZES["tools"],
    "items": {
        "type": "object",
        "properties": {
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                    "description": {"type": "string"},
                    "parameters": {"type": "object"},
                    "strict": {"type": ["boolean", "null"]},
                },
                "required": ["name"],
            },
        },
        "required": ["type", "function"],
    },
}
TOOL_CHOICE_SCHEMA = {
    "anyOf": [
        {"enum": ["auto", "none", "required", None]},
        {"type": "object", "properties": {"type": {"const": "function"}, "function": {"type": "object"}}},
    ]
}
MESSAGES_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "maxItems": B.SIZES["messages"],
    "items": {
        "type": "object",
        "properties": {
            "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": {"type": ["string", "array", "null"]},
            "tool_calls": {"type": "array"},
            "tool_call_id": {"type": "string"},
        },
        "required": ["role"],
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
    CHECKED_ABSENT = ("tool_choice", "messages")

    n: Annotated[int | None, only_one("only n = 1 (one choice per request)")] = None
    tools: Annotated[list[Tool], BeforeValidator(_tools), WithJsonSchema(TOOLS_SCHEMA)] = []
    functions: Annotated[object, refused("functions", NO_FUNCTIONS)] = None
    function_call: Annotated[object, refused("function_call", NO_FUNCTIONS)] = None
    tool_choice: Annotated[ToolChoice, BeforeValidator(_tool_choice), WithJsonSchema(TOOL_CHOICE_SCHEMA)] = (
        Field(NONE, json_schema_extra={"default": None})
    )
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
    messages: Annotated[list[ChatMessage], BeforeValidator(_messages), WithJsonSchema(MESSAGES_SCHEMA)]

    @property
    def calls(self) -> bool:
        """Whether the reply may be a call: functions offered and `tool_choice` not `none`."""
        return bool(self.tools) and self.tool_choice.mode != "none"

    @property
    def tool_chat(self) -> bool:
        """Whether the prompt needs tool calling's rendering (functions, calls or results)."""
        return self.calls or any(m.tool_calls or m.role == "tool" for m in self.messages)

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
