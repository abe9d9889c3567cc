"""Console failures stay in the console: hooks never raise, background work logs what fails."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec

from ..cluster import ClusterUnavailable

log = logging.getLogger("rtserver.console")

Params = ParamSpec("Params")
_running: set[asyncio.Task[None]] = set()  # held until done: the loop keeps only weak references


def safe(fn: Callable[Params, None]) -> Callable[Params, None]:
    """A hook called from the hub: a failure is logged, never raised into a customer's chat."""

    @functools.wraps(fn)
    def wrapper(*args: Params.args, **kwargs: Params.kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except Exception:
            log.exception("console hook %s failed", fn.__name__)

    return wrapper


def spawn(coro: Coroutine[Any, Any, object]) -> None:
    """Run console work in the background; Redis being down is no failure worth a log line."""

    async def run() -> None:
        try:
            await coro
        except ClusterUnavailable:
            pass
        except Exception:
            log.exception("console task failed")

    task = asyncio.get_running_loop().create_task(run())
    _running.add(task)
    task.add_done_callback(_running.discard)
