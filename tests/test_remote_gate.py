"""remote/gate.py: which requests the send gate holds together and when it lets them go."""

from __future__ import annotations

import asyncio

import pytest

from rtserver.remote.gate import SendGate

pytestmark = pytest.mark.asyncio

WINDOW_S = 1.0  # long beside the few loop turns between two joins: a busy machine does not change groups


async def joined(gate: SendGate, name: str, log: list[str]) -> None:
    await gate.wait()
    log.append(name)


async def test_a_request_waits_for_the_ones_that_join_within_the_window():
    gate, log = SendGate(WINDOW_S, 4 * WINDOW_S), []
    first = asyncio.ensure_future(joined(gate, "a", log))
    for _ in range(5):
        await asyncio.sleep(0)  # a few loop turns later: another request of the same burst
    assert not first.done()
    second = asyncio.ensure_future(joined(gate, "b", log))
    await asyncio.wait_for(asyncio.gather(first, second), 10 * WINDOW_S)
    assert log == ["a", "b"] and gate.groups == 1 and gate.requests == 2


async def test_a_steady_stream_is_released_after_the_longest_hold():
    gate, log = SendGate(0.1, 0.3), []
    trickle = []
    for i in range(30):  # one request every 0.05 s for 1.5 s: never quiet for the window
        trickle.append(asyncio.ensure_future(joined(gate, str(i), log)))
        await asyncio.sleep(0.05)
    await asyncio.wait_for(asyncio.gather(*trickle), 10)
    assert gate.groups >= 3 and log == [str(i) for i in range(30)]


async def test_a_cancelled_request_does_not_hold_back_or_cancel_its_group():
    gate, log = SendGate(WINDOW_S, 4 * WINDOW_S), []
    leaving = asyncio.ensure_future(joined(gate, "a", log))
    staying = asyncio.ensure_future(joined(gate, "b", log))
    await asyncio.sleep(0)
    leaving.cancel()
    await asyncio.wait_for(staying, 10 * WINDOW_S)
    assert leaving.cancelled() and log == ["b"]


async def test_with_the_gate_off_a_request_passes_at_once():
    gate = SendGate(0.0, 0.0)
    task = asyncio.ensure_future(gate.wait())
    await asyncio.sleep(0)
    assert task.done() and gate.groups == 1
