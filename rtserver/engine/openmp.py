"""Which threads keep an OpenMP pool: the scheduler's alone. `release_pool` drops the caller's;
`limit_team` caps the caller's parallel regions, so they run inline where the kernel's threads do the work.

libgomp keeps a pool of worker threads for each thread that opens a parallel region. Once it manages
more threads than the machine has CPUs it spins only briefly before its workers sleep, and they then
wake late between the parallel loops of every step. So a thread that loaded or probed the model lets
its pool go before the scheduler runs.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
T = TypeVar("T")
OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: threads go, the runtime stays usable


def _loaded(name: str) -> set[str]:
    """The paths of this process's loaded libraries whose path holds `name` (none off Linux)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return set()
    return {line.split()[-1] for line in maps.read_text().splitlines() if name in line}


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """torch's libgomp as already loaded (the same handle), or None without one."""
    paths = _loaded("libgomp")
    ours = sorted(p for p in paths if "/torch/" in p) or sorted(p for p in paths if ".libs/" not in p)
    if not ours:
        return None
    lib = ctypes.CDLL(ours[0])
    return lib if hasattr(lib, "omp_pause_resource_all") else None


@functools.cache
def _mkl() -> ctypes.CDLL | None:
    """torch's MKL, where it exports the per-thread count (its vector math opens regions of its own)."""
    paths = sorted(_loaded("libtorch_cpu"))
    if not paths:
        return None
    lib = ctypes.CDLL(paths[0])
    return lib if hasattr(lib, "MKL_Set_Num_Threads_Local") else None


def release_pool() -> bool:
    """End the calling thread's OpenMP workers; the next parallel region there makes new ones."""
    lib = _runtime()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


def limit_team(threads: int) -> bool:
    """The calling thread's parallel regions, torch's among them, run on at most `threads` threads. Other
    threads keep their count: libgomp holds it per thread. False without libgomp.
    """
    lib = _runtime()
    if lib is None:
        return False
    torch.get_num_threads()  # torch sets a thread's count at its first use: that must come before ours
    lib.omp_set_num_threads(threads)
    if (mkl := _mkl()) is not None:
        mkl.MKL_Set_Num_Threads_Local(threads)
    return torch.get_num_threads() == threads


def pool_released(fn: Callable[P, T]) -> Callable[P, T]:
    """`fn` that lets its thread's OpenMP pool go when it returns (for work on a kept executor thread)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            release_pool()

    return run
