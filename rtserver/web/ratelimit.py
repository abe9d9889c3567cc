"""Token-bucket rate limits: one bucket per connection and one per client IP.

A bucket holds up to `burst` tokens and refills at `rate` tokens per second; every message (WebSocket
frame or HTTP API request) takes one. An empty bucket refuses with the seconds until the next token,
which the client gets as `retry_after_s` (WebSocket) or `Retry-After` (HTTP). Per-IP buckets live in a
bounded TTL cache: a bucket unused long enough to be full again carries no state worth keeping.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from cachetools import TTLCache


class TokenBucket:
    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens = float(burst)
        self.updated = clock()

    def take(self) -> float:
        """Take a token: 0.0 when allowed, else the seconds until one is available (nothing taken)."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class IPRateLimiter:
    """One bucket per client IP, shared by its WebSocket messages and HTTP API requests."""

    def __init__(
        self, rate: float, burst: int, max_ips: int = 100_000, clock: Callable[[], float] = time.monotonic
    ):
        self.rate, self.burst, self.clock = rate, burst, clock
        # a bucket idle for burst/rate seconds is full again: dropping it then changes nothing
        self.buckets: TTLCache[str, TokenBucket] = TTLCache(
            maxsize=max_ips, ttl=max(1.0, burst / rate) if rate > 0 else 1.0, timer=clock
        )

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def take(self, ip: str) -> float:
        if not self.enabled:
            return 0.0
        bucket = self.buckets.get(ip)
        if bucket is None:
            bucket = TokenBucket(self.rate, self.burst, self.clock)
        wait = bucket.take()
        self.buckets[ip] = bucket  # re-insert: the TTL counts from the last use
        return wait


def retry_after_header(wait_s: float) -> str:
    """HTTP Retry-After is whole seconds; never 0 for a refused request."""
    return str(max(1, math.ceil(wait_s)))
