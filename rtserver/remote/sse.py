"""Reading a server-sent-event stream from an upstream server with bounded memory: `data:` payloads one
by one, a line longer than `max_line_bytes` or a stream longer than `max_total_bytes` is an error (an
upstream that misbehaves cannot make the hub buffer without limit)."""

from __future__ import annotations

import enum
import json
from collections.abc import AsyncIterator


class UpstreamProtocolError(Exception):
    """The upstream answered something that is not the protocol it claims to speak."""


async def sse_payloads(
    chunks: AsyncIterator[bytes], max_line_bytes: int = 1 << 20, max_total_bytes: int = 64 << 20
) -> AsyncIterator[dict[str, object]]:
    """The JSON payload of every `data:` line, in order, until `data: [DONE]` or the end of the stream.
    `data: null` is skipped (llama-server sends one between the tasks of a multi-prompt request)."""
    buffer = b""
    total = 0
    async for chunk in chunks:
        total += len(chunk)
        if total > max_total_bytes:
            raise UpstreamProtocolError(f"response stream over {max_total_bytes} bytes")
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        if len(buffer) > max_line_bytes or any(len(line) > max_line_bytes for line in lines):
            raise UpstreamProtocolError(f"an event line over {max_line_bytes} bytes")
        for line in lines:
            payload = _payload(line)
            if payload is _End.DONE:
                return
            if payload is not None:
                yield payload
    payload = _payload(buffer)
    if payload is not None and payload is not _End.DONE:
        yield payload


class _End(enum.Enum):
    DONE = "[DONE]"  # the stream's last event


def _payload(line: bytes) -> dict[str, object] | _End | None:
    line = line.strip()
    if not line.startswith(b"data:"):
        return None  # blank separators, comments (":"), event/id fields
    data = line[5:].strip()
    if data == b"[DONE]":
        return _End.DONE
    try:
        value = json.loads(data)
    except ValueError:
        raise UpstreamProtocolError(f"an event that is not JSON: {data[:80]!r}") from None
    if value is not None and not isinstance(value, dict):
        raise UpstreamProtocolError(f"an event that is not a JSON object: {data[:80]!r}")
    return value
