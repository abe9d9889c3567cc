"""The KV pool's element type and size: `engine.kv_dtype` and `engine.kv_budget_mb` resolved for this
model and machine, with the reason `auto` gave (shown in /health)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .kv_rows import Q8_0, kv_dtype_name
from .model import LoadedModel

_NAMED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "q8_0": Q8_0}

# `kv_budget_mb = 0`: this share of the memory available at start, within these bounds (MB).
AUTO_SHARE = 0.25
AUTO_MIN_MB, AUTO_MAX_MB = 256, 4096


@dataclass(frozen=True)
class KVMemory:
    """What the KV pool is made of: element type (kv_rows.Q8_0 for q8_0 rows), budget, and why."""

    dtype: torch.dtype
    budget_mb: int
    dtype_why: str
    budget_why: str

    def describe(self) -> dict[str, object]:
        return {
            "dtype": kv_dtype_name(self.dtype),
            "dtype_why": self.dtype_why,
            "budget_mb": self.budget_mb,
            "budget_why": self.budget_why,
        }


def kv_dtype_for(setting: str, loaded: LoadedModel) -> tuple[torch.dtype, str]:
    """The pool's element type for a `kv_dtype` setting, and why."""
    if setting != "auto":
        return _NAMED[setting], "engine.kv_dtype"
    if loaded.dtype_name == "float32":
        return torch.float32, "dtype float32 is exact, so its KV is float32 too"
    if loaded.dtype in (torch.bfloat16, torch.float16):
        return loaded.dtype, "the model's own dtype"
    # float16 keeps 3 more mantissa bits than bfloat16: greedy replies stay those of float32 KV
    return torch.float16, "16-bit KV: float16 rounds K/V finer than bfloat16"


def available_mb() -> int | None:
    """Memory available to this process now: MemAvailable, or the cgroup's limit if lower."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) // 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            cap = Path(limit).read_text().strip()
            if cap != "max" and int(cap) < 1 << 60:
                found.append((int(cap) - int(Path(usage).read_text())) >> 20)
        except (OSError, ValueError):
            continue
    return max(0, min(found)) if found else None


def kv_budget_for(setting_mb: int, available: int | None) -> tuple[int, str]:
    """The pool's size in MB for a `kv_budget_mb` setting (0: from the available memory), and why."""
    if setting_mb > 0:
        return setting_mb, "engine.kv_budget_mb"
    if available is None:
        return 1024, "available memory unknown: 1024 MB"
    mb = int(min(AUTO_MAX_MB, max(AUTO_MIN_MB, available * AUTO_SHARE)))
    return mb, f"{AUTO_SHARE:.0%} of {available} MB available at start, within {AUTO_MIN_MB}-{AUTO_MAX_MB} MB"


def resolve_kv_memory(dtype_setting: str, budget_setting_mb: int, loaded: LoadedModel) -> KVMemory:
    dtype, dtype_why = kv_dtype_for(dtype_setting, loaded)
    budget, budget_why = kv_budget_for(budget_setting_mb, available_mb())
    return KVMemory(dtype, budget, dtype_why, budget_why)
