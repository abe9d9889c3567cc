"""How the reports print a figure: `fmt` for values, `times` for ratios against a bar."""

from __future__ import annotations


def fmt(v: float | None, unit: str = "") -> str:
    return "n/a" if v is None else f"{v:,.1f}{unit}"


def times(v: float | None) -> str:
    """A ratio to two decimals: the bars sit at 0.5x and 1.5x."""
    return "n/a" if v is None else f"{v:.2f}x"
