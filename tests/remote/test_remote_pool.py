"""Unit tests of the remote backend's building blocks: `UpstreamPool` (rendezvous affinity, circuit
breaker, bounded in-flight) and `sse_payloads` (the bounded server-sent-event reader). No network."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from rtserver.remote.pool import BackendUnavailable, UpstreamPool
from rtserver.remote.sse import UpstreamProtocolError, sse_payloads

from ..fakeclock import FakeClock

URLS = ["http://a.test:1", "http://b.test:2", "http://c.test:3"]
KEYS = [f"session-{i}" for i in range(300)]


def pool(
    max_in_flight: int = 4, failures_to_open: int = 3, retry_after_s: float = 0.05, clock=None
) -> UpstreamPool:
    return UpstreamPool(URLS, max_in_flight, failures_to_open, retry_after_s, clock or FakeClock())


def assignment(p: UpstreamPool) -> dict[str, str]:
    return {k: p.choose(k).url for k in KEYS}


# -- affinity ------------------------------------------------------------------------------------------


def test_rendezvous_affinity_is_stable_and_spread():
    p = pool()
    first = assignment(p)
    assert first == assignment(p)  # the same key always goes to the same URL
    assert first == assignment(pool())  # a pure function of (key, URL): another pool agrees
    counts = Counter(first.values())
    assert set(counts) == set(URLS)
    assert all(n >= len(KEYS) // len(URLS) // 2 for n in counts.values()), counts  # roughly even
    # trailing slashes are not part of the URL's identity
    slashed = UpstreamPool([u + "/" for u in URLS], 4, 3, 1.0)
    assert assignment(slashed) == first


def test_only_the_dead_urls_sessions_move_and_they_come_back():
    p = pool(retry_after_s=60.0)
    before = assignment(p)
    dead = p.upstreams[1]
    p.mark_down(dead, "connection refused")
    assert p.state(dead) == "down"
    during = assignment(p)
    for key in KEYS:
        if before[key] == dead.url:
            assert during[key] != dead.url  # moved to its next-highest URL
        else:
            assert during[key] == before[key]  # untouched
    assert dead.url not in during.values()
    moved = [k for k in KEYS if before[k] == dead.url]
    assert {during[k] for k in moved} == {URLS[0], URLS[2]}  # spread over the others, not piled on one
    p.succeeded(dead)
    assert assignment(p) == before  # back home where their prefix cache is


def test_excluded_urls_and_sessionless_requests():
    p = pool()
    key = KEYS[0]
    home = p.choose(key).url
    assert p.choose(key, exclude={home}).url != home
    with pytest.raises(BackendUnavailable) as info:
        p.choose(key, exclude=set(URLS))
    assert all(u in info.value.detail for u in URLS)  # for logs; the client reads .message
    assert not any(u in info.value.message for u in URLS)
    # no session key: the least busy URL
    p.upstreams[0].in_flight = 2
    p.upstreams[1].in_flight = 1
    assert p.choose(None).url == URLS[2]
    p.upstreams[2].in_flight = 3
    assert p.choose(None).url == URLS[1]


# -- circuit breaker -----------------------------------------------------------------------------------


def test_breaker_opens_after_failures_probes_after_retry_and_closes_on_success():
    clock = FakeClock()
    p = pool(failures_to_open=3, retry_after_s=10.0, clock=clock)
    up = p.upstreams[0]
    p.failed(up, "boom 1")
    p.failed(up, "boom 2")
    assert p.state(up) == "up" and p.usable(up)  # two in a row: still closed
    p.succeeded(up)  # a success resets the count
    assert up.failures == 0 and up.last_error is None
    for i in range(3):
        p.failed(up, f"boom {i}")
    assert p.state(up) == "down" and not p.usable(up)
    assert up.last_error == "boom 2" and up.errors == 5
    assert all(p.choose(k).url != up.url for k in KEYS)
    clock.advance(9.75)
    assert p.state(up) == "down" and not p.usable(up)  # not yet retry_after_s
    clock.advance(0.25)
    assert p.state(up) == "probing" and p.usable(up)  # one probe may go through now
    clock.advance(5.0)
    p.failed(up, "probe failed")  # a failed probe re-opens for another retry_after_s
    assert p.state(up) == "down"
    clock.advance(9.75)
    assert p.state(up) == "down"
    clock.advance(0.25)
    assert p.state(up) == "probing"
    p.succeeded(up)
    assert p.state(up) == "up" and up.failures == 0 and up.opened_at is None
    assert up.last_ok == clock.now


async def test_half_open_lets_one_probe_through_at_a_time():
    clock = FakeClock()
    p = pool(failures_to_open=1, retry_after_s=10.0, clock=clock)
    up = p.upstreams[0]
    key = next(k for k in KEYS if p.choose(k).url == up.url)  # a session whose home is `up`
    p.failed(up, "boom")
    assert p.choose(key) is not up
    clock.advance(10.0)
    assert p.choose(key) is up  # half-open: the first request is the probe
    await p.acquire(up, 1.0)
    assert p.state(up) == "probing" and not p.usable(up)
    assert p.choose(key) is not up  # the next request does not pile onto a server still unproven
    p.release(up)
    p.succeeded(up)
    assert p.choose(key) is up and p.usable(up)


def test_an_unchecked_url_gets_no_request_not_even_as_a_probe():
    clock = FakeClock()
    p = pool(failures_to_open=1, retry_after_s=10.0, clock=clock)
    up = p.upstreams[0]
    up.checked = False  # its owner has not seen what it serves (a wrong tokenizer, say)
    p.failed(up, "tokenizer differs")
    clock.advance(60.0)  # long past retry_after_s: a checked URL would be half-open now
    assert p.state(up) == "down" and not p.usable(up)
    assert all(p.choose(k).url != up.url for k in KEYS)
    up.checked = True
    p.succeeded(up)
    assert p.usable(up) and any(p.choose(k).url == up.url for k in KEYS)


def test_all_down_is_backend_unavailable_naming_each_url():
    p = pool(retry_after_s=60.0)
    for up in p.upstreams:
        p.mark_down(up, "refused")
    with pytest.raises(BackendUnavailable) as info:
        p.choose("k")
    assert info.value.code == "backend_unavailable"
    for url in URLS:
        assert f"{url} down (refused)" in info.value.detail
    snap = p.snapshot()
    assert [s["url"] for s in snap] == URLS
    assert all(s["state"] == "down" and s["last_error"] == "refused" for s in snap)


# -- bounded in-flight ---------------------------------------------------------------------------------


async def settle() -> None:
    """Let every ready task run until it waits again (no time passes)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def test_acquire_bounds_in_flight_and_times_out():
    p = pool(max_in_flight=2)
    up = p.upstreams[0]
    await p.acquire(up, 1.0)
    await p.acquire(up, 1.0)
    assert up.in_flight == 2 and up.requests == 2
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailable) as info:
        await p.acquire(up, 0.15)
    assert 0.1 <= time.monotonic() - t0 < 2.0
    assert "max_in_flight_per_url" in info.value.detail and up.in_flight == 2
    # a waiter gets the slot as soon as one is released
    waiter = asyncio.create_task(p.acquire(up, 5.0))
    await settle()
    assert not waiter.done()
    p.release(up)
    await asyncio.wait_for(waiter, 2.0)
    assert up.in_flight == 2 and up.requests == 3
    p.release(up)
    p.release(up)
    assert up.in_flight == 0


async def test_released_slots_go_to_the_waiters_one_by_one():
    p = pool(max_in_flight=1)
    up = p.upstreams[0]
    await p.acquire(up, 1.0)
    waiters = [asyncio.create_task(p.acquire(up, 5.0)) for _ in range(3)]
    await settle()
    assert not any(w.done() for w in waiters)
    for i in range(3):
        p.release(up)
        await settle()
        assert sum(w.done() for w in waiters) == i + 1 and up.in_flight == 1  # one slot, one waiter
    p.release(up)
    await asyncio.wait_for(asyncio.gather(*waiters), 2.0)
    assert up.requests == 4 and up.in_flight == 0


# -- SSE -----------------------------------------------------------------------------------------------


async def chunks_of(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def collect(parts, **kw) -> list:
    return [p async for p in sse_payloads(chunks_of(*parts), **kw)]


async def test_sse_payloads_until_done_skipping_null_and_non_data_lines():
    stream = (
        b": a comment\n"
        b"event: completion\n"
        b'data: {"a": 1}\n\n'
        b"data: null\n\n"
        b"id: 7\n"
        b'data:{"b": 2}\r\n\r\n'
        b"data: [DONE]\n\n"
        b'data: {"after": "done"}\n\n'
    )
    assert await collect([stream]) == [{"a": 1}, {"b": 2}]


async def test_sse_events_split_across_chunk_boundaries():
    stream = b'data: {"text": "Hel"}\n\ndata: {"text": "lo \xe4\xbd\xa0"}\n\ndata: [DONE]\n\n'
    expected = [{"text": "Hel"}, {"text": "lo 你"}]
    assert await collect([stream[i : i + 1] for i in range(len(stream))]) == expected  # byte by byte
    for cut in range(1, len(stream)):
        assert await collect([stream[:cut], stream[cut:]]) == expected, cut
    # no [DONE] and no final newline: the last event still counts
    assert await collect([b'data: {"x": 1}\n\ndata: {"y"', b": 2}"]) == [{"x": 1}, {"y": 2}]


async def test_sse_non_json_and_non_object_events_are_protocol_errors():
    with pytest.raises(UpstreamProtocolError, match="not JSON"):
        await collect([b'data: {"ok": 1}\n\ndata: <html>oops</html>\n\n'])
    with pytest.raises(UpstreamProtocolError, match="not a JSON object"):
        await collect([b"data: [1, 2]\n\n"])
    with pytest.raises(UpstreamProtocolError, match="not a JSON object"):
        await collect([b'data: "text"\n\n'])


async def test_sse_oversize_line_is_an_error_without_buffering_it_all():
    # a line that never ends, in many chunks: stopped once the buffer passes the limit
    fed = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal fed
        yield b"data: "
        while True:
            fed += 1000
            yield b"x" * 1000

    with pytest.raises(UpstreamProtocolError, match="line over 10000 bytes"):
        async for _ in sse_payloads(endless(), max_line_bytes=10_000):
            pass
    assert fed <= 12_000
    # a long line complete within one chunk counts too
    with pytest.raises(UpstreamProtocolError, match="line over 100 bytes"):
        await collect([b'data: {"t": "' + b"y" * 200 + b'"}\n\n'], max_line_bytes=100)
    # lines at the limit are fine
    line = b'data: {"t": "' + b"z" * 50 + b'"}'
    assert await collect([line + b"\n\n"], max_line_bytes=len(line)) == [{"t": "z" * 50}]


async def test_sse_oversize_stream_is_an_error():
    event = b'data: {"t": "abc"}\n\n'
    with pytest.raises(UpstreamProtocolError, match="stream over 1000 bytes"):
        await collect([event] * 100, max_total_bytes=1000)
    assert len(await collect([event] * 10, max_total_bytes=1000)) == 10
