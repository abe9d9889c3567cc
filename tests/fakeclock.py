"""A clock that tests move by hand, passed where the code reads time.monotonic (the breaker's)."""

from __future__ import annotations

import time


class FakeClock:
    """Stands still until `advance`. It starts at the real monotonic time (so it can replace that clock),
    rounded to a whole second so that steps such as 0.25 add exactly."""

    def __init__(self) -> None:
        self.now = float(round(time.monotonic()))

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
