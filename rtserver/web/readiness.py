"""Whether the server takes requests, and why not: one `Readiness` value, computed by `assess`.

/health, /ready, admission's `check_serving`, the shutdown and /metrics all read it (`AppState.readiness`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ..engine.backend import InferenceBackend

Status = Literal["loading", "ready", "failed", "stopping"]
RETRY = "retry when GET /ready answers 200"


@dataclass(frozen=True)
class Readiness:
    """The load status and what it allows. Reasons are empty when ready; the public one never names a
    URL, host or path."""

    status: Status
    serving: bool  # the model and backends can serve (Redis aside: sessions then get `unavailable`)
    ready: bool  # serving, and the shared session store is up: /ready answers 200
    draining: bool  # shutting down: new requests are refused with `shutting_down`
    reason: str = ""  # why not ready, for the operator
    public_reason: str = ""  # why not ready, for anyone


def assess(
    status: Status,
    error: str | None,
    backends: Mapping[str, InferenceBackend],
    store_down: str | None,
    draining: bool,
) -> Readiness:
    """The readiness of a server in `status` (`error`: why start-up failed), with these backends and its
    session store (`store_down`: why it cannot be used, None when it can)."""
    if status != "ready":
        what = f"the model is {status}"
        return Readiness(status, False, False, draining, error or what, f"{what}; {RETRY}")
    down = _backend_down(backends)
    if down:
        public = f"no inference server is available; {RETRY}"
        return Readiness(status, False, False, draining, down, public)
    if store_down is not None:
        public = f"the session store is unavailable; {RETRY}"
        return Readiness(status, True, False, draining, store_down, public)
    return Readiness(status, True, True, draining)


def _backend_down(backends: Mapping[str, InferenceBackend]) -> str:
    """Why the first unavailable backend cannot serve, naming its servers ("" when all can)."""
    for name, backend in backends.items():
        if not backend.available:
            servers = backend.health().get("servers", [])
            states = "; ".join(
                f"{s['url']} {s['state']}" + (f" ({s['last_error']})" if s["last_error"] else "")
                for s in servers
            )
            return f"no {name} inference server is available: {states}"
    return ""
