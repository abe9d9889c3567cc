"""How hard fitting a learned head pushes: `Pace`, and the low-priority pace of a background fit.

A start-up never fits (`run.py` loads stored fits only). `rtserver fit-heads` fits at full pace; a
server set to fit in the background uses `background_pace()`, so its users keep the model.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass


@dataclass(frozen=True)
class Pace:
    """Examples whose features are computed at once, and where the classifier's fit runs."""

    concurrency: int = 64  # below the engine's waiting-queue bound
    executor: Executor | None = None  # None: the event loop's default threads


FULL = Pace()
BACKGROUND_NICE = 10


def _lower_priority() -> None:
    # On Linux a thread's nice value is its own: only the fitting thread yields its cores.
    with contextlib.suppress(OSError):
        os.nice(BACKGROUND_NICE)


@contextlib.contextmanager
def background_pace() -> Iterator[Pace]:
    """Two examples at a time beside the users' requests, the fit on one low-priority thread (let go
    when the block ends)."""
    executor = ThreadPoolExecutor(1, thread_name_prefix="head-fit", initializer=_lower_priority)
    try:
        yield Pace(concurrency=2, executor=executor)
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
