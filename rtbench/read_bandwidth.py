"""The machine's streaming read bandwidth, as the formats bench's floor needs it. A single stream reads
every weight once a token. So file bytes ÷ this bandwidth is the least time a token can take.

torch reduces a 1 GiB array already in memory with the bench's thread count. It runs sum and max, and keeps
whichever reads faster. The best of a few tries is kept. So the figure is what the memory gives, not what a
busy moment left.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

SIZE_MB, TRIES = 1024, 3


def measure(
    threads: int, size_mb: int = SIZE_MB, tries: int = TRIES, clock: Callable[[], float] = time.perf_counter
) -> dict[str, Any]:
    """GB/s (10^9 bytes) of the fastest reduction over `size_mb` MiB with `threads` threads. Every try's
    figure goes beside it.
    """
    data = torch.ones(size_mb << 18, dtype=torch.float32)  # written once: every page is resident
    reductions: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"sum": torch.sum, "max": torch.amax}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seconds: dict[str, list[float]] = {name: [] for name in reductions}
        for _ in range(tries):
            for name, reduce in reductions.items():
                started = clock()
                reduce(data).item()
                seconds[name].append(clock() - started)
    finally:
        torch.set_num_threads(before)
    per_try = {name: [data.nbytes / s / 1e9 for s in times] for name, times in seconds.items()}
    best = max(per_try, key=lambda name: max(per_try[name]))
    return {
        "gb_per_s": max(per_try[best]),
        "method": f"torch.{best} over {size_mb} MiB of float32, {threads} threads, best of {tries}",
        "tries_gb_per_s": per_try,
    }
