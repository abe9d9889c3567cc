"""Console background work: it logs what fails and never raises into the caller."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine

from ..seams import StoreUnavailable

log = logging.getLogger("rtserver.console")

_running: set[asyncio.Task[None]] = set()  # held until done: the loop keeps only weak references


def spawn(coro: Coroutine[object, object, object]) -> None:
    """Run console work in the background; Redis being down is no failure worth a log line."""

    async def run() -> None:
        try:
            await coro
        except StoreUnavailable:
            pass
        except Exception:
            log.exception("console task failed")

    task = asyncio.get_running_loop().create_task(run())
    _running.add(task)
    task.add_done_callback(_running.discard)
