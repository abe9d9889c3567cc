"""The remote servers a backend spreads its work over: health, circuit breaker, in-flight bound, affinity.

A session sticks to the up URL with the highest rendezvous hash, so its turns meet the server's prefix
cache and only a downed URL's sessions move. Task calls go to the fewest in flight. `failures_to_open`
failures in a row open a URL's breaker for `retry_after_s`; then one probe at a time decides. The
breaker reads `clock` (time.monotonic unless a test passes its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field

from ..engine.backend import UpstreamStats


class BackendUnavailable(Exception):
    """No remote server can take the request (all down or all full), or the one serving it failed."""

    code = "backend_unavailable"

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail  # names servers: for logs and operators only
        self.message = "no inference server can take this request now; retry in a moment"


@dataclass
class Upstream:
    url: str
    max_in_flight: int
    in_flight: int = 0
    failures: int = 0  # consecutive
    opened_at: float | None = None  # breaker open since (monotonic), None when closed
    last_error: str | None = None
    last_ok: float | None = None
    requests: int = 0
    errors: int = 0
    latency_s: list[float] = field(default_factory=list)  # recent times to first byte
    # False while the server has not passed its owner's start-up check (what it serves, its tokenizer):
    # no request goes there, not even as a breaker's probe; only that check can let it in
    checked: bool = True

    def record_latency(self, seconds: float) -> None:
        self.latency_s.append(seconds)
        del self.latency_s[:-256]


class Wakeup:
    """Bounded waits for room: each `wake` lets every waiter look again."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def wake(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def next(self, deadline: float) -> bool:
        """Wait for the next wake, at most until `deadline` (time.monotonic); False once it has passed."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), remaining)
        return True


class UpstreamPool:
    def __init__(
        self,
        urls: list[str],
        max_in_flight: int,
        failures_to_open: int,
        retry_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.upstreams = [Upstream(url.rstrip("/"), max_in_flight) for url in urls]
        self.failures_to_open = failures_to_open
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.changed = Wakeup()  # a URL came back or a request ended: waiters look again

    # -- state ------------------------------------------------------------------------------------------
    def usable(self, up: Upstream, now: float | None = None) -> bool:
        """Closed breaker; or half-open with nothing in flight there: the one request let through is the
        probe (choosing and `acquire` run without a pause between them, so two cannot both pass)."""
        if not up.checked:
            return False
        if up.opened_at is None:
            return True
        return self.waited(up, now) and up.in_flight == 0

    def waited(self, up: Upstream, now: float | None = None) -> bool:
        """Open for `retry_after_s` already: a probe may go (closed breakers too)."""
        if up.opened_at is None:
            return True
        return (now if now is not None else self.clock()) - up.opened_at >= self.retry_after_s

    def state(self, up: Upstream) -> str:
        if not up.checked:
            return "down"
        if up.opened_at is None:
            return "up"
        return "probing" if self.waited(up) else "down"

    def succeeded(self, up: Upstream) -> None:
        was_down = up.opened_at is not None
        up.failures, up.opened_at, up.last_error, up.last_ok = 0, None, None, self.clock()
        if was_down:
            self.changed.wake()

    def probe_answered(self, up: Upstream, opened_at: float | None) -> None:
        """A health probe that began when the breaker was at `opened_at` answered. A request that
        failed while it was in flight is newer news: then the breaker stays open."""
        if up.opened_at == opened_at:
            self.succeeded(up)

    def failed(self, up: Upstream, reason: str) -> None:
        up.failures += 1
        up.errors += 1
        up.last_error = reason
        if up.failures >= self.failures_to_open or up.opened_at is not None:
            up.opened_at = self.clock()  # (re)open: a failed probe waits another retry_after_s

    def mark_down(self, up: Upstream, reason: str) -> None:
        """Open the breaker now (a URL found down at start)."""
        up.errors += 1
        up.failures = max(up.failures, self.failures_to_open)
        up.last_error = reason
        up.opened_at = self.clock()

    # -- choosing ---------------------------------------------------------------------------------------
    def choose(self, session_key: Hashable | None, exclude: Collection[str] = ()) -> Upstream:
        """The URL for a request: the session's by rendezvous hashing over usable URLs (full ones
        included: a session waits for its own server rather than losing its cache), else the least
        busy. Raises BackendUnavailable when none is usable."""
        now = self.clock()
        live = [u for u in self.upstreams if u.url not in exclude and self.usable(u, now)]
        if not live:
            states = ", ".join(
                f"{u.url} {self.state(u)}" + (f" ({u.last_error})" if u.last_error else "")
                for u in self.upstreams
            )
            raise BackendUnavailable(f"no inference server is available: {states}")
        if session_key is None:
            return min(live, key=lambda u: (u.in_flight / u.max_in_flight, u.failures))
        return max(live, key=lambda u: _rendezvous(session_key, u.url))

    async def acquire(self, up: Upstream, timeout_s: float) -> None:
        """Wait (bounded) for room on `up`; BackendUnavailable if it stays full."""
        # the wait is the event loop's (asyncio.wait_for), so its deadline is on the real clock, not `clock`
        deadline = time.monotonic() + timeout_s
        while up.in_flight >= up.max_in_flight:
            if not await self.changed.next(deadline):
                raise BackendUnavailable(
                    f"{up.url}: {up.in_flight} requests in flight (max_in_flight_per_url)"
                )
        up.in_flight += 1
        up.requests += 1

    def try_acquire_spare(self, up: Upstream) -> bool:
        """Take room on `up` for optional work (a prefetch) only if it is up and, after it, room for at
        least one more request stays free: optional work never makes a live request wait."""
        if self.state(up) != "up" or up.in_flight + 2 > up.max_in_flight:
            return False
        up.in_flight += 1
        return True

    def release(self, up: Upstream) -> None:
        up.in_flight -= 1
        self.changed.wake()

    def snapshot(self) -> list[UpstreamStats]:
        out: list[UpstreamStats] = []
        for u in self.upstreams:
            lat = sorted(u.latency_s)
            out.append(
                {
                    "url": u.url,
                    "state": self.state(u),
                    "in_flight": u.in_flight,
                    "requests": u.requests,
                    "errors": u.errors,
                    "last_error": u.last_error,
                    "ttfb_p50_ms": round(lat[len(lat) // 2] * 1000, 1) if lat else None,
                }
            )
        return out


def _rendezvous(key: Hashable, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\x00{url}".encode(), digest_size=8).digest(), "big")
