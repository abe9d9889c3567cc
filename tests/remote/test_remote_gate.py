"""remote/gate.py: which requests the send gate holds together and when it lets them go."""

from __future__ import annotations

import asyncio

import pytest

from rtserver.remote.gate import SendGate

pytestmark = pytest.mark.asyncio

WINDOW_S = 1.0  # long beside the few loop turns between two joins: a busy machine does not change groups


async def joined(gate: SendGate, name: str, log: list[str]) -> None:
    gate.arrived()  # as the backend does: the request is started, takes its connection, reaches the gate
    await gate.wait(gate.expect())
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


async def test_a_request_started_but_not_yet_at_the_gate_holds_the_group():
    """What counts is that requests are still being started (the hub is taking a burst in), not that
    they have reached the gate: one started within the window keeps the first waiting although it
    comes to the gate much later than the window."""
    gate, log = SendGate(0.2, 10.0), []
    first = asyncio.ensure_future(joined(gate, "a", log))
    for _ in range(4):  # a request is started every 0.1 s for 0.4 s, none of them at the gate yet
        await asyncio.sleep(0.1)
        gate.arrived()
    assert not first.done()
    late = asyncio.ensure_future(gate.wait())  # one of them reaches the gate
    await asyncio.wait_for(asyncio.gather(first, late), 10)
    assert log == ["a"] and gate.groups == 1


async def test_a_request_still_connecting_holds_the_group_past_the_window():
    """A request started but not yet at the gate (taking its connection) keeps the group waiting long
    after the window, until it comes: the one that found a kept-alive connection does not leave alone."""
    gate, log = SendGate(0.05, 10.0), []
    gate.arrived()
    connecting = gate.expect()
    first = asyncio.ensure_future(joined(gate, "a", log))
    await asyncio.sleep(0.5)  # ten windows
    assert not first.done()
    second = asyncio.ensure_future(gate.wait(connecting))
    await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert log == ["a"] and gate.groups == 1 and gate.requests == 2


async def test_a_request_that_ends_before_the_gate_no_longer_holds_the_group():
    gate, log = SendGate(0.05, 10.0), []
    gate.arrived()
    failed = gate.expect()
    first = asyncio.ensure_future(joined(gate, "a", log))
    await asyncio.sleep(0.3)
    assert not first.done()
    gate.forget(failed)  # e.g. its connection was refused
    await asyncio.wait_for(first, 5)
    assert log == ["a"] and gate.groups == 1


async def test_a_request_that_never_comes_holds_the_group_no_longer_than_the_longest_hold():
    gate, log = SendGate(0.05, 0.3), []
    gate.expect()  # never waits, never forgotten
    await asyncio.wait_for(joined(gate, "a", log), 5)
    assert log == ["a"] and gate.groups == 1


async def test_a_lone_request_waits_the_window_only():
    gate, log = SendGate(0.05, 10.0), []
    await asyncio.wait_for(joined(gate, "a", log), 5)
    assert log == ["a"] and gate.groups == 1


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
