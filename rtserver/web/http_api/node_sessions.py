"""The node door's session ends: a hub whose session ended (expired, shed, reset) tells this node to free
the KV it kept under that session's `rtserver_session` key (`POST /v1/sessions/drop`), rather than
leave it until the KV budget evicts it."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...tasks import bounds as B
from ..state import AppState
from .common import Body, HTTPError

MAX_DROPS = 256  # keys in one request


def _keys(body: Body) -> list[str]:
    keys = body.get("rtserver_sessions")
    chars = B.SIZES["session_chars"]
    if not (
        isinstance(keys, list)
        and 0 < len(keys) <= MAX_DROPS
        and all(isinstance(k, str) and 0 < len(k) <= chars for k in keys)
    ):
        raise HTTPError(
            "invalid_field",
            f"'rtserver_sessions' must be a list of 1..{MAX_DROPS} strings of 1..{chars} characters",
            "rtserver_sessions",
        )
    return keys


async def drop_sessions(request: Request, state: AppState, body: Body) -> Response:
    """{"rtserver_sessions": [key, ...]} → {"dropped": n}: each key's kept KV freed (an unknown key is
    nothing to free)."""
    keys = _keys(body)
    for key in keys:
        state.backend.drop_session(f"remote:{key}")  # the key /v1/completions keeps it under
    return JSONResponse({"dropped": len(keys)})
