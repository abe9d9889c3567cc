"""The protocol's JSON Schema, generated from the client message models (protocol.py) and the server
event declarations (events.py) so that it cannot drift from them; served at GET /v1/protocol.schema.json.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

from pydantic import Field, TypeAdapter

from .events import ServerEvent
from .protocol import CLIENT_MESSAGE, MAX_JSON_DEPTH, PROTOCOL_VERSION


@functools.cache
def protocol_schema() -> dict[str, Any]:
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
