"""A clock that tests move by hand, passed where the code reads time.monotonic (the breaker's)."""

from __future__ import annotations

import time


class FakeClock:
    """Stands still until `advance`; starts at the real monotonic time so it can replace that clock."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
