"""`RemoteGeneration`: one streamed generation on a remote server, with the local engine's face.

The prompt goes as token ids to `/v1/completions` (streamed) on the session's URL, so the server's
prefix cache sees the same tokens turn after turn. Cancelling closes the HTTP stream, which makes the
server stop and free its slot. A request is retried on another URL only before its first token; after
that a failure ends it with `backend_unavailable`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable

from ..engine.backend import FinishReason, SamplingParams, SequenceResult, TokenEvent, Tokenizer, Usage
from .client import Upstreams
from .pool import BackendUnavailable, Upstream
from .reuse import Lease
from .sse import UpstreamProtocolError
from .wire import Json, UpstreamError, chunk_token_ids, completion_body, first_choice, take_usage

log = logging.getLogger("rtserver.remote")


class RemoteGeneration:
    """One streamed generation on a remote server; the same face as the local engine's stream.
    `settle` runs before the request (the session's prefetch); `counted` gets the tokens generated."""

    def __init__(
        self,
        ups: Upstreams,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        params: SamplingParams,
        session_key: Hashable | None,
        public_tokens: int = 0,
        *,
        settle: Callable[[Hashable | None], Awaitable[None]],
        counted: Callable[[int], None],
    ):
        self.ups = ups
        self.tokenizer = tokenizer
        self.vocab = len(tokenizer)
        self.prompt_ids = prompt_ids
        self.params = params
        self.session_key = session_key
        self.public_tokens = public_tokens
        self._settle, self._counted = settle, counted
        self._queue: asyncio.Queue[TokenEvent | None] = asyncio.Queue()
        self._result: asyncio.Future[SequenceResult] = asyncio.get_running_loop().create_future()
        self._text = ""
        self._ids: list[int] = []
        self._usage = Usage(prompt_tokens=len(prompt_ids))
        self._submitted = time.perf_counter()
        self._started: float | None = None
        self._first: float | None = None
        self._task = asyncio.get_running_loop().create_task(self._run())
        self._task.add_done_callback(self._ended)

    def __aiter__(self) -> RemoteGeneration:
        return self

    async def __anext__(self) -> TokenEvent:
        item = await self._queue.get()
        if item is None:
            self._queue.put_nowait(None)
            raise StopAsyncIteration
        return item

    async def result(self) -> SequenceResult:
        return await asyncio.shield(self._result)

    def cancel(self) -> None:
        self._task.cancel()  # leaving the `async with` of the stream closes the connection upstream

    def _spelled(self) -> list[int]:
        """A text-only server's reply (llama-server) as our tokenizer spells it: what the next turn's
        prompt will hold (the server's cache matches up to any difference from its own spelling)."""
        if self._text and not self._ids:
            self._ids = self.tokenizer.encode(self._text, add_special_tokens=False)
        return self._ids

    # -- the request ------------------------------------------------------------------------------------
    async def _run(self) -> None:
        reason, error, code = FinishReason.ERROR, None, None
        try:
            await self._settle(self.session_key)
            reason = await self.ups.with_retries(self.session_key, self._attempt, lambda: self._first is None)
        except asyncio.CancelledError:
            reason = FinishReason.CANCELLED
        except BackendUnavailable as exc:
            error, code = exc.message, exc.code
            log.warning("generation failed: %s", exc.detail)
        except UpstreamError as exc:
            error, code = exc.public, exc.code
            log.warning("generation failed: %s", exc.message)
        except Exception as exc:  # a bug of ours: this request fails, nothing else
            log.exception("remote generation failed")
            error, code = f"internal error ({type(exc).__name__})", "internal"
        self._finish(reason, error, code)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not self._result.done():  # cancelled before its first step: `_run` never ran
            self._finish(FinishReason.CANCELLED, None, None)

    def _finish(self, reason: FinishReason, error: str | None, code: str | None) -> None:
        end = time.perf_counter()
        self._counted(self._usage.generated_tokens)
        ids = self._spelled()
        self._result.set_result(
            SequenceResult(
                text=self._text,
                token_ids=list(ids),
                finish_reason=reason,
                usage=self._usage,
                queued_ms=((self._started or end) - self._submitted) * 1000,
                ttft_ms=None if self._first is None else (self._first - self._submitted) * 1000,
                total_ms=(end - self._submitted) * 1000,
                error=error,
                error_code=code,
            )
        )
        self._queue.put_nowait(None)

    async def _attempt(self, up: Upstream) -> FinishReason:
        self._started = self._started or time.perf_counter()
        body = completion_body(self.prompt_ids, self.params, True, self.ups.model)
        lease = await self.ups.reuse_of(up).lease(
            self.session_key, self.public_tokens, self.ups.settings.timeout_s
        )
        body.update(lease.fields(self.prompt_ids))
        try:
            return await self._read(up, body, lease)
        finally:
            lease.release()

    async def _read(self, up: Upstream, body: Json, lease: Lease) -> FinishReason:
        reason: FinishReason | None = None
        async with self.ups.stream(up, body) as events:
            try:
                reason = await self._read_events(up, events, lease)
            finally:  # answered, whole or in part: the server holds the prompt and what it streamed
                lease.wrote(self.prompt_ids, self._spelled())
        if reason is None:  # the stream ended without a finish_reason: cut off, not finished
            raise UpstreamProtocolError("the stream ended before the reply finished")
        return reason

    async def _read_events(
        self, up: Upstream, events: AsyncIterator[Json], lease: Lease
    ) -> FinishReason | None:
        reason: FinishReason | None = None
        async for event in events:
            choice = first_choice(event)
            if choice is None:
                take_usage(event, self._usage, lease)
                continue
            text = choice.get("text") or ""
            if not isinstance(text, str):
                raise UpstreamProtocolError("a reply's 'text' is not a string")
            ids = chunk_token_ids(choice, self.vocab)
            if text or ids:
                self._took(up, text, ids)
            finish = choice.get("finish_reason")
            if finish:
                # the OpenAI format does not tell an end-of-turn token from a stop string: "stop"
                reason = FinishReason.LENGTH if finish == "length" else FinishReason.EOS
            take_usage(event, self._usage, lease)
        return reason

    def _took(self, up: Upstream, text: str, ids: list[int]) -> None:
        """A chunk's text and ids to the caller; the first one timed."""
        if self._first is None:
            self._first = time.perf_counter()
            up.record_latency(self._first - (self._started or self._first))
        self._text += text
        self._ids += ids
        self._usage.generated_tokens += len(ids) or 1
        self._queue.put_nowait(TokenEvent(ids[-1] if ids else -1, text))
