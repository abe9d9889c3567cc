"""The API door's queue: a request that fits its budget but not this moment waits for running ones to
end, oldest first, within a bounded time and count, then gets 429 with a retry hint."""

from __future__ import annotations

import asyncio
import time

import pytest

from rtserver.web.admission import Refused, Surface, TokenBudget, TokenRate


def budget(total: int) -> TokenBudget:
    return TokenBudget(Surface.API, 0, TokenRate(0.0, 1), lambda: total)


async def test_a_request_that_fits_the_door_waits_for_its_turn():
    api = budget(100)
    running = api.reserve("10.0.0.1", 80)
    asyncio.get_running_loop().call_later(0.2, running.release)
    start = time.monotonic()
    held = await api.reserve_queued("10.0.0.2", 50, wait_s=5.0, max_waiting=8)
    assert 0.15 <= time.monotonic() - start < 2.0
    assert api.held == 50 and held.tokens == 50 and not api.waiting


async def test_waiters_that_fit_go_before_one_that_does_not():
    api = budget(100)
    api.reserve("10.0.0.1", 30)
    running = api.reserve("10.0.0.1", 60)
    big = asyncio.create_task(api.reserve_queued("10.0.0.2", 100, wait_s=0.5, max_waiting=8))
    small = asyncio.create_task(api.reserve_queued("10.0.0.3", 60, wait_s=5.0, max_waiting=8))
    await asyncio.sleep(0.05)
    running.release()
    assert (await small).tokens == 60  # the older one does not fit beside the 30 still held
    with pytest.raises(Refused) as refused:
        await big
    assert refused.value.code == "over_budget" and refused.value.status == 429
    assert "waited 0.5 s" in refused.value.message and refused.value.retry_after_s > 0


async def test_the_wait_and_the_queue_are_bounded():
    api = budget(100)
    api.reserve("10.0.0.1", 100)
    start = time.monotonic()
    with pytest.raises(Refused) as late:
        await api.reserve_queued("10.0.0.2", 10, wait_s=0.2, max_waiting=8)
    assert 0.15 <= time.monotonic() - start < 2.0 and late.value.code == "over_budget"
    first = asyncio.create_task(api.reserve_queued("10.0.0.3", 10, wait_s=5.0, max_waiting=1))
    await asyncio.sleep(0.05)
    start = time.monotonic()
    with pytest.raises(Refused) as full:  # one waits already: the next is refused at once
        await api.reserve_queued("10.0.0.4", 10, wait_s=5.0, max_waiting=1)
    assert time.monotonic() - start < 0.1 and full.value.code == "over_budget"
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    assert not api.waiting  # a caller that left is not woken later


async def test_a_request_that_can_never_fit_is_refused_at_once():
    api = budget(100)
    start = time.monotonic()
    with pytest.raises(Refused) as refused:
        await api.reserve_queued("10.0.0.2", 101, wait_s=5.0, max_waiting=8)
    assert refused.value.code == "request_too_large" and time.monotonic() - start < 0.1
