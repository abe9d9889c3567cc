"""Built-in `extract`: the fields a deployment cares about (order number, e-mail, product...), read
from a customer's messages as JSON that always validates; a field not mentioned is null.

Options in `[task.extract]`: `fields`, a table of field name -> kind, where a kind is `string`,
`email`, `integer`, `number` or a regular expression (`/^[A-Z]{2}-[0-9]{4}$/`); default
`{order_number = "string", email = "email", product = "string"}`.
"""

import re

from rtserver.tasks import JSONSchema, Task

NAME = "extract"
DEFAULT_FIELDS = {"order_number": "string", "email": "email", "product": "string"}
MAX_CHARS = 120  # per string field


def field_schema(name: str, kind: str) -> dict:
    """One field's schema: its kind, or null when the message does not say."""
    if kind == "string":
        value: dict = {"type": "string", "minLength": 1, "maxLength": MAX_CHARS}
    elif kind == "email":
        value = {"type": "string", "format": "email", "maxLength": MAX_CHARS}
    elif kind in ("integer", "number"):
        value = {"type": kind}
    elif len(kind) > 2 and kind.startswith("/") and kind.endswith("/"):
        try:
            re.compile(kind[1:-1])
        except re.error as exc:
            raise ValueError(f"fields.{name}: {kind!r} is not a regular expression ({exc})") from None
        value = {"type": "string", "pattern": kind[1:-1], "maxLength": MAX_CHARS}
    else:
        raise ValueError(f"fields.{name} = {kind!r}: allowed string, email, integer, number or /regex/")
    return {"anyOf": [value, {"type": "null"}]}


def make_task(options: dict) -> Task:
    fields = options.pop("fields", DEFAULT_FIELDS)
    if options:
        raise ValueError(f"unknown settings: {', '.join(sorted(options))} (known: fields)")
    if not isinstance(fields, dict) or not fields or len(fields) > 20:
        raise ValueError("fields: a table of 1..20 field name -> kind")
    for name, kind in fields.items():
        if not re.fullmatch(r"[a-z][a-z0-9_]{0,39}", name) or not isinstance(kind, str):
            raise ValueError(f"fields.{name}: a lowercase name and a kind (string, email, ...)")
    schema = {
        "type": "object",
        "properties": {name: field_schema(name, kind) for name, kind in fields.items()},
        "required": list(fields),
        "additionalProperties": False,
    }
    names = ", ".join(fields)
    return Task(
        name=NAME,
        description=f"Fields from the customer's messages as JSON ({names}); null where not given.",
        prompt=f"Read the customer's messages and give these fields as JSON ({names}); "
        "use null for a field that is not mentioned.\n\n{text}",
        max_input_chars=8000,
        max_input_tokens=1024,
        truncate="tail",
        max_new_tokens=len(fields) * 48 + 16,
        output=JSONSchema(schema),
        priority="assist",
        audience=("agents",),  # the agents' copilot: never a customer's call
        speculate=True,  # it quotes the conversation: drafts from it pay
    )
