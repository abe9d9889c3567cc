"""The remote bench's placements (rtbench/remote_bench.py): which cores llama-server and the hub get."""

from __future__ import annotations

import os

import pytest

from rtbench.remote_bench import placement_cpus


def cores() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()


def test_shared_pins_nothing_and_split_gives_disjoint_halves_of_the_cores():
    assert placement_cpus("shared", 2)[:3] == (None, None, 2)
    if len(cores()) < 2:
        pytest.skip("needs at least 2 usable cores to split")
    llama, hub, threads, described = placement_cpus("split", 2)
    assert llama and hub and not llama & hub and llama | hub == cores()
    assert threads == len(llama) == len(cores()) // 2 and "split" in described


def test_split_is_refused_on_one_core():
    if len(cores()) >= 2:
        pytest.skip("needs a single usable core (here split has room)")
    with pytest.raises(ValueError, match="at least 2 cores|cannot pin"):
        placement_cpus("split", 2)


def test_an_unknown_placement_is_refused_by_name():
    with pytest.raises(ValueError, match="'sideways'"):
        placement_cpus("sideways", 2)
