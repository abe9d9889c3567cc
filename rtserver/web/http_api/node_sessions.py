"""The node door's session ends: a hub whose session ended (expired, shed, reset) tells this node to free
the KV it kept under that session's `rtserver_session` key (`POST /v1/sessions/drop`), rather than
leave it until the KV budget evicts it."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..state import AppState
from .bodies import parse
from .common import JSONObject
from .node_body import DropSessions


async def drop_sessions(request: Request, state: AppState, raw: JSONObject) -> Response:
    """{"rtserver_sessions": [key, ...]} → {"dropped": n}: each key's kept KV freed (an unknown key is
    nothing to free)."""
    keys = parse(DropSessions, raw).rtserver_sessions
    for key in keys:
        state.backend.drop_session(f"remote:{key}")  # the key /v1/completions keeps it under
    return JSONResponse({"dropped": len(keys)})
