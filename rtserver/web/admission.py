"""Who may use each door, and how much. This covers surface credentials and open sockets per client. It
covers request and token budgets, readiness and shutdown. The /ws hub, the console and the HTTP API all
admit through here.

There are four surfaces. The public widget door is `/ws` and page assets. The inference API is HTTP `/v1/*`,
`/chat`, `/sentiment` and `/tokenize`. Then come the agent console, and operations (`/metrics`, `/health`
detail). Each has its own credential. The API and operations answer loopback clients only while their token
is empty.

Costs are tokens, not requests. A generation holds what it takes of the engine's KV while it runs. That is
its whole prompt, kept history included, plus `max_new_tokens`. A scoring call holds its prompt and longest
candidate. The hold counts against three bounds: its client's share, its surface's total, and the KV all
doors share. Its client's token bucket pays for what it computed. A client is an IPv4 address or an IPv6 /64
(one host's usual allocation).
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import math
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from cachetools import TTLCache
from starlette.types import ASGIApp, Receive, Scope, Send

from ..config import Settings
from ..engine.backend import Generation, InferenceBackend
from . import events
from .connection import Close
from .state import AppState


class Surface(enum.Enum):
    PUBLIC = "public"
    API = "api"
    CONSOLE = "console"
    OPS = "ops"


class Refused(Exception):
    """A request or connection that may not go on. `code` is stable; `message` says what to do."""

    def __init__(
        self, code: str, message: str, status: int, close: int = Close.POLICY, retry_after_s: float = 0.0
    ):
        super().__init__(message)
        self.code, self.message, self.status, self.close = code, message, status, close
        self.retry_after_s = retry_after_s


def client_key(ip: str) -> str:
    """The unit every per-client limit counts. It is an IPv4 address, or the /64 of an IPv6 one."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


def is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def bearer(headers: Mapping[str, str]) -> str:
    """The token of an `Authorization: Bearer` header, "" when there is none."""
    value = headers.get("authorization", "")
    return value[7:] if value.startswith("Bearer ") else ""


def same_token(given: str, expected: str) -> bool:
    return bool(given) and secrets.compare_digest(given.encode(), expected.encode())


class SocketCount:
    """Open WebSocket connections per client. `open` refuses past the cap (0 = no cap)."""

    def __init__(self, per_client: int):
        self.per_client = per_client
        self.open_by_client: dict[str, int] = {}

    def open(self, ip: str) -> None:
        key = client_key(ip)
        count = self.open_by_client.get(key, 0)
        if self.per_client and count >= self.per_client:
            raise Refused(
                "too_many_connections",
                f"this address already has {self.per_client} open connections (the limit); close one first",
                429,
                Close.TOO_MANY_SESSIONS,
            )
        self.open_by_client[key] = count + 1

    def close(self, ip: str) -> None:
        key = client_key(ip)
        count = self.open_by_client.get(key, 0) - 1
        if count > 0:
            self.open_by_client[key] = count
        else:
            self.open_by_client.pop(key, None)


class TokenRate:
    """Token buckets per client, counted in model tokens. A debt is paid back before the next request."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        ttl = max(1.0, burst / rate) if rate > 0 else 1.0  # idle this long, a bucket is full again
        self.levels: TTLCache[str, tuple[float, float]] = TTLCache(maxsize=100_000, ttl=ttl, timer=clock)

    def _level(self, key: str) -> float:
        level, at = self.levels.get(key, (float(self.burst), self.clock()))
        return min(float(self.burst), level + (self.clock() - at) * self.rate)

    def wait(self, key: str) -> float:
        """Seconds until `key` may start a request (0.0: now)."""
        if self.rate <= 0:
            return 0.0
        level = self._level(key)
        return 0.0 if level > 0 else (1.0 - level) / self.rate

    def pay(self, key: str, tokens: int) -> None:
        if self.rate > 0:
            self.levels[key] = (self._level(key) - tokens, self.clock())


@dataclass
class Reservation:
    """Tokens held by one generation. `release` gives them back and pays for what was used."""

    budget: TokenBudget
    key: str
    tokens: int
    released: bool = False

    def release(self, used: int | None = None) -> None:
        if self.released:
            return
        self.released = True
        self.budget.give_back(self, self.tokens if used is None else min(used, self.tokens))


class NoReservation(Reservation):
    """What a caller holds when nothing was reserved. That is a refused or never-started request."""

    def __init__(self) -> None:
        self.released = True


class KVPool:
    """The engine's KV as every door counts it. `tokens` gives its size; 0 means unknown, so no bound
    (e.g. a remote backend). `held` is what the running requests of all doors hold of it.
    """

    def __init__(self, tokens: Callable[[], int]):
        self.tokens = tokens
        self.held = 0


class TokenBudget:
    """One surface's tokens: in flight per client and in all, and each client's rate. `total` is the
    surface's own bound (0: none beyond the pool). `client_share` bounds what one client may hold to that
    share of it. Where the surface has no total, it is a share of the pool (0: no share). `pool` is the KV
    all surfaces share. No reservation may overfill it.
    """

    def __init__(
        self,
        surface: Surface,
        per_client: int,
        rate: TokenRate,
        total: Callable[[], int],
        client_share: float = 0.0,
        pool: KVPool | None = None,
    ):
        self.surface, self.per_client, self.rate, self.total = surface, per_client, rate, total
        self.client_share, self.pool = client_share, pool or KVPool(lambda: 0)
        self.held_by_client: dict[str, int] = {}
        self.held = 0
        self.waiting: list[asyncio.Future[None]] = []  # reserve_queued's callers, woken by give_back

    def client_cap(self) -> int:
        """The most one client may hold at once (0: no bound). It is `per_client`, and its share."""
        whole = self.total() or self.pool.tokens()
        share = math.floor(whole * self.client_share) if whole and self.client_share else 0
        return min((c for c in (self.per_client, share) if c), default=0)

    def reserve(self, ip: str, tokens: int) -> Reservation:
        key = client_key(ip)
        wait = self.rate.wait(key)
        if wait > 0:
            raise Refused(
                "rate_limited",
                f"this address used its tokens ({self.rate.rate:g} tokens/s, burst {self.rate.burst}); "
                f"retry in {wait:.2f} s",
                429,
                retry_after_s=wait,
            )
        door = f"the {self.surface.value} door"
        total, pool, client = self.total(), self.pool.tokens(), self.client_cap()
        cap = min((c for c in (client, total, pool) if c), default=0)
        if cap and tokens > cap:  # it would never fit: waiting does not help
            raise Refused(
                "request_too_large",
                f"this request needs {tokens} tokens (prompt + max_tokens), more than the {cap} one "
                f"client may hold at once at {door}; ask for fewer tokens",
                413,
            )
        held = self.held_by_client.get(key, 0)
        if client and held + tokens > client:
            raise Refused(
                "over_budget",
                f"this request needs {tokens} tokens and this address already holds {held} of the "
                f"{client} one client may hold at {door}; wait for a reply to end",
                429,
                retry_after_s=1.0,
            )
        if total and self.held + tokens > total:
            raise Refused(
                "over_budget",
                f"this request needs {tokens} tokens; {door} holds {self.held} of its {total} now; "
                f"retry in a moment",
                429,
                retry_after_s=1.0,
            )
        if pool and self.pool.held + tokens > pool:
            raise Refused(
                "over_budget",
                f"this request needs {tokens} tokens; running requests hold {self.pool.held} of the "
                f"model's {pool}; retry in a moment",
                429,
                retry_after_s=1.0,
            )
        self.held += tokens
        self.pool.held += tokens
        self.held_by_client[key] = held + tokens
        return Reservation(self, key, tokens)

    async def reserve_queued(self, ip: str, tokens: int, wait_s: float, max_waiting: int) -> Reservation:
        """`reserve`, with waiting. A request may fit the budget but not this moment. It waits up to
        `wait_s` for running ones to end. At most `max_waiting` wait at once. Then it gets the last refusal.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            try:
                return self.reserve(ip, tokens)
            except Refused as refused:
                left = deadline - loop.time()
                if refused.code != "over_budget" or left <= 0 or len(self.waiting) >= max_waiting:
                    raise
                last = refused
            turn: asyncio.Future[None] = loop.create_future()
            self.waiting.append(turn)
            try:
                await asyncio.wait_for(turn, left)
            except TimeoutError:
                raise Refused(
                    last.code, f"{last.message} (waited {wait_s:g} s)", last.status, retry_after_s=1.0
                ) from None
            finally:
                if turn in self.waiting:
                    self.waiting.remove(turn)

    def give_back(self, reservation: Reservation, used: int) -> None:
        self.held -= reservation.tokens
        self.pool.held -= reservation.tokens
        left = self.held_by_client.get(reservation.key, 0) - reservation.tokens
        if left > 0:
            self.held_by_client[reservation.key] = left
        else:
            self.held_by_client.pop(reservation.key, None)
        self.rate.pay(reservation.key, used)
        # every waiter tries again, oldest first: one that fits need not wait behind one that does not
        waiting, self.waiting = self.waiting, []
        for turn in waiting:
            if not turn.done():
                turn.set_result(None)


def kv_tokens(backends: dict[str, InferenceBackend], block_tokens: int) -> int:
    """Tokens the local engine's KV pool holds. It is 0 when inference is remote only."""
    local = backends.get("local")
    if local is None:
        return 0
    kv = local.stats()["kv"]
    return kv.total_blocks * block_tokens if kv is not None else 0


class Admission:
    """The one admission path of every door: credentials, sockets, requests, tokens, readiness."""

    def __init__(self, state: AppState):
        self.state = state
        s: Settings = state.settings
        sec = s.security
        self.sockets = SocketCount(s.server.max_connections_per_ip)
        self._kv_tokens = 0
        self._settling: set[asyncio.Task[None]] = set()

        def api_total() -> int:
            # the API may hold this share of the engine's KV; the public chat door keeps the rest
            return math.floor(self.kv_tokens() * sec.api_kv_share) if sec.api_kv_share < 1 else 0

        # every door's running requests together never hold more than the engine's KV
        self.kv_pool = KVPool(self.kv_tokens)

        def budget(surface: Surface, total: Callable[[], int], share: float) -> TokenBudget:
            rate = TokenRate(sec.ip_tokens_per_s, sec.ip_tokens_burst)
            return TokenBudget(surface, sec.ip_tokens_in_flight, rate, total, share, self.kv_pool)

        # each door has its own budgets: API callers cannot spend what the public chat needs. The
        # public door's total is the KV the API does not hold, and one address its share of the KV:
        # strangers behind one address never hold what the others wait for. The API's callers are
        # hubs (many customers behind one address): its total bounds them, not a share.
        self.budgets = {
            Surface.PUBLIC: budget(Surface.PUBLIC, lambda: 0, sec.ip_kv_share),
            Surface.API: budget(Surface.API, api_total, 0.0),
        }

    def kv_tokens(self) -> int:
        if not self._kv_tokens and self.state.status == "ready":
            self._kv_tokens = kv_tokens(self.state.backends, self.state.settings.engine.kv_block_tokens)
        return self._kv_tokens

    # -- who --------------------------------------------------------------------------------------
    def authorize(self, surface: Surface, token: str, ip: str) -> None:
        """Raise `Refused` unless this client may use `surface` with `token`. "" means none was given."""
        sec = self.state.settings.security
        if surface is Surface.PUBLIC:
            if sec.ws_token and not same_token(token, sec.ws_token):
                raise Refused(
                    "unauthorized", "a valid auth_token is required in hello", 401, Close.UNAUTHORIZED
                )
            return
        if surface is Surface.API and not sec.api_enabled:
            raise Refused("api_disabled", "the HTTP inference API is turned off on this server", 404)
        expected = sec.api_token if surface is Surface.API else sec.ops_token
        setting = "security.api_token" if surface is Surface.API else "security.ops_token"
        if expected:
            if not same_token(token, expected):
                raise Refused(
                    "unauthorized",
                    "missing or wrong bearer token (Authorization header)",
                    401,
                    Close.UNAUTHORIZED,
                )
        elif not is_loopback(ip):
            raise Refused(
                "forbidden", f"this endpoint answers this host only while {setting} is not set", 403
            )

    # -- how often --------------------------------------------------------------------------------
    async def take_request(self, ip: str, what: str = "requests") -> None:
        """One request (or WebSocket message) from the client's bucket. Every door shares it."""
        wait = await self.state.ip_take(client_key(ip))
        if wait > 0:
            limiter = self.state.ip_limiter
            raise Refused(
                "rate_limited",
                f"too many {what} (limit {limiter.rate:g}/s per client address, burst {limiter.burst}); "
                f"retry in {wait:.2f} s",
                429,
                retry_after_s=wait,
            )

    # -- how much ---------------------------------------------------------------------------------
    def reserve(self, surface: Surface, ip: str, tokens: int) -> Reservation:
        """Hold `tokens` for one request of `surface`. That is what the request holds of the KV while it
        runs: its whole prompt plus the most it may generate.
        """
        return self.budgets[surface].reserve(ip, tokens)

    async def reserve_queued(self, surface: Surface, ip: str, tokens: int) -> Reservation:
        """`reserve` for the API. A request may fit its door's budget but not this moment. It waits its turn
        (`security.api_queue_s`, at most `security.api_queue_max` at once), then gets 429.
        """
        sec = self.state.settings.security
        return await self.budgets[surface].reserve_queued(ip, tokens, sec.api_queue_s, sec.api_queue_max)

    def release_when_done(self, reservation: Reservation, stream: Generation, prompt_tokens: int) -> None:
        """Give the tokens back when `stream` ends, however it ends. A client may leave mid-stream."""

        async def settle() -> None:
            used = None
            try:
                used = prompt_tokens + (await stream.result()).usage.generated_tokens
            finally:
                reservation.release(used)

        task = asyncio.create_task(settle())
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    # -- whether ----------------------------------------------------------------------------------
    def check_serving(self) -> None:
        readiness = self.state.readiness()
        if readiness.draining:
            raise Refused(
                "shutting_down", "the server is shutting down; retry in a moment", 503, Close.GOING_AWAY
            )
        if not readiness.serving:
            raise Refused("not_ready", readiness.public_reason, 503, Close.NOT_READY)


class SocketGate:
    """ASGI wrapper. A client's WebSocket connections past its cap are refused before any endpoint."""

    def __init__(self, app: ASGIApp, admission: Admission):
        self.app, self.admission = app, admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        ip = client[0] if client else ""
        try:
            self.admission.sockets.open(ip)
        except Refused as refused:
            self.admission.state.metrics.error(refused.code)
            await receive()  # websocket.connect
            await send({"type": "websocket.accept"})
            error = events.error_event(refused.code, refused.message, None)
            await send({"type": "websocket.send", "text": events.dumps(error)})
            await send({"type": "websocket.close", "code": int(refused.close), "reason": refused.code})
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.sockets.close(ip)
