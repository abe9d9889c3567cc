"""`RemoteBackend`: the `InferenceBackend` seam over OpenAI-compatible inference servers (llama.cpp's
llama-server, vLLM, other rtserver nodes), spread over `[backend] urls` by `UpstreamPool`.

The hub renders prompts exactly as with the local engine and sends them as token ids to
`/v1/completions` (streamed), so the server's prefix cache sees the same tokens turn after turn; a
session sticks to one URL. Every sampling field is sent explicitly (servers' defaults are not neutral).
Cancelling closes the HTTP stream, which makes the server stop and free its slot. A request is retried
on another URL only before its first token; after that a failure ends it with `backend_unavailable`.
What each server's prefix cache may share across sessions is remote/reuse.py's: every request carries
the fields of its lease (a slot, a salt, the public prefix), and `cached_tokens` passes through it.

Label scoring asks the server for log-probabilities. What each kind of server offers differs, so
`check()` learns the kind at start (from `/v1/models`) and `score` uses, per kind:
- rtserver: `score_candidates` on its /v1/completions (exact, one request);
- llama-server: the top-20 log-probabilities of the next token, a request forcing a candidate's first
  token (`logit_bias`) where it is not among them, and a token grammar forcing a longer candidate;
- vLLM: `logprob_token_ids` (vLLM >= 0.26) for first tokens and `prompt_logprobs` for longer ones.

Next-turn prefetch (`backend.prefetch_next_turn`): when a reply ends the hub hands over how to compute
the tokens the session's next prompt will start with (tasks/chat.py `next_turn_prefix`: the history,
the end of the reply and the next user header; computed only when the prefetch is about to be sent, so
a turn that comes first never paid for it), and they go to the session's server `PREFETCH_DELAY_S` later as a
one-token, non-streamed completion (`max_tokens: 0` still samples one token in llama-server 11434; vLLM and
rtserver require at least 1), so its prefix cache holds them when the next message comes and that turn
prefills only the message. It is optional work: it goes only where the URL is up with room for one
more request beside it, bypasses the send gate, is not retried, does not count as a failure of the
URL, and a failure is only logged. A session has at most one; a newer one, a disconnect or a reset
cancels it. The session's next turn cancels it when it has not been written yet, and otherwise waits
for it at most `PREFETCH_WAIT_S`: a server with slots (llama-server) would give a turn sent while its
slot is busy another slot, without the session's cache, which costs far more than waiting for a
prefill of a few tokens. The delay is for clients that answer at once (scripts, load tests): their
next message comes before a prefetch could be done, so it would only add a server iteration to wait
for; waiting `PREFETCH_DELAY_S` first, their prefetch is cancelled unsent, while a person, who takes
seconds to read and type, still finds the prefix computed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any

import aiohttp

from ..config import BackendSettings
from ..engine.backend import (
    FinishReason,
    SamplingError,
    SamplingParams,
    SequenceResult,
    TokenEvent,
    Tokenizer,
    Usage,
)
from .gate import SendGate
from .pool import BackendUnavailable, Upstream, UpstreamPool
from .reuse import Lease, Reuse, Unlearned, reuse_for
from .sse import UpstreamProtocolError, sse_payloads

log = logging.getLogger("rtserver.remote")

PROBE_TEXT = "Hello, world! How are you today? 你好，世界。 1234 🙂"
TOP_LOGPROBS = 20
JSON_HEADERS = {"Content-Type": "application/json"}
SERVER_KINDS = {"rtserver": "rtserver", "llamacpp": "llama.cpp", "vllm": "vllm"}  # /v1/models owned_by
PREFETCH_WAIT_S = 0.5  # the longest a turn waits for its session's prefetch already sent (see above)
PREFETCH_DELAY_S = 0.2  # from the end of a reply to its prefetch's request (see above)
# the longest the send gate holds a group (a burst of 32 takes the hub ~10-15 ms to read and start)
SEND_MAX_HOLD_S = 0.02
PREFETCH_RESPONSE_LIMIT = 1 << 16  # bytes of a prefetch's answer read (one token's completion)


class BackendMismatch(Exception):
    """The remote model does not use the local tokenizer (start-up refuses)."""


class UpstreamError(Exception):
    """One upstream request failed; `retryable` when another URL may succeed (before any token)."""

    def __init__(self, message: str, retryable: bool, code: str = "backend_unavailable", public: str = ""):
        super().__init__(message)
        self.message, self.retryable, self.code = message, retryable, code
        # what a client may read: never the server's URL or its error body
        self.public = public or "the inference server failed"


class _Prefetch:
    """A session's next-turn prefetch in flight."""

    task: asyncio.Task

    def __init__(self) -> None:
        self.sent = False  # being written to the server: cancelling it no longer spares the server


class RemoteGeneration:
    """One streamed generation on a remote server; the same face as the local engine's stream."""

    def __init__(
        self,
        backend: RemoteBackend,
        prompt_ids: list[int],
        params: SamplingParams,
        session_key: Hashable | None,
        public_tokens: int = 0,
    ):
        self.backend = backend
        self.prompt_ids = prompt_ids
        self.params = params
        self.session_key = session_key
        self.public_tokens = public_tokens
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
            self._ids = self.backend.tokenizer.encode(self._text, add_special_tokens=False)
        return self._ids

    # -- the request ------------------------------------------------------------------------------------
    async def _run(self) -> None:
        reason, error, code = FinishReason.ERROR, None, None
        try:
            await self.backend._settle_prefetch(self.session_key)
            reason = await self.backend._with_retries(
                self.session_key, self._attempt, lambda: self._first is None
            )
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

    def _ended(self, task: asyncio.Task) -> None:
        if not self._result.done():  # cancelled before its first step: `_run` never ran
            self._finish(FinishReason.CANCELLED, None, None)

    def _finish(self, reason: FinishReason, error: str | None, code: str | None) -> None:
        end = time.perf_counter()
        self.backend.tokens_generated += self._usage.generated_tokens
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
        body = self.backend._completion_body(self.prompt_ids, self.params, stream=True)
        lease = await self.backend.reuse_of(up).lease(
            self.session_key, self.public_tokens, self.backend.settings.timeout_s
        )
        body.update(lease.fields(self.prompt_ids))
        try:
            return await self._read(up, body, lease)
        finally:
            lease.release()

    async def _read(self, up: Upstream, body: dict, lease: Lease) -> FinishReason:
        reason: FinishReason | None = None
        async with self.backend._stream(up, body) as events:
            try:
                reason = await self._read_events(up, events, lease)
            finally:  # answered, whole or in part: the server holds the prompt and what it streamed
                lease.wrote(self.prompt_ids, self._spelled())
        if reason is None:  # the stream ended without a finish_reason: cut off, not finished
            raise UpstreamProtocolError("the stream ended before the reply finished")
        return reason

    async def _read_events(
        self, up: Upstream, events: AsyncIterator[dict], lease: Lease
    ) -> FinishReason | None:
        reason: FinishReason | None = None
        async for event in events:
            choice = _first_choice(event)
            if choice is None:
                self.backend._take_usage(event, self._usage, lease)
                continue
            text = choice.get("text") or ""
            ids = _chunk_token_ids(choice, self.backend.vocab)
            if text or ids:
                if self._first is None:
                    self._first = time.perf_counter()
                    up.record_latency(self._first - (self._started or self._first))
                self._text += text
                self._ids += ids
                self._usage.generated_tokens += len(ids) or 1
                self._queue.put_nowait(TokenEvent(ids[-1] if ids else -1, text))
            finish = choice.get("finish_reason")
            if finish:
                # the OpenAI format does not tell an end-of-turn token from a stop string: "stop"
                reason = FinishReason.LENGTH if finish == "length" else FinishReason.EOS
            self.backend._take_usage(event, self._usage, lease)
        return reason


class RemoteBackend:
    """The inference seam over one or more OpenAI-compatible servers (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, settings: BackendSettings):
        self.tokenizer = tokenizer
        self.vocab = len(tokenizer)
        self.settings = settings
        self.pool = UpstreamPool(
            settings.urls, settings.max_in_flight_per_url, settings.failures_to_open, settings.retry_after_s
        )
        self.model = settings.model
        self.kinds: dict[str, str] = {}  # url -> server kind, learned by check()
        self.reuse: dict[str, Reuse] = {}  # url -> what its prefix cache may share, learned with the kind
        for up in self.pool.upstreams:
            up.checked = False  # until check() (or the health check) has seen what it serves
        window = settings.send_window_ms / 1000
        self.gate = SendGate(window, max(4 * window, SEND_MAX_HOLD_S))
        self.client: aiohttp.ClientSession | None = None
        self.fresh_client: aiohttp.ClientSession | None = None  # no kept-alive connections
        self._health: asyncio.Task | None = None
        self.tokens_generated = 0
        self._prefetches: dict[Hashable, _Prefetch] = {}
        self._background: set[asyncio.Task] = set()  # slots being cut back to a public prefix
        # prefetches: started, done (answered 200), skipped (no room), failed, cancelled, waited for by
        # the session's next turn, overtaken (that turn stopped waiting)
        self.prefetch_counts = dict.fromkeys(
            ("started", "done", "skipped", "failed", "cancelled", "waited", "overtaken"), 0
        )

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.client is None:
            self.client = self._new_client()
        if self._health is None:
            self._health = asyncio.get_running_loop().create_task(self._health_loop())

    def _new_client(self, fresh: bool = False) -> aiohttp.ClientSession:
        # aiohttp rather than httpx: its per-request CPU is a small fraction of httpx's, and in a burst
        # that CPU is spent before the last request reaches the server (README, "Remote backends").
        # `timeout_s` bounds the wait for the connection and for every read (a stall), not the whole
        # reply; the pool bounds the requests in flight, so the connector does not.
        s = self.settings
        headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
        return aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=None, connect=min(5.0, s.timeout_s), sock_read=s.timeout_s),
            # common servers drop a connection idle for 5 s (uvicorn's and cpp-httplib's default): ours
            # are dropped before that, so few requests meet one the server is closing
            # `fresh`: a new connection for every request (the second try after a kept-alive one failed)
            connector=aiohttp.TCPConnector(limit=0, force_close=True)
            if fresh
            else aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),
        )

    def _timeout(self, seconds: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=seconds)

    async def stop(self) -> None:
        for key in list(self._prefetches):
            self.cancel_prefetch(key)
        for task in list(self._background):
            task.cancel()
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
            self._health = None
        for client in (self.client, self.fresh_client):
            if client is not None:
                await client.close()
        self.client = self.fresh_client = None

    @property
    def http(self) -> aiohttp.ClientSession:
        if self.client is None:
            self.client = self._new_client()
        return self.client

    async def check(self) -> None:
        """At start: every reachable URL is asked what it serves and whether it tokenizes as we do;
        a different tokenizer raises BackendMismatch naming both. An unreachable URL is marked down
        (the health check brings it back), not fatal."""
        for up in self.pool.upstreams:
            try:
                await self._probe(up)
                self.pool.succeeded(up)
            except BackendMismatch:
                raise
            except Exception as exc:
                self.pool.mark_down(up, _describe(exc))  # down at start: the health check brings it back
                log.warning("inference server %s is not available: %s", up.url, _describe(exc))

    async def _probe(self, up: Upstream) -> None:
        async with self.http.get(up.url + "/v1/models", timeout=self._timeout(self.settings.timeout_s)) as r:
            r.raise_for_status()
            listing = await r.json(content_type=None)
        models = (listing.get("data") if isinstance(listing, dict) else None) or []
        owned = str(models[0].get("owned_by", "")) if models else ""
        served = [str(m.get("id")) for m in models]
        kind = SERVER_KINDS.get(owned, "openai")
        want = self.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
        got = await self._remote_tokens(up, kind)
        if got is not None and got != want:
            raise BackendMismatch(
                f"{up.url} serves {', '.join(served) or 'an unnamed model'} whose tokenizer differs from the "
                f"local one (model.model): {PROBE_TEXT!r} is {got[:12]}... there and {want[:12]}... here"
            )
        self.kinds[up.url] = kind
        self.reuse[up.url] = reuse_for(kind, await self._total_slots(up) if kind == "llama.cpp" else None)
        up.checked = True  # the health check probes a URL until it is checked
        if not self.model:
            self.model = served[0] if served else ""
        log.info(
            "inference server %s: %s (%s), tokenizer %s",
            up.url,
            ", ".join(served),
            kind,
            "matches" if got is not None else "not checked (no /tokenize)",
        )

    async def _total_slots(self, up: Upstream) -> int | None:
        """llama-server's slot count (`-np`), from /props."""
        try:
            async with self.http.get(up.url + "/props", timeout=self._timeout(self.settings.timeout_s)) as r:
                props = await r.json(content_type=None) if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        slots = props.get("total_slots") if isinstance(props, dict) else None
        return slots if isinstance(slots, int) and 0 < slots <= 4096 else None

    def reuse_of(self, up: Upstream) -> Reuse:
        return self.reuse.get(up.url) or UNCHECKED

    async def _remote_tokens(self, up: Upstream, kind: str) -> list[int] | None:
        if kind == "vllm":
            body: dict[str, Any] = {"prompt": PROBE_TEXT, "add_special_tokens": False}
            if self.model:
                body["model"] = self.model
        else:
            body = {"content": PROBE_TEXT, "add_special": False}
        async with self.http.post(
            up.url + "/tokenize", json=body, timeout=self._timeout(self.settings.timeout_s)
        ) as r:
            if r.status == 404:
                return None
            r.raise_for_status()
            answer = await r.json(content_type=None)
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        return [int(t) for t in tokens] if isinstance(tokens, list) else None

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            for up in self.pool.upstreams:
                if not self.pool.waited(up):
                    continue  # its breaker opened less than retry_after_s ago: no probe yet
                try:
                    async with self.http.get(
                        up.url + "/health", timeout=self._timeout(min(5.0, self.settings.timeout_s))
                    ) as r:
                        if r.status >= 400:
                            raise UpstreamError(f"/health answered {r.status}", True)
                    if not up.checked:
                        await self._probe(up)
                    self.pool.succeeded(up)
                except BackendMismatch as exc:
                    self.pool.failed(up, str(exc))
                    log.error("%s", exc)
                except Exception as exc:
                    if self.pool.state(up) == "up":
                        log.warning("inference server %s failed its health check: %s", up.url, _describe(exc))
                    self.pool.failed(up, _describe(exc))

    # -- requests ----------------------------------------------------------------------------------------
    async def _with_retries(self, session_key: Hashable | None, attempt: Any, may_retry: Any) -> Any:
        """Run `attempt(upstream)` on the session's URL; on a retryable failure before anything reached
        the caller, on the next URL (each URL once)."""
        tried: set[str] = set()
        while True:
            up = self.pool.choose(session_key, tried)
            await self.pool.acquire(up, self.settings.timeout_s)
            try:
                result = await attempt(up)
            except UpstreamError as exc:
                if exc.retryable:  # the server's fault (5xx, its error event); a refused request is not
                    self.pool.failed(up, exc.message)
                tried.add(up.url)
                if exc.retryable and may_retry() and len(tried) < len(self.pool.upstreams):
                    log.warning("%s failed (%s); trying another server", up.url, exc.message)
                    continue
                raise
            except (aiohttp.ClientError, TimeoutError, UpstreamProtocolError) as exc:
                self.pool.failed(up, _describe(exc))
                tried.add(up.url)
                if may_retry() and len(tried) < len(self.pool.upstreams):
                    log.warning("%s failed (%s); trying another server", up.url, _describe(exc))
                    continue
                raise UpstreamError(
                    f"{up.url}: {_describe(exc)}", False, public=f"the inference server failed: {_kind(exc)}"
                ) from exc
            finally:
                self.pool.release(up)
            self.pool.succeeded(up)
            return result

    @contextlib.asynccontextmanager
    async def _completion(
        self, up: Upstream, body: dict, gated: bool = True
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """POST `body` to the server's /v1/completions; the response, once it answered 200. Leaving the
        block closes the connection unless the response was read to its end (the server stops
        generating). A kept-alive connection the server has just closed fails before the request got
        through (a server drops idle ones when it likes): that is tried once more on another
        connection, not counted as the server's failure. `gated`: through the send gate.

        A gated request takes its connection (a kept-alive one, or a new one: TCP connect, the server's
        accept) while the gate holds it: only the writing waits for the gate. The request goes as a body
        that waits for the gate before it yields its bytes (aiohttp writes the request line and headers
        with the body's first bytes, so the whole request is one write, made as the group is let go).
        Connecting after the gate, a burst's 32 new connections took ~5 ms to open, one after another,
        between the gate's release and the first request reaching the server (README, "Remote
        backends")."""
        url = up.url + "/v1/completions"
        data = json.dumps(body).encode()  # before the gate: after it, only the sending
        headers = {**JSON_HEADERS, "Content-Length": str(len(data))}
        if body.get("stream") and self.kinds.get(up.url) == "llama.cpp":
            # llama-server closes the connection after every streamed response while its headers say
            # keep-alive: pooled, that connection would fail the next request after the gate let it go
            headers["Connection"] = "close"
        ticket = self.gate.expect() if gated else None
        try:
            resp = await self.http.post(
                url, data=self._after_gate(data, ticket) if ticket else data, headers=headers
            )
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if ticket:
                self.gate.forget(ticket)  # failed before its body was written (or after: a no-op)
            if isinstance(exc, aiohttp.ClientConnectorError):
                raise  # no connection at all: the server is not there
            log.info("%s: a kept-alive connection failed (%s); sending again", up.url, _describe(exc))
            # on a new connection: the pool may hold more connections the server has closed (it also
            # closes one after its 100th request, cpp-httplib's keep-alive limit); the gate has let this
            # request go already
            if self.fresh_client is None:
                self.fresh_client = self._new_client(fresh=True)
            resp = await self.fresh_client.post(url, data=data, headers=JSON_HEADERS)
        finally:
            if ticket:
                self.gate.forget(ticket)  # cancelled or failed otherwise before the gate
        async with resp:
            if resp.status != 200:
                raise _status_error(up, resp.status, await _head(resp))
            yield resp

    async def _after_gate(self, data: bytes, ticket: object) -> AsyncIterator[bytes]:
        """A request body that waits for the send gate (see `_completion`)."""
        await self.gate.wait(ticket)
        yield data

    @contextlib.asynccontextmanager
    async def _stream(self, up: Upstream, body: dict) -> AsyncIterator[AsyncIterator[dict]]:
        """The events of a streamed completion."""
        async with self._completion(up, body) as resp:
            yield sse_payloads(resp.content.iter_any())

    async def _post(self, up: Upstream, body: dict, limit: int = 16 << 20) -> dict:
        async with self._completion(up, body) as resp:
            raw = b""
            async for chunk in resp.content.iter_any():
                raw += chunk
                if len(raw) > limit:
                    raise UpstreamProtocolError(f"a response over {limit} bytes")
        try:
            data = json.loads(raw)
        except ValueError:
            raise UpstreamProtocolError(f"a response that is not JSON: {raw[:80]!r}") from None
        if not isinstance(data, dict):
            raise UpstreamProtocolError("a response that is not a JSON object")
        return data

    def _completion_body(self, prompt: list[int], p: SamplingParams, stream: bool) -> dict:
        body: dict[str, Any] = {
            "prompt": prompt,
            "stream": stream,
            "max_tokens": p.max_new_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,
            "min_p": 0.0,
            "stop": list(p.stop),
            "ignore_eos": p.ignore_eos,
        }
        if p.greedy:
            # greedy is top-1: a server that still runs its sampler chain over the whole vocabulary for
            # top_k = 0 (llama-server) sorts ~50k logits per token for nothing
            body.update(temperature=0.0, top_k=1, top_p=1.0)
        if self.model:
            body["model"] = self.model
        if p.seed is not None:
            body["seed"] = p.seed
        # both spellings: llama-server reads repeat_penalty, vLLM and rtserver repetition_penalty; each
        # ignores the other's
        body["repeat_penalty"] = body["repetition_penalty"] = p.repetition_penalty
        if p.min_new_tokens:
            body["min_tokens"] = p.min_new_tokens
        if stream:
            body["stream_options"] = {"include_usage": True}
        body["return_token_ids"] = True  # vLLM >= 0.10.2 and rtserver: exact ids per chunk
        return body

    @staticmethod
    def _take_usage(event: dict, usage: Usage, lease: Lease) -> None:
        u = event.get("usage")
        if not isinstance(u, dict):
            return
        details = u.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int):
            usage.cached_tokens = lease.cached(cached)
            usage.prefilled_tokens = max(0, usage.prompt_tokens - usage.cached_tokens)
        if isinstance(u.get("completion_tokens"), int):
            usage.generated_tokens = u["completion_tokens"]

    # -- the seam ----------------------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        session_key: Hashable | None = None,
        public_tokens: int = 0,
    ) -> RemoteGeneration:
        params.validate(len(self.tokenizer))
        if not prompt_ids:
            raise SamplingError("empty prompt")
        _check_public(public_tokens, prompt_ids)
        if not any(self.pool.usable(u) for u in self.pool.upstreams):
            raise BackendUnavailable(
                "no inference server is available: "
                + ", ".join(f"{s['url']} {s['state']}" for s in self.pool.snapshot())
            )
        self.gate.arrived()
        return RemoteGeneration(self, list(prompt_ids), params, session_key, public_tokens)

    async def score(
        self,
        prompt_ids: list[int],
        candidates: list[list[int]],
        *,
        normalize: bool = True,
        public_tokens: int = 0,
    ) -> list[float]:
        if not candidates or any(not c for c in candidates):
            raise ValueError("candidates must be non-empty token lists")
        _check_public(public_tokens, prompt_ids)
        self.gate.arrived()

        async def attempt(up: Upstream) -> list[float]:
            kind = self.kinds.get(up.url, "openai")
            lease = await self.reuse_of(up).lease(None, public_tokens, self.settings.timeout_s)
            try:
                if kind == "rtserver":
                    scores = await self._score_rtserver(up, prompt_ids, candidates, lease)
                elif kind == "vllm":
                    scores = await self._score_vllm(up, prompt_ids, candidates, lease)
                else:
                    scores = await self._score_llama(up, prompt_ids, candidates, lease)
            except BaseException:
                lease.release()
                raise
            self._leave_public(up, lease, prompt_ids[:public_tokens])
            return scores

        # scores are log-probabilities: normalized whatever `normalize` says
        return await self._with_retries(None, attempt, lambda: True)

    async def _score_post(
        self, up: Upstream, lease: Lease, prompt: list[int], max_tokens: int, **extra: Any
    ) -> dict:
        """One non-streamed scoring request; the slot it used then holds its prompt."""
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "top_k": 0,
            "top_p": 1.0,
            "min_p": 0.0,
            "stream": False,
            **extra,
            **lease.fields(prompt),
        }
        if self.model:
            body["model"] = self.model
        data = await self._post(up, body)
        lease.wrote(prompt, [])
        return data

    async def _score_rtserver(
        self, up: Upstream, prompt: list[int], candidates: list[list[int]], lease: Lease
    ) -> list[float]:
        data = await self._score_post(up, lease, prompt, 1, score_candidates=candidates)
        scores = (_first_choice(data) or {}).get("candidate_logprobs")
        if not (
            isinstance(scores, list)
            and len(scores) == len(candidates)
            and all(isinstance(s, (int, float)) for s in scores)
        ):
            raise UpstreamProtocolError("no candidate_logprobs in the scoring response")
        return [float(s) for s in scores]

    async def _score_llama(
        self, up: Upstream, prompt: list[int], candidates: list[list[int]], lease: Lease
    ) -> list[float]:
        data = await self._score_post(up, lease, prompt, 1, logprobs=TOP_LOGPROBS)
        entries = _llama_logprobs(data)
        top = (
            {int(t["id"]): float(t["logprob"]) for t in (entries[0].get("top_logprobs") or [])}
            if entries
            else {}
        )
        scores: list[float] = []
        for cand in candidates:
            if len(cand) == 1 and cand[0] in top:
                scores.append(top[cand[0]])
                continue
            # force exactly this continuation: a grammar of its token ids (one token: the same)
            grammar = "root ::= " + " ".join(f"<[{t}]>" for t in cand)
            forced = _llama_logprobs(
                await self._score_post(up, lease, prompt, len(cand), logprobs=1, grammar=grammar)
            )
            if len(forced) != len(cand):
                raise UpstreamError(
                    f"{up.url} could not score a label of {len(cand)} tokens (its tokens are "
                    "not whole characters)",
                    False,
                )
            scores.append(sum(float(e["logprob"]) for e in forced))
        return scores

    async def _score_vllm(
        self, up: Upstream, prompt: list[int], candidates: list[list[int]], lease: Lease
    ) -> list[float]:
        firsts = sorted({c[0] for c in candidates})
        data = await self._score_post(
            up, lease, prompt, 1, logprobs=1, logprob_token_ids=firsts, return_tokens_as_token_ids=True
        )
        top = (((_first_choice(data) or {}).get("logprobs") or {}).get("top_logprobs") or [{}])[0] or {}
        first = {int(k.split(":", 1)[1]): float(v) for k, v in top.items() if str(k).startswith("token_id:")}
        scores = []
        for cand in candidates:
            if cand[0] not in first:
                raise UpstreamError(
                    f"{up.url} returned no log-probability for token {cand[0]} (vLLM >= 0.26 "
                    "is needed for label scoring)",
                    False,
                    code="internal",
                )
            score = first[cand[0]]
            if len(cand) > 1:  # the rest from prompt log-probabilities of prompt + candidate
                rest = await self._score_post(up, lease, prompt + cand, 1, prompt_logprobs=0)
                plp = (_first_choice(rest) or {}).get("prompt_logprobs") or []
                for pos, tok in enumerate(cand[1:], start=len(prompt) + 1):
                    score += float(plp[pos][str(tok)]["logprob"])
            scores.append(score)
        return scores

    def _leave_public(self, up: Upstream, lease: Lease, prefix: list[int]) -> None:
        """After a scoring call, in the background: cut its slot back to the public prefix, so later
        requests may reuse it (remote/reuse.py); the slot is released when that is done."""
        fields = lease.public_fields() if prefix else None
        if fields is None:
            lease.release()
            return
        body = self._completion_body(prefix, SamplingParams(temperature=0.0, max_new_tokens=1), stream=False)
        body.update(fields)

        async def cut() -> None:
            try:
                async with asyncio.timeout(self.settings.timeout_s):
                    async with self._completion(up, body, gated=False) as resp:
                        await _head(resp, PREFETCH_RESPONSE_LIMIT)
                lease.wrote_public(prefix)
            except Exception as exc:
                log.info(
                    "%s: cutting a slot back to its public prefix failed (no harm done): %s",
                    up.url,
                    _describe(exc),
                )
            finally:
                lease.release()

        task = asyncio.get_running_loop().create_task(cut())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- next-turn prefetch (see the module docstring) --------------------------------------------------
    def prefetch(self, prefix: Callable[[], list[int] | None], *, session_key: Hashable) -> None:
        # whether to prefetch at all (`backend.prefetch_next_turn`) is the hub's call
        self.cancel_prefetch(session_key)
        try:
            up = self.pool.choose(session_key)
        except BackendUnavailable:
            return
        entry = _Prefetch()
        entry.task = asyncio.get_running_loop().create_task(self._prefetch(up, prefix, session_key, entry))
        entry.task.add_done_callback(lambda _: self._forget_prefetch(session_key, entry))
        self._prefetches[session_key] = entry

    def cancel_prefetch(self, session_key: Hashable) -> None:
        entry = self._prefetches.pop(session_key, None)
        if entry is not None and not entry.task.done():
            entry.task.cancel()

    def _forget_prefetch(self, session_key: Hashable, entry: _Prefetch) -> None:
        if entry.task.cancelled():
            self.prefetch_counts["cancelled"] += 1
        if self._prefetches.get(session_key) is entry:
            del self._prefetches[session_key]

    async def _prefetch(
        self, up: Upstream, prefix: Callable[[], list[int] | None], session_key: Hashable, entry: _Prefetch
    ) -> None:
        await asyncio.sleep(PREFETCH_DELAY_S)
        try:
            prompt_ids = prefix()  # only now: a turn that came within the delay never paid for it
        except Exception as exc:
            log.debug("no next-turn prefix for session %s (%s)", session_key, exc)
            return
        if not prompt_ids:
            return  # the template does not split safely there (tasks/chat.py next_turn_prefix)
        lease = self.reuse_of(up).own_lease(session_key)  # only into the session's own cache
        if lease is None or not self.pool.try_acquire_spare(up):
            if lease is not None:
                lease.release()
            self.prefetch_counts["skipped"] += 1
            return
        self.prefetch_counts["started"] += 1
        try:
            body = self._completion_body(
                prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=1), stream=False
            )
            body.update(lease.fields(prompt_ids))
            entry.sent = True
            async with asyncio.timeout(self.settings.timeout_s):
                async with self._completion(up, body, gated=False) as resp:
                    head = await _head(resp, PREFETCH_RESPONSE_LIMIT)
            if not head.lstrip().startswith("{"):
                raise UpstreamProtocolError(f"an answer that is not JSON: {head[:80]!r}")
            lease.wrote(prompt_ids, [])
            self.prefetch_counts["done"] += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.prefetch_counts["failed"] += 1
            log.warning("next-turn prefetch on %s failed (no harm done): %s", up.url, _describe(exc))
        finally:
            lease.release()
            self.pool.release(up)

    async def _settle_prefetch(self, session_key: Hashable | None) -> None:
        """Before a session's turn: drop its prefetch if not written yet, else wait for it (bounded)."""
        entry = self._prefetches.get(session_key) if session_key is not None else None
        if entry is None or entry.task.done():
            return
        if not entry.sent:
            self.cancel_prefetch(session_key)
            return
        self.prefetch_counts["waited"] += 1
        done, _ = await asyncio.wait({entry.task}, timeout=PREFETCH_WAIT_S)
        if not done:
            self.prefetch_counts["overtaken"] += 1
            self.cancel_prefetch(session_key)

    def drop_session(self, session_key: Hashable) -> None:
        """Cancel the session's prefetch; its slots may go to new sessions first. The servers' caches
        evict by themselves; affinity is a pure function of the key."""
        self.cancel_prefetch(session_key)
        for reuse in self.reuse.values():
            reuse.forget(session_key)

    def stats(self) -> dict[str, Any]:
        snapshot = self.pool.snapshot()
        return {
            "running": sum(s["in_flight"] for s in snapshot),
            "waiting": 0,
            "steps": 0,
            "tokens_generated": self.tokens_generated,
            "tokens_prefilled": 0,
            "kv": None,
            "upstreams": snapshot,
            "send_groups": {"requests": self.gate.requests, "groups": self.gate.groups},
            "prefetch": {**self.prefetch_counts, "in_flight": len(self._prefetches)},
        }

    def health(self) -> dict[str, Any]:
        return {
            "kind": "openai",
            "model": self.model,
            "servers": [{**s, "kind": self.kinds.get(s["url"])} for s in self.pool.snapshot()],
        }

    @property
    def available(self) -> bool:
        return any(self.pool.state(u) == "up" for u in self.pool.upstreams)


UNCHECKED = Unlearned()  # a URL not yet probed: nothing private is reused there


def _check_public(public_tokens: int, prompt_ids: list[int]) -> None:
    if isinstance(public_tokens, bool) or not isinstance(public_tokens, int):
        raise ValueError(f"public_tokens = {public_tokens!r}: an integer")
    if not 0 <= public_tokens <= len(prompt_ids):
        raise ValueError(f"public_tokens = {public_tokens}: the prompt has {len(prompt_ids)} tokens")


def _first_choice(event: dict) -> dict | None:
    if "error" in event:
        err = event["error"]
        message = err.get("message") if isinstance(err, dict) else str(err)
        raise UpstreamError(
            f"the server reported an error: {message}", True, public="the inference server reported an error"
        )
    choices = event.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    if choices is None or isinstance(choices, list):
        return None
    raise UpstreamProtocolError("'choices' is not a list")


def _chunk_token_ids(choice: dict, vocab: int) -> list[int]:
    ids = choice.get("token_ids")  # vLLM return_token_ids
    if not isinstance(ids, list):
        lp = choice.get("logprobs")
        content = lp.get("content") if isinstance(lp, dict) else None  # llama-server
        if not isinstance(content, list):
            return []
        ids = [e["id"] for e in content if isinstance(e, dict) and "id" in e]
    # the ids become the session's next prompt: a server's stray id must not reach it
    if not all(type(t) is int and 0 <= t < vocab for t in ids):
        raise UpstreamProtocolError(f"token ids outside the vocabulary (0..{vocab - 1}) in a reply")
    return ids


def _llama_logprobs(data: dict) -> list[dict]:
    lp = (_first_choice(data) or {}).get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    if not isinstance(content, list):
        raise UpstreamProtocolError("no logprobs in the response (is it llama-server?)")
    return content


async def _head(resp: aiohttp.ClientResponse, limit: int = 300) -> str:
    """The first bytes of an error response's body (never the whole of a huge one)."""
    head = b""
    async for chunk in resp.content.iter_any():
        head += chunk
        if len(head) >= limit:
            break
    return head[:limit].decode(errors="replace")


def _status_error(up: Upstream, status: int, detail: str) -> UpstreamError:
    if status >= 500 or status == 429:
        public = f"the inference server answered {status}"
        return UpstreamError(f"{up.url} answered {status}: {detail}", True, public=public)
    if status == 400 and "exceed_context_size" in detail:
        public = "the prompt does not fit the inference server's context"
        return UpstreamError(f"{up.url}: {public}", False, code="request_too_large", public=public)
    public = f"the inference server refused the request ({status})"
    return UpstreamError(f"{up.url} refused the request ({status}): {detail}", False, "internal", public)


def _kind(exc: BaseException) -> str:
    """`_describe` without what an exception's text may carry (hosts, ports, paths)."""
    if isinstance(exc, UpstreamProtocolError):
        return str(exc).split(":")[0]  # our words; what follows is the server's bytes
    if isinstance(exc, TimeoutError | aiohttp.ClientResponseError):
        return _describe(exc)
    return type(exc).__name__


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):  # aiohttp's connect and read timeouts are TimeoutErrors too
        return f"timed out ({type(exc).__name__})"
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"answered {exc.status}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
