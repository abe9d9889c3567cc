"""The stable error code and message a client gets for an exception raised while serving its request
(the same codes on WebSocket and HTTP; docs/protocol.md lists them)."""

from __future__ import annotations

from ..engine.backend import OutputFormatError, Overloaded, RequestTooLarge, SamplingError, SequenceResult
from ..tasks import TaskError


class GenerationFailed(Exception):
    """A generation that ended with an error: the backend's code for it (e.g. `backend_unavailable`
    when its server died mid-reply), else `internal`."""

    def __init__(self, result: SequenceResult):
        self.code = result.error_code or "internal"
        # an engine's own failure text names code and internals: the client gets the code only
        detail = "internal error" if self.code == "internal" else result.error or "unknown error"
        self.message = f"generation failed: {detail}"
        super().__init__(self.message)


def error_code(exc: Exception) -> tuple[str, str]:
    """(code, message) for an exception from a backend's generate/score or a task."""
    if isinstance(exc, Overloaded):
        return "overloaded", f"server busy, retry later ({exc})"
    if isinstance(exc, RequestTooLarge):
        return "request_too_large", str(exc)
    if isinstance(exc, SamplingError):
        return "bad_decoding", str(exc)
    if isinstance(exc, OutputFormatError):
        return "bad_output_format", str(exc)
    if isinstance(exc, TaskError):
        return exc.code, exc.message
    code = getattr(exc, "code", None)  # errors of the web layer that carry their own code
    if isinstance(code, str):  # `public`: the part of a remote failure a client may read
        return code, str(getattr(exc, "public", None) or getattr(exc, "message", exc))
    return "internal", f"internal error ({type(exc).__name__})"
