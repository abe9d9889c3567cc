"""A clock that tests move by hand, passed where the code reads time.monotonic (the breaker's), and
a timer on it, passed where the code would call the event loop's call_later (the console's)."""

from __future__ import annotations

import time
from collections.abc import Callable


class FakeClock:
    """Stands still until `advance`. It starts at the real monotonic time (so it can replace that clock),
    rounded to a whole second so that steps such as 0.25 add exactly."""

    def __init__(self) -> None:
        self.now = float(round(time.monotonic()))

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeCall:
    """One callback a `FakeTimer` holds: `cancel` it like an event loop's timer handle."""

    def __init__(self, when: float, delay: float, callback: Callable[[], None]) -> None:
        self.when, self.delay, self.callback = when, delay, callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeTimer:
    """`call_later` on a FakeClock: a callback runs when `advance` moves the clock to its time."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.calls: list[FakeCall] = []

    def call_later(self, delay: float, callback: Callable[[], None]) -> FakeCall:
        call = FakeCall(self.clock() + delay, delay, callback)
        self.calls.append(call)
        return call

    def pending(self, delay: float) -> int:
        """How many callbacks set with this delay wait to run."""
        return sum(1 for c in self.calls if c.delay == delay and not c.cancelled)

    def advance(self, seconds: float) -> None:
        """Move the clock, running what falls due in the order of its time."""
        self.clock.advance(seconds)
        while due := [c for c in self.calls if not c.cancelled and c.when <= self.clock()]:
            call = min(due, key=lambda c: c.when)
            self.calls.remove(call)
            call.callback()
        self.calls = [c for c in self.calls if not c.cancelled]
