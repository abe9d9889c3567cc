"""Token buckets with a fake clock."""

from __future__ import annotations

import pytest

from rtserver.web.ratelimit import IPRateLimiter, TokenBucket, retry_after_header


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_bucket_allows_burst_then_refills_at_rate():
    clock = Clock()
    bucket = TokenBucket(rate=2.0, burst=3, clock=clock)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take() == pytest.approx(0.5)  # one token comes back every 1/rate s
    clock.now += 0.25
    assert bucket.take() == pytest.approx(0.25)  # a refused take costs nothing
    clock.now += 0.25
    assert bucket.take() == 0.0
    clock.now += 100  # refills to the burst, not beyond
    assert [bucket.take() for _ in range(4)][-1] > 0


def test_ip_limiter_keeps_one_bucket_per_address():
    clock = Clock()
    limiter = IPRateLimiter(rate=1.0, burst=2, clock=clock)
    assert limiter.take("10.0.0.1") == 0.0 and limiter.take("10.0.0.1") == 0.0
    assert limiter.take("10.0.0.1") == pytest.approx(1.0)
    assert limiter.take("10.0.0.2") == 0.0  # another address has its own bucket
    clock.now += 5  # idle past burst/rate: the bucket is dropped, and a new one is full again
    assert limiter.take("10.0.0.1") == 0.0 and len(limiter.buckets) == 1


def test_ip_limiter_off_at_rate_zero():
    limiter = IPRateLimiter(rate=0.0, burst=1)
    assert all(limiter.take("x") == 0.0 for _ in range(1000)) and not limiter.buckets


def test_retry_after_header_is_whole_seconds_and_never_zero():
    assert retry_after_header(0.01) == "1" and retry_after_header(1.2) == "2"
