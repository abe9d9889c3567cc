"""One timed, streamed `/v1/chat/completions` (or `/v1/completions`) request. The bench drives every server
with this one client.

It uses aiohttp for its low CPU cost per streamed request. That keeps 32 clients from spreading a burst out.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"


@dataclass
class StreamResult:
    """What one streamed reply took. `tokens` is the server's own count (usage.completion_tokens) when it
    sends one. Else it is the number of content chunks. `chunk_at` holds the perf_counter time of every
    content chunk. It shows the gaps between decode steps.
    """

    started: float
    first_at: float | None = None
    tokens: int = 0
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    chunk_at: list[float] = field(default_factory=list)
    text: str = ""

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_at is None else (self.first_at - self.started) * 1000


def chat_body(
    text: str, max_tokens: int, extra: dict[str, Any] | None = None, system: str | None = None
) -> dict[str, Any]:
    """A greedy streamed chat request for exactly `max_tokens` new tokens, usage included. EOS is ignored.
    Without `system` the chat template's default system prompt applies.
    """
    system_message = [{"role": "system", "content": system}] if system else []
    return {
        "messages": system_message + [{"role": "user", "content": text}],
        **_decoding(max_tokens),
        **(extra or {}),
    }


def completion_prompt(text: str, system: str | None = None) -> str:
    """A question as a base model's plain-text prompt."""
    prefix = f"{system}\n" if system else ""
    return f"{prefix}Question: {text}\nAnswer:"


def completion_body(prompt: str, max_tokens: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The same greedy streamed request as a plain-text completion. A base model has no chat template."""
    return {"prompt": prompt, **_decoding(max_tokens), **(extra or {})}


def _decoding(max_tokens: int) -> dict[str, Any]:
    return {
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_chat(
    http: aiohttp.ClientSession,
    base: str,
    body: dict[str, Any],
    on_chunk: Callable[[], None] | None = None,
    path: str = CHAT_PATH,
) -> StreamResult:
    """POST `body` to `base` + `path` and read its server-sent events to the end. They are chat deltas or
    completion text. `on_chunk` is called on every content chunk (the bench's progress count). An HTTP error
    status or an error event raises RuntimeError with the server's message.
    """
    result = StreamResult(started=time.perf_counter())
    pieces = 0
    usage: dict[str, Any] = {}
    async with http.post(base + path, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{base}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:  # one line at a time
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("error"):
                raise RuntimeError(f"{base}: error event in the stream: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or choice.get("text")
                if piece:
                    result.text += piece
                    now = time.perf_counter()
                    result.first_at = result.first_at or now
                    result.chunk_at.append(now)
                    pieces += 1
                    if on_chunk is not None:
                        on_chunk()
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
    result.tokens = usage.get("completion_tokens", pieces)
    result.prompt_tokens = usage.get("prompt_tokens")
    return result


def client_session(timeout_s: float = 900) -> aiohttp.ClientSession:
    """A session without a connection limit, and one connection per request. A limit must never be what
    queues a request. llama-server closes a connection after a streamed reply. A pooled one reused after
    that fails with "Server disconnected". Both servers pay the same local connect.
    """
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        connector=aiohttp.TCPConnector(limit=0, force_close=True),
    )
