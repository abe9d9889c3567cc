"""A stateless task's result cache: `ResultCache`, its entries kept per scope, and its hit counts.

A scope (a session, the HTTP API) never sees another's entries, nor how fast they come back.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from cachetools import TTLCache

from .declare import TaskOutput

# (scope, the normalised text, the decoding overrides as text)
CacheKey = tuple[Hashable, str, str]


class ResultCache:
    """Call results by scope, input and overrides, for `ttl_s` seconds (no entries: nothing kept)."""

    def __init__(self, size: int, ttl_s: float):
        self.entries: TTLCache[CacheKey, TaskOutput] | None = TTLCache(size, ttl_s) if size else None
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(scope: Hashable, text: str, overrides: Mapping[str, object] | None) -> CacheKey:
        """Inputs that differ only in case or spacing share an entry."""
        shown = "[]" if not overrides else repr(sorted(overrides.items()))
        return (scope, " ".join(text.split()).lower(), shown)

    def get(self, key: CacheKey) -> TaskOutput | None:
        """The entry as a cached result, counted as a hit or a miss."""
        if self.entries is None:
            return None
        hit = self.entries.get(key)
        if hit is None:
            self.misses += 1
            return None
        self.hits += 1
        return TaskOutput(hit.task, hit.output, hit.text, hit.usage, hit.timing, True)

    def put(self, key: CacheKey, out: TaskOutput) -> None:
        if self.entries is not None:
            self.entries[key] = out
