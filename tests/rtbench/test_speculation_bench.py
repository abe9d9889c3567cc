"""The speculation workload's arithmetic and report: ratios against their bars, texts compared, the
conversations' customers distinct (the server side runs in `rtserver bench --workloads speculation`)."""

from __future__ import annotations

from rtbench.speculation_bench import BARS, compare, customer_turns, customers, speed, table_rows


def _run(tps: dict[str, float], texts: dict[str, list[str]]) -> dict:
    calls = [{"tokens": 100.0, "seconds": 100.0 / tps["copy"], "ttft_s": 0.5}]
    return {
        "copy": speed(calls),
        "copy_by_call": {"summarize": speed(calls), "extract": speed(calls), "chat": speed(calls)},
        "single": {"tokens_per_s": tps["single"]},
        "burst-unique": {"tokens_per_s": tps["burst-unique"]},
        "texts": texts,
        "conversations": [["hello"]],
        "draft_tokens": 40.0,
        "draft_tokens_accepted": 30.0,
    }


def test_ratios_meet_or_miss_their_bars_and_texts_are_compared():
    texts = {"summarize": ["a"], "single": ["story"]}
    on = _run({"copy": 75.0, "single": 96.0, "burst-unique": 200.0}, texts)
    off = _run({"copy": 50.0, "single": 100.0, "burst-unique": 200.0}, {**texts, "single": ["other"]})
    cmp = compare(on, off)
    assert cmp["copy"] == {"ratio": 1.5, "bar": BARS["copy"], "met": True}
    assert cmp["single"]["ratio"] == 0.96 and not cmp["single"]["met"]
    assert cmp["burst-unique"]["met"]
    assert cmp["same_text"] == {"summarize": True, "single": False}
    rows = {
        name: value
        for name, value, _ in table_rows({"runs": {"drafts on": on, "drafts off": off}, "compare": cmp})
    }
    assert rows["[speculation] copy: tokens/s drafts on / off (ratio)"] == "75.0 / 50.0 (1.50x)"
    assert rows["[speculation] draft tokens checked / kept (drafts on)"] == "40 / 75%"
    assert rows["[speculation] outputs equal, drafts on and off"] == "differ: single"


def test_speed_counts_the_time_before_first_tokens():
    s = speed(
        [{"tokens": 30.0, "seconds": 2.0, "ttft_s": 0.5}, {"tokens": 10.0, "seconds": 2.0, "ttft_s": 1.5}]
    )
    assert s["tokens_per_s"] == 10.0 and s["first_token_share"] == 0.5


def test_the_customers_each_have_their_own_order_number_and_address():
    people = customers()
    assert len(people) == 20
    assert len({c["order"] for c in people}) == 20 and len({c["email"] for c in people}) == 20
    for c in people:  # the timed turns quote what the conversation gave
        assert c["order"] in customer_turns(c)[0] and c["email"] in customer_turns(c)[1]
