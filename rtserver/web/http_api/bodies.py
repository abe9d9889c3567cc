"""The HTTP doors' request bodies as pydantic models, as protocol.py has for `/ws` frames: the base
model, `parse`, the field checks the doors share and the task door's bodies (openai_body.py and
node_body.py have the others).

A handler turns its JSON object into one model with `parse`. Fields are checked in the order they
are declared, so the first refused field is the one reported. Each check reads the bounds table
(tasks/bounds.py) and raises `BoundError` naming the field; `parse` turns that into the HTTP error.
Ranges that depend on this server (a task's, `security.api_max_tokens`) come in the context.
Checks that need the tokenizer (a prompt's token ids and length) stay with the handler.
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
    model_validator,
)

from ...tasks import bounds as B
from .common import HTTPError, JSONObject

Message = dict[str, str]  # {"role", "content"}
M = TypeVar("M", bound="Door")


def refuse(param: str, message: str, code: str = "invalid_field") -> NoReturn:
    raise B.BoundError(param, message, code)


class Door(BaseModel):
    """A door's body: a null field is an absent one; unknown fields are ignored unless `ACCEPTED`
    lists every field a body may have. A field in `CHECKED_ABSENT` is checked when absent too."""

    model_config = ConfigDict(arbitrary_types_allowed=True)  # a checked OutputFormat is kept as it is
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
def context_value(info: ValidationInfo, key: str) -> object:
    return (info.context or {}).get(key)


def number(field: str | None = None, default: object = None) -> BeforeValidator:
    """A number checked against the bounds table's `field` (the body's key by default), narrowed by
    the context's `ranges` for that field; null is `default`."""

    def check(value: object, info: ValidationInfo) -> object:
        if value is None:
            return default
        name, key = str(info.field_name), field or str(info.field_name)
        ranges = context_value(info, "ranges")
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
    most = asked if asked is not None else context_value(info, "max_tokens")
    hi = float(most) if isinstance(most, (int, float)) else None
    return int(B.number("min_tokens", value, B.DECODING["min_new_tokens"], 0, hi))


Short = Annotated[str | None, BeforeValidator(_short)]
Flag = Annotated[bool | None, flag()]
Metadata = Annotated[dict[str, object] | None, BeforeValidator(_object)]
Streaming = Annotated[StreamOptions | None, BeforeValidator(_stream_options)]
Options = Annotated[dict[str, object] | None, BeforeValidator(_options)]
MinTokens = Annotated[int | None, BeforeValidator(_min_tokens)]


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
