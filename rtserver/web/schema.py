"""The doors' JSON Schemas, generated from their models so that they cannot drift from them.

- `/ws`: the client message models (protocol.py) and the server events (events.py), served at
  GET /v1/protocol.schema.json;
- the HTTP API: the request body models (http_api/bodies.py), one per door, at GET /v1/http.schema.json;
- `/ws/console`: the agent frames (console/frames.py) and events (console/events.py), at
  GET /v1/console.schema.json.
"""

from __future__ import annotations

import functools
from typing import Annotated

from pydantic import Field, TypeAdapter
from pydantic.json_schema import models_json_schema

from .console.events import ConsoleServerEvent
from .console.frames import AGENT_FRAME
from .events import ServerEvent
from .http_api import BODIES
from .protocol import CLIENT_MESSAGE, MAX_JSON_DEPTH, PROTOCOL_VERSION


@functools.cache
def protocol_schema() -> dict[str, object]:
    """The protocol's JSON Schema (2020-12), generated from the models above (GET /v1/protocol.schema.json).

    The document itself validates a client frame (a oneOf over `type`); `$defs/ServerEvent` validates
    a server event. What a schema cannot say is in the description: JSON is I-JSON within 100 levels.
    Built once and shared: do not change the dict."""
    client = CLIENT_MESSAGE.json_schema()
    server = TypeAdapter(Annotated[ServerEvent, Field(discriminator="type")]).json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"urn:rtserver:protocol:{PROTOCOL_VERSION}",
        "title": f"rtserver WebSocket protocol {PROTOCOL_VERSION}",
        "description": (
            "One JSON text frame per message. This document validates a client -> server frame; "
            "#/$defs/ServerEvent a server -> client event. Frames are I-JSON (RFC 7493: no NaN/Infinity, "
            f"numbers within a double's range, no unpaired surrogate) nested at most {MAX_JSON_DEPTH} "
            "levels deep. Unknown fields are ignored. Reference: docs/protocol.md."
        ),
        "version": PROTOCOL_VERSION,
        "oneOf": client["oneOf"],
        "discriminator": client["discriminator"],
        "$defs": {
            **client["$defs"],
            **server["$defs"],
            "ServerEvent": {"oneOf": server["oneOf"], "discriminator": server["discriminator"]},
        },
    }


@functools.cache
def http_schema() -> dict[str, object]:
    """The HTTP API's request bodies as JSON Schema (2020-12), one per door (GET /v1/http.schema.json).

    `doors` maps each path to its body's `$defs` entry. What a schema cannot say is in the
    description. Built once and shared: do not change the dict."""
    models = [(model, "validation") for model in BODIES.values()]
    refs, defs = models_json_schema(models, ref_template="#/$defs/{model}")  # type: ignore[arg-type]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"urn:rtserver:http:{PROTOCOL_VERSION}",
        "title": f"rtserver HTTP API request bodies {PROTOCOL_VERSION}",
        "description": (
            "One JSON object per POST body, sent as application/json. `doors` maps each path to its "
            "body's schema. Bodies are I-JSON nested at most "
            f"{MAX_JSON_DEPTH} levels deep; null is the same as absent. A refused field is a 4xx "
            "JSON error naming it in `param`. Reference: docs/protocol.md."
        ),
        "version": PROTOCOL_VERSION,
        "doors": {path: refs[(model, "validation")] for path, model in BODIES.items()},
        "$defs": defs["$defs"],
    }


@functools.cache
def console_schema() -> dict[str, object]:
    """The agent console's JSON Schema (2020-12), as the protocol's (GET /v1/console.schema.json).

    The document validates an agent's frame; `$defs/ConsoleServerEvent` an event of the console's
    own (errors, pong and handover are `/ws`'s). Built once and shared: do not change the dict."""
    frames = AGENT_FRAME.json_schema()
    server = TypeAdapter(Annotated[ConsoleServerEvent, Field(discriminator="type")]).json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"urn:rtserver:console:{PROTOCOL_VERSION}",
        "title": f"rtserver agent console protocol {PROTOCOL_VERSION}",
        "description": (
            "One JSON text frame per message on /ws/console, under the rules of /ws. This document "
            "validates an agent -> server frame; #/$defs/ConsoleServerEvent a server -> agent event. "
            "The server checks each value itself. Reference: docs/protocol.md."
        ),
        "version": PROTOCOL_VERSION,
        "oneOf": frames["oneOf"],
        "discriminator": frames["discriminator"],
        "$defs": {
            **frames["$defs"],
            **server["$defs"],
            "ConsoleServerEvent": {"oneOf": server["oneOf"], "discriminator": server["discriminator"]},
        },
    }
