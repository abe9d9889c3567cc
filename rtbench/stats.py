"""The arithmetic of the reports of `rtserver bench`, `rtserver loadtest` and `rtserver eval`, in one place.

Every function takes plain numbers and answers None where the figure does not exist (no values, a
division by zero, a missing operand) instead of raising or inventing a 0, so a report shows "n/a".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-quantile (q in 0..1) with linear interpolation between the closest ranks (numpy's default,
    `statistics.quantiles(method="inclusive")`): q=0 is the smallest value, q=1 the largest, q=0.5 the
    median. None for no values."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q = {q!r}: a quantile is between 0 and 1")
    ordered = sorted(values)
    if not ordered:
        return None
    k = (len(ordered) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def median(values: Iterable[float]) -> float | None:
    return percentile(values, 0.5)


def mean(values: Iterable[float]) -> float | None:
    """The arithmetic mean; None for no values."""
    items = list(values)
    return sum(items) / len(items) if items else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b; None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def per_second(count: float, seconds: float | None) -> float | None:
    """A rate: count / seconds; None when no time was measured (None, 0 or negative seconds)."""
    if seconds is None or seconds <= 0:
        return None
    return count / seconds


def fraction(flags: Iterable[Any]) -> float | None:
    """The share of true values (e.g. the invalid-output rate); None for no values."""
    items = [bool(f) for f in flags]
    return sum(items) / len(items) if items else None


def accuracy(predicted: Sequence[Any], expected: Sequence[Any]) -> float | None:
    """The share of positions where the prediction equals the expected value (a missing prediction,
    None, counts as wrong); None for no values. Both sequences must have the same length."""
    if len(predicted) != len(expected):
        raise ValueError(f"{len(predicted)} predictions for {len(expected)} expected values")
    return fraction(p is not None and p == e for p, e in zip(predicted, expected))


def known(value: float | None) -> float:
    """A figure every finished run has (a first token's time); TypeError, as arithmetic on None
    would raise, when it is missing."""
    if value is None:
        raise TypeError("a figure every finished run has is missing")
    return value


def rounded(value: float | None, digits: int = 1) -> float | None:
    """round(), passing None through."""
    return None if value is None else round(value, digits)
