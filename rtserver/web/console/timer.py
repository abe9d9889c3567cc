"""When the console's deadlines fire: the login deadline and the take-over grace."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Timer(Protocol):
    """Runs a callback after a delay; tests pass one they move by hand."""

    def call_later(self, delay: float, callback: Callable[[], None]) -> Cancellable: ...


class LoopTimer:
    """Callbacks on the running event loop's clock."""

    def call_later(self, delay: float, callback: Callable[[], None]) -> Cancellable:
        return asyncio.get_running_loop().call_later(delay, callback)


LOOP_TIMER = LoopTimer()
