"""The HTTP doors' request bodies as pydantic models, as protocol.py has for `/ws` frames.

A handler turns its JSON object into one model with `parse`. Fields are checked in the order they
are declared, so the first refused field is the one reported. Each check reads the bounds table
(tasks/bounds.py) and raises `BoundError` naming the field; `parse` turns that into the HTTP error.
Ranges that depend on this server (a task's, `security.api_max_tokens`) come in the context.
Checks that need the model (tokenizing, the prompt's length) stay with the handler.
"""

from __future__ import annotations

import json
from typing import Annotated, ClassVar, NoReturn, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)

from ...engine.backend import TEXT, OutputFormat
from ...tasks import bounds as B
from .common import HTTPError, JSONObject

Message = dict[str, str]  # {"role", "content"}
M = TypeVar("M", bound="Door")


def refuse(param: str, message: str, code: str = "invalid_field") -> NoReturn:
    raise B.BoundError(param, message, code)


class Door(BaseModel):
    """A door's body: a null field is an absent one; unknown fields are ignored unless `ACCEPTED`
    lists every field a body may have. A field in `CHECKED_ABSENT` is checked when absent too."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    ACCEPTED: ClassVar[frozenset[str] | None] = None
    UNKNOWN: ClassVar[str] = "'{}' is not supported here"
    CHECKED_ABSENT: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _known(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        if cls.ACCEPTED is not None:
            unknown = sorted(set(data) - cls.ACCEPTED)
            if unknown:
                refuse(unknown[0], cls.UNKNOWN.format(unknown[0]), "unsupported")
        return {**{name: None for name in cls.CHECKED_ABSENT}, **data}


def parse(model: type[M], body: JSONObject, **context: object) -> M:
    """The body as `model`; the first refused field as an HTTPError naming it."""
    try:
        return model.model_validate(body, context=context)
    except ValidationError as exc:
        raise _http_error(model, exc) from None


def _http_error(model: type[Door], exc: ValidationError) -> HTTPError:
    """One place maps pydantic's errors to ours: a check's BoundError as it is, a missing field."""
    error = exc.errors(include_url=False, include_input=False)[0]
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, B.BoundError):
        return HTTPError(cause.code, cause.message, cause.param)
    name = str(error["loc"][0]) if error["loc"] else "body"
    if error["type"] == "missing":
        examples = model.model_fields[name].examples or []
        hint = f", e.g. {json.dumps({name: examples[0]})}" if examples else ""
        return HTTPError("missing_field", f"'{name}' is required{hint}", name)
    return HTTPError("invalid_field", f"'{name}': {error['msg']}", name)


# -- field checks ------------------------------------------------------------------------------------
Span = tuple[float | None, float | None]


def _context(info: ValidationInfo, key: str) -> object:
    return (info.context or {}).get(key)


def number(field: str | None = None, default: object = None) -> BeforeValidator:
    """A number checked against the bounds table's `field` (the body's key by default), narrowed by
    the context's `ranges` for that field; null is `default`."""

    def check(value: object, info: ValidationInfo) -> object:
        if value is None:
            return default
        name, key = str(info.field_name), field or str(info.field_name)
        ranges = _context(info, "ranges")
        lo, hi = ranges.get(key, (None, None)) if isinstance(ranges, dict) else (None, None)
        return B.number(name, value, B.DECODING[key], lo, hi)

    return BeforeValidator(check)


def flag(nullable: bool = True) -> BeforeValidator:
    """A JSON boolean (never 0/1 or a string), or null where `nullable`."""

    def check(value: object, info: ValidationInfo) -> object:
        return None if value is None and nullable else B.flag(str(info.field_name), value)

    return BeforeValidator(check)


def _short(value: object, info: ValidationInfo) -> object:
    """A string of at most SIZES["short_chars"] characters, or null."""
    name, chars = str(info.field_name), B.SIZES["short_chars"]
    if value is not None and not isinstance(value, str):
        refuse(name, f"'{name}' must be a string")
    if isinstance(value, str) and len(value) > chars:
        refuse(name, f"'{name}' must be a string of at most {chars} characters")
    return value


def _object(value: object, info: ValidationInfo) -> object:
    if value is not None and not isinstance(value, dict):
        refuse(str(info.field_name), f"'{info.field_name}' must be an object")
    return value


def stops(count: str, default: list[str] | None = None) -> BeforeValidator:
    """A string or a list of at most SIZES[count] stop strings; null is `default`."""

    def check(value: object, info: ValidationInfo) -> object:
        if value is None:
            return default
        return B.stop_list(str(info.field_name), value, B.SIZES[count], one_string=True)

    return BeforeValidator(check)


def only_one(why: str) -> BeforeValidator:
    """`n`: one choice per request."""

    def check(value: object) -> object:
        if value is not None and (isinstance(value, bool) or value != 1):
            refuse("n", f"'n' is not supported: {why}", "unsupported")
        return value

    return BeforeValidator(check)


class StreamOptions(BaseModel):
    include_usage: bool = False


def _stream_options(value: object) -> object:
    if value is None:
        return None
    if not isinstance(value, dict):
        refuse("stream_options", "'stream_options' must be an object")
    usage = value.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        refuse("stream_options", "'stream_options.include_usage' must be true or false")
    return {"include_usage": bool(usage)}


def _options(value: object) -> object:
    if value is not None and not isinstance(value, dict):
        refuse("options", "'options' must be an object of decoding settings")
    return value


def _min_tokens(value: object, info: ValidationInfo) -> object:
    """At most the reply's new tokens: the body's, else the context's `max_tokens`."""
    if value is None:
        return None
    asked = info.data.get("max_completion_tokens") or info.data.get("max_tokens")
    most = asked if asked is not None else _context(info, "max_tokens")
    hi = float(most) if isinstance(most, (int, float)) else None
    return int(B.number("min_tokens", value, B.DECODING["min_new_tokens"], 0, hi))


Short = Annotated[str | None, BeforeValidator(_short)]
Flag = Annotated[bool | None, flag()]
Metadata = Annotated[dict[str, object] | None, BeforeValidator(_object)]
Streaming = Annotated[StreamOptions | None, BeforeValidator(_stream_options)]
Options = Annotated[dict[str, object] | None, BeforeValidator(_options)]
MinTokens = Annotated[int | None, BeforeValidator(_min_tokens)]


# -- the OpenAI door ---------------------------------------------------------------------------------
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


# -- the task door -----------------------------------------------------------------------------------
def _history(value: object) -> list[Message]:
    """A user/assistant history ending with a user message, within the size bounds."""
    if not isinstance(value, list) or not value:
        refuse("history", "'history' must be a non-empty list of {role, content} messages", "invalid_input")
    count, chars = B.SIZES["history"], B.SIZES["text_chars"]
    if len(value) > count:
        refuse("history", f"'history' has {len(value)} messages, the limit is {count}", "request_too_large")
    out: list[Message] = []
    total = 0
    for i, m in enumerate(value):
        role = m.get("role") if isinstance(m, dict) else None
        content = m.get("content") if isinstance(m, dict) else None
        if role not in ("user", "assistant") or not isinstance(content, str):
            shape = '{"role": "user"|"assistant", "content": string}'
            refuse("history", f"history[{i}] must be {shape}", "invalid_input")
        total += len(content)
        if total > chars:  # checked before any message is tokenized
            refuse("history", f"'history' has more than {chars} characters of content", "request_too_large")
        out.append({"role": str(role), "content": content})
    if out[-1]["role"] != "user":
        refuse("history", "the last history message must be the user's", "invalid_input")
    return out


History = Annotated[list[Message], BeforeValidator(_history)]


class TaskCall(Door):
    """`POST /v1/tasks/{name}`: one call of a task."""

    input: Annotated[object, Field(examples=[{"text": "..."}], description="the task's input")]
    options: Options = Field(None, description="decoding settings within the task's ranges")


class ChatHistory(Door):
    """`POST /chat`, and a chat task's `input`: one stateless turn over the history given."""

    options: Options = Field(None, description="decoding settings within the chat task's ranges")
    history: History = Field(description="user/assistant messages ending with the user's")


class Sentiment(Door):
    """`POST /sentiment`: the sentiment of one text."""

    text: Annotated[object, Field(description="the text")]


# -- the node door -----------------------------------------------------------------------------------
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
    most = _context(info, "max_tokens")
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


DOORS: dict[str, type[Door]] = {
    "/v1/chat/completions": ChatCompletion,
    "/v1/completions": Completion,
    "/tokenize": Tokenize,
    "/v1/sessions/drop": DropSessions,
    "/v1/tasks/{name}": TaskCall,
    "/sentiment": Sentiment,
    "/chat": ChatHistory,
}
