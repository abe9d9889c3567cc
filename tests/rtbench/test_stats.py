"""rtbench/stats.py, the arithmetic of the bench, load test and eval reports, against values worked
out by hand; and the report code that uses it (eval's accuracy / invalid rate, bench's agreement)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rtbench import stats
from rtbench.stats import accuracy, fraction, known, mean, median, per_second, percentile, ratio, rounded


def test_percentile_interpolates_linearly_between_ranks():
    assert percentile([], 0.5) is None
    assert percentile([], 0.0) is None
    for q in (0.0, 0.25, 0.5, 0.95, 1.0):
        assert percentile([7.0], q) == 7.0  # one value: every quantile is it
    assert percentile([3, 1, 2], 0.5) == 2  # unsorted input
    assert percentile([3, 1, 2], 0.0) == 1 and percentile([3, 1, 2], 1.0) == 3
    assert percentile([1, 2, 3, 4], 0.5) == 2.5  # between the middle two
    # k = (4 - 1) * 0.25 = 0.75: 1 + 0.75 * (2 - 1)
    assert percentile([4, 3, 2, 1], 0.25) == pytest.approx(1.75)
    assert percentile([1, 2, 3, 4], 0.75) == pytest.approx(3.25)
    # k = 4 * 0.9 = 3.6: 40 + 0.6 * (50 - 40)
    assert percentile([50, 10, 40, 20, 30], 0.9) == pytest.approx(46.0)
    # k = 99 * 0.95 = 94.05: the 95th value (95) + 0.05 * (96 - 95)
    assert percentile(range(1, 101), 0.95) == pytest.approx(95.05)
    assert percentile((x for x in [5, 5, 5]), 0.3) == 5  # any iterable, ties
    assert percentile([-2.5, 0.5], 0.5) == pytest.approx(-1.0)


@pytest.mark.parametrize("q", [-0.01, 1.01, 50, 95, 100])
def test_percentile_refuses_q_outside_0_to_1(q):
    """q is a fraction: a percent (50, 95) is an error, not a silent wrong answer."""
    with pytest.raises(ValueError, match="between 0 and 1"):
        percentile([1, 2, 3], q)


def test_median_and_mean():
    assert median([]) is None and mean([]) is None
    assert median([5, 1]) == 3.0 and median([9]) == 9 and median([3, 9, 1]) == 3
    assert mean([1, 2, 3, 4]) == 2.5 and mean([7]) == 7
    assert mean(x for x in (1, 2)) == 1.5
    assert mean([-1, 1]) == 0


def test_ratio():
    assert ratio(6, 3) == 2.0 and ratio(1, 4) == 0.25 and ratio(-3, 2) == -1.5
    assert ratio(0, 5) == 0.0  # a zero numerator is a real ratio
    assert ratio(5, 0) is None and ratio(0, 0) is None and ratio(5, 0.0) is None  # no division by zero
    assert ratio(None, 2) is None and ratio(2, None) is None and ratio(None, None) is None


def test_per_second():
    assert per_second(30, 1.5) == 20.0 and per_second(0, 2) == 0.0
    assert per_second(5, 0) is None and per_second(5, -1.0) is None and per_second(5, None) is None


def test_fraction_and_accuracy():
    assert fraction([]) is None
    assert fraction([True, False, False, True]) == 0.5
    assert fraction([1, 0, 0]) == pytest.approx(1 / 3)
    assert fraction(x > 2 for x in [1, 2, 3, 4]) == 0.5
    assert accuracy([], []) is None
    assert accuracy(["a", "b", "c", "a"], ["a", "b", "a", "a"]) == 0.75
    assert accuracy([None, "b"], ["a", "b"]) == 0.5  # a missing (invalid) prediction is wrong
    assert accuracy([None], [None]) == 0.0  # ... even against a missing expected value
    assert accuracy([[1, 2], [3]], [[1, 2], [4]]) == 0.5  # whole outputs compared
    with pytest.raises(ValueError, match="2 predictions for 3"):
        accuracy(["a", "b"], ["a", "b", "c"])


def test_rounded():
    assert rounded(None) is None and rounded(None, 3) is None
    assert rounded(1.26) == 1.3 and rounded(1.2345, 2) == 1.23 and rounded(7) == 7


def test_known_passes_a_figure_and_refuses_a_missing_one():
    assert known(12.5) == 12.5 and known(0.0) == 0.0
    with pytest.raises(TypeError, match="missing"):  # what arithmetic on None would raise
        known(None)


def test_eval_counts_an_invalid_answer_as_wrong():
    """evaluate._run_one: accuracy over all examples (invalid = wrong), the invalid rate, examples/s."""
    from rtbench.evaluate import _run_one

    answers = {"a": "正面", "b": "负面", "c": "maybe", "d": "正面", "e": "负面"}

    class Task:
        task = SimpleNamespace(choices=SimpleNamespace(labels={"正面": "x", "负面": "y"}))

        async def run(self, engine, inp):
            await asyncio.sleep(0)
            return SimpleNamespace(output={"label": answers[inp["text"]]})

    back = {"正面": "positive", "负面": "negative"}  # shown label -> gold label
    gold = {"a": "positive", "b": "positive", "c": "negative", "d": "positive", "e": "negative"}
    examples = [{"text": t, "label": g} for t, g in gold.items()]
    row = asyncio.run(_run_one(None, Task(), examples, back))
    # right: a, d, e; wrong: b; invalid (so wrong): c
    assert row["n"] == 5 and row["accuracy"] == 0.6 and row["invalid_rate"] == 0.2
    assert row["examples_per_s"] > 0
    empty = asyncio.run(_run_one(None, Task(), [], back))
    assert empty["n"] == 0 and empty["accuracy"] is None and empty["invalid_rate"] is None


def test_bench_agreement_with_float32():
    from rtbench.bench import agreement

    out = agreement([[1, 2, 3], [4, 5], [6, 7, 8, 9]], [[1, 2, 3], [4, 6], [0, 7, 8, 9]])
    # identical: only the first; same tokens before divergence: 3/3, 1/2, 0/4
    assert out["identical_outputs"] == pytest.approx(1 / 3)
    assert out["tokens_before_divergence"] == pytest.approx((1 + 0.5 + 0) / 3)


def test_the_tools_share_this_arithmetic():
    """One percentile, one ratio: no tool keeps a copy of its own."""
    from rtbench import bench, bench_report, evaluate, loadclient, loadtest, sentiment_bench

    assert loadclient.percentile is stats.percentile and loadtest.percentile is stats.percentile
    assert bench.percentile is stats.percentile and bench_report.ratio is stats.ratio
    assert loadtest.ratio is stats.ratio and loadclient.ratio is stats.ratio
    assert evaluate.accuracy is stats.accuracy and sentiment_bench.median is stats.median
    for module in (bench, bench_report, loadclient, loadtest):
        assert not hasattr(module, "pct") and not hasattr(module, "_median")
