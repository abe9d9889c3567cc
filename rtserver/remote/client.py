"""`Upstreams`: the servers as one remote backend knows them (pool, kinds, what their caches may
share) and the way one request takes to them: the HTTP client, the send gate, retries on another URL.

Every request passes the send gate (gate.py) with its connection already taken: its body waits for
the gate, so the connect overlaps the hold and the request goes in one write when the group is let go.
A request is retried on another URL only before anything reached its caller.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from typing import TypeVar

import aiohttp

from ..config import BackendSettings
from .gate import SendGate
from .pool import Upstream, UpstreamPool
from .reuse import Reuse, Unlearned
from .sse import UpstreamProtocolError, sse_payloads
from .wire import JSON_HEADERS, Json, UpstreamError, describe, public_kind, read_head, status_error

log = logging.getLogger("rtserver.remote")

# the longest the send gate holds a group (a burst of 32 takes the hub ~10-15 ms to read and start)
SEND_MAX_HOLD_S = 0.02
UNCHECKED = Unlearned()  # a URL not yet probed: nothing private is reused there

T = TypeVar("T")


class Upstreams:
    """The servers, their state and the HTTP path of one request to them."""

    def __init__(self, settings: BackendSettings):
        self.settings = settings
        self.pool = UpstreamPool(
            settings.urls, settings.max_in_flight_per_url, settings.failures_to_open, settings.retry_after_s
        )
        self.model = settings.model
        self.kinds: dict[str, str] = {}  # url -> server kind, learned by the start-up check
        self.reuse: dict[str, Reuse] = {}  # url -> what its prefix cache may share, learned with the kind
        for up in self.pool.upstreams:
            up.checked = False  # until the check (or the health check) has seen what it serves
        window = settings.send_window_ms / 1000
        self.gate = SendGate(window, max(4 * window, SEND_MAX_HOLD_S))
        self.client: aiohttp.ClientSession | None = None
        self.fresh_client: aiohttp.ClientSession | None = None  # no kept-alive connections

    def reuse_of(self, up: Upstream) -> Reuse:
        return self.reuse.get(up.url) or UNCHECKED

    # -- the HTTP client ---------------------------------------------------------------------------------
    @property
    def http(self) -> aiohttp.ClientSession:
        if self.client is None:
            self.client = self._new_client()
        return self.client

    def _new_client(self, fresh: bool = False) -> aiohttp.ClientSession:
        # aiohttp rather than httpx: it spends far less CPU per request, which a burst pays before
        # its last request reaches the server.
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

    def timeout(self, seconds: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=seconds)

    async def close(self) -> None:
        for client in (self.client, self.fresh_client):
            if client is not None:
                await client.close()
        self.client = self.fresh_client = None

    # -- requests ----------------------------------------------------------------------------------------
    async def with_retries(
        self,
        session_key: Hashable | None,
        attempt: Callable[[Upstream], Awaitable[T]],
        may_retry: Callable[[], bool],
    ) -> T:
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
                self.pool.failed(up, describe(exc))
                tried.add(up.url)
                if may_retry() and len(tried) < len(self.pool.upstreams):
                    log.warning("%s failed (%s); trying another server", up.url, describe(exc))
                    continue
                raise UpstreamError(
                    f"{up.url}: {describe(exc)}",
                    False,
                    public=f"the inference server failed: {public_kind(exc)}",
                ) from exc
            finally:
                self.pool.release(up)
            self.pool.succeeded(up)
            return result

    @contextlib.asynccontextmanager
    async def completion(
        self, up: Upstream, body: Json, gated: bool = True
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
        Connecting after the gate would open a burst's connections one after another between the
        gate's release and the first request reaching the server."""
        url = up.url + "/v1/completions"
        data = json.dumps(body).encode()  # before the gate: after it, only the sending
        headers = {**JSON_HEADERS, "Content-Length": str(len(data))}
        if body.get("stream") and self.kinds.get(up.url) == "llama.cpp":
            # llama-server closes the connection after every streamed response while its headers say
            # keep-alive: pooled, that connection would fail the next request after the gate let it go
            headers["Connection"] = "close"
        resp = await self._send(up, url, data, headers, self.gate.expect() if gated else None)
        async with resp:
            if resp.status != 200:
                raise status_error(up, resp.status, await read_head(resp))
            yield resp

    async def _send(
        self, up: Upstream, url: str, data: bytes, headers: dict[str, str], ticket: object | None
    ) -> aiohttp.ClientResponse:
        """The POST itself (see `completion`); a failed kept-alive connection is sent again once."""
        try:
            return await self.http.post(
                url, data=self._after_gate(data, ticket) if ticket else data, headers=headers
            )
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if ticket:
                self.gate.forget(ticket)  # failed before its body was written (or after: a no-op)
            if isinstance(exc, aiohttp.ClientConnectorError):
                raise  # no connection at all: the server is not there
            log.info("%s: a kept-alive connection failed (%s); sending again", up.url, describe(exc))
            # on a new connection: the pool may hold more connections the server has closed (it also
            # closes one after its 100th request, cpp-httplib's keep-alive limit); the gate has let this
            # request go already
            if self.fresh_client is None:
                self.fresh_client = self._new_client(fresh=True)
            return await self.fresh_client.post(url, data=data, headers=JSON_HEADERS)
        finally:
            if ticket:
                self.gate.forget(ticket)  # cancelled or failed otherwise before the gate

    async def _after_gate(self, data: bytes, ticket: object) -> AsyncIterator[bytes]:
        """A request body that waits for the send gate (see `completion`)."""
        await self.gate.wait(ticket)
        yield data

    @contextlib.asynccontextmanager
    async def stream(self, up: Upstream, body: Json) -> AsyncIterator[AsyncIterator[Json]]:
        """The events of a streamed completion."""
        async with self.completion(up, body) as resp:
            yield sse_payloads(resp.content.iter_any())

    async def post(self, up: Upstream, body: Json, limit: int = 16 << 20) -> Json:
        """A non-streamed completion's answer, a JSON object of at most `limit` bytes."""
        async with self.completion(up, body) as resp:
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
