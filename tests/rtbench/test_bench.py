"""The report side of `rtserver bench`: the servers comparison's figures (rtbench/server_bench.py), the
exact-count flags, the printed rows, the SVG chart (rtbench/chart.py), and the streaming client
(rtbench/openai_client.py) against a real server. With RTSERVER_SLOW_TESTS=1 and llama-server built, the
servers comparison itself on a tiny budget."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from rtbench import chart, server_bench, servers_report
from rtbench.bench import exact_counts
from rtbench.bench_report import rate, summarize
from rtbench.openai_client import (
    COMPLETIONS_PATH,
    StreamResult,
    chat_body,
    client_session,
    completion_body,
    stream_chat,
)
from rtserver.web.app import create_app

from ..components import slow_tests_on
from ..llamautil import built_llama_server
from ..serverutil import make_settings, serve


def result(started: float, first: float | None, tokens: int, prompt: int = 41) -> StreamResult:
    return StreamResult(started=started, first_at=first, tokens=tokens, prompt_tokens=prompt)


def test_burst_summary_counts_tokens_and_flags_a_short_reply():
    rows = [result(0.0, 0.5, 64), result(0.0, 1.5, 64), result(0.0, 1.0, 64)]
    s = server_bench.burst_summary(rows, 64, 2.0)
    assert s["generated_tokens"] == 192 and s["asked_tokens"] == 192 and s["exact_token_counts"] is True
    assert s["tokens_per_s"] == 96.0
    assert s["ttft_p50_ms"] == 1000.0 and s["ttft_p95_ms"] == pytest.approx(1450.0)
    assert s["prompt_tokens_mean"] == 41.0
    short = server_bench.burst_summary(rows[:2] + [result(0.0, 1.0, 63)], 64, 2.0)
    assert short["exact_token_counts"] is False and short["generated_tokens"] == 191


def test_a_refused_request_counts_in_its_burst():
    """Two answered, one refused: the refusal counts, its tokens do not, the counts are not exact."""
    rows = [result(0.0, 0.5, 64), result(0.0, 1.5, 64)]
    refused = "RuntimeError: http://x: HTTP 429: over_budget"
    s = server_bench.burst_summary(rows, 64, 2.0, [refused, refused])
    assert s["requests"] == 4 and s["errors"] == 2 and s["error_samples"] == [refused]
    assert s["generated_tokens"] == 128 and s["asked_tokens"] == 256 and s["exact_token_counts"] is False
    assert server_bench.burst_summary(rows, 64, 2.0)["errors"] == 0
    ran = {"burst-unique": s, "single": {"errors": 0}, "arrival-unique": {"error": "HTTP 429"}}
    assert server_bench.failures(ran | {"health": {"error": "not a workload"}, "peak_rss_mb": 1.0}) == 3


@pytest.mark.asyncio
async def test_single_first_runs_before_the_wide_warm_up_and_a_failed_workload_is_its_error(monkeypatch):
    """One warm-up request, `single-first`, the warm-up's wide batch, then the rest in order; a
    workload that fails is its `error` and the next one runs."""
    ran: list[str] = []

    async def warm(kind: str, *args) -> None:
        ran.append(kind)

    async def workload(name: str, *args) -> dict:
        ran.append(name)
        if name == "burst-unique":
            raise RuntimeError("HTTP 429: over_budget")
        return {"tokens_per_s": 1.0}

    monkeypatch.setattr(server_bench, "warm_up_one", lambda *a: warm("one", *a))
    monkeypatch.setattr(server_bench, "warm_up_wide", lambda *a: warm("wide", *a))
    monkeypatch.setattr(server_bench, "run_workload", workload)
    progress = server_bench.Progress("test", out=lambda line: None)
    asked = ["arrival-unique", "single", "burst-unique", "single-first"]
    out = await server_bench.run_workloads("http://x", asked, {}, progress)
    assert ran == ["one", "single-first", "wide", "burst-unique", "single", "arrival-unique"]
    assert out["burst-unique"] == {"error": "RuntimeError: HTTP 429: over_budget"}
    assert out["single"] == {"tokens_per_s": 1.0} and list(out) == asked[::-1]
    ran.clear()
    await server_bench.run_workloads("http://x", ["burst", "single"], {}, progress)
    assert ran == ["one", "wide", "burst", "single"]  # the servers bench: no first single


def test_kv_watch_keeps_the_highest_reading():
    readings = iter([{"rtserver_kv_used_bytes": float(mb << 20)} for mb in (10, 40, 20)])

    def read() -> dict[str, float]:
        return next(readings)  # a fourth reading fails, as a busy server's would

    watch = server_bench.KVWatch(read, every_s=60)
    for _ in range(3):
        watch.sample()
    with watch:  # its exit reads once more
        pass
    assert watch.figures() == {
        "kv_used_peak_mb": 40.0,
        "kv_used_end_mb": 20.0,
        "kv_used_readings": 3,
        "kv_used_failed_readings": 1,
    }
    assert server_bench.KVWatch(read).figures()["kv_used_peak_mb"] is None


def test_step_gaps_only_inside_the_window():
    times = [[0.0, 0.1, 0.3, 0.6], [0.05, 0.25, 2.0]]
    gaps = server_bench.step_gaps_ms(times, 0.1, 0.6)
    # stream 0: 0.1, 0.3, 0.6 -> 200, 300 ms; stream 1: only 0.25 inside -> no gap
    assert gaps == pytest.approx([200.0, 300.0])
    a = server_bench.arrival_summary([100.0, 200.0, 300.0], True, 100.0, 32, 0)
    assert a["ttft_p95_ms"] == pytest.approx(290.0) and a["ttft_p95_in_steps"] == pytest.approx(2.9)
    assert server_bench.arrival_summary([], True, None, 32, 0)["ttft_p95_in_steps"] is None


def test_exact_counts_and_the_rate_cell():
    assert exact_counts([64, 64], 64) and not exact_counts([64, 50], 64) and not exact_counts([], 64)
    assert rate({"tokens_per_s": 55.24, "generated_tokens": 2048, "exact_token_counts": True}) == (
        "55.2 (2,048 tokens, exact)"
    )
    assert rate({"tokens_per_s": 10.0, "generated_tokens": 1647, "exact_token_counts": False}) == (
        "10.0 (1,647 tokens, NOT exact)"
    )
    assert rate(None) == "n/a"


def test_engine_rows_name_the_baseline_precision():
    engine = {"burst": {"tokens_per_s": 150.0, "generated_tokens": 2048, "exact_token_counts": True}}
    engine["burst"] |= {"ttft_p50_ms": 1.0, "ttft_p95_ms": 2.0, "loop_lag_p95_ms": 0, "loop_lag_max_ms": 0}
    base = {"burst": {"cb": {"tokens_per_s": 50.0, "generated_tokens": 2048, "exact_token_counts": True}}}
    rows = {n: v for n, v, _ in summarize({"engine": engine, "baselines": base, "baseline_dtype": "float32"})}
    assert rows["burst ratio vs cb (generate_batch, float32)"] == "3.0x"
    assert rows["burst tokens/s baseline cb (float32)"] == "50.0 (2,048 tokens, exact)"
    assert rows["burst tokens/s (engine)"] == "150.0 (2,048 tokens, exact)"


def test_kv_agreement_row_names_the_kv_type_and_the_activations_width():
    """At 8-bit activations greedy output forks sooner whatever the KV type: the row says which ran."""
    engine = {"kv": {"dtype": "float16"}, "kernels": {"activation_bits": 8}}
    engine["agreement_with_float32_kv"] = {"identical_outputs": 15 / 32, "tokens_before_divergence": 0.63}
    rows = {n: v for n, v, _ in summarize({"engine": engine})}
    name = "greedy agreement with float32 KV (float16 KV, 8-bit activations, burst prompts): "
    assert rows[f"{name}identical outputs / tokens before divergence"] == "47% / 63%"


SYSTEMS = {
    "llama-server": {
        "burst": {
            "tokens_per_s": 100.0,
            "ttft_p50_ms": 3000.0,
            "ttft_p95_ms": 6000.0,
            "exact_token_counts": True,
        },
        "single": {
            "tokens_per_s": 60.0,
            "ttft_p50_ms": 50.0,
            "ttft_p95_ms": 50.0,
            "exact_token_counts": True,
        },
        "arrival": {
            "ttft_p50_ms": 400.0,
            "ttft_p95_ms": 800.0,
            "decode_step_ms": 200.0,
            "ttft_p95_in_steps": 4.0,
            "background_restarts": 0,
        },
        "peak_rss_mb": 300.0,
    },
    "rtserver-auto": {
        "dtype": "auto",
        "runs_as": "bfloat16",
        "burst": {
            "tokens_per_s": 150.0,
            "ttft_p50_ms": 500.0,
            "ttft_p95_ms": 1500.0,
            "exact_token_counts": False,
        },
        "single": {
            "tokens_per_s": 30.0,
            "ttft_p50_ms": 40.0,
            "ttft_p95_ms": 40.0,
            "exact_token_counts": True,
        },
        "peak_rss_mb": 1100.0,
    },
}


def test_server_ratios_and_rows():
    r = server_bench.ratios(SYSTEMS)
    assert list(r) == ["rtserver-auto"]
    assert (
        r["rtserver-auto"]["burst_tokens_per_s"] == 1.5 and r["rtserver-auto"]["single_tokens_per_s"] == 0.5
    )
    assert r["rtserver-auto"]["burst_ttft_p95"] == 0.25 and r["rtserver-auto"]["arrival_ttft_p95"] is None
    rows = {n: (v, bar) for n, v, bar in servers_report.table_rows({"systems": SYSTEMS})}
    assert rows["[servers] rtserver-auto burst tokens/s; TTFT p50 / p95 ms"] == (
        "150.0 (NOT exact); 500.0 / 1,500.0",
        "TTFT p95 <= 1000",
    )
    assert rows["[servers] llama-server arrival TTFT p50 / p95 ms; decode step ms; p95 in steps"][0] == (
        "400.0 / 800.0; 200.0; 4.0x"
    )
    assert rows["[servers] rtserver-auto / llama-server: burst tokens/s, single tokens/s"][0] == "1.5x, 0.5x"
    assert rows["[servers] rtserver-auto peak RSS MB"] == ("1,100.0", "<= 1536")


def test_chart_has_one_bar_per_figure_scaled_to_the_panel():
    report = {
        "date": "2026-11-30T15:00:00+00:00",
        "commit": "abc1234",
        "threads": 2,
        "servers": {"systems": SYSTEMS},
        "engine": {"float16": {"burst": {"tokens_per_s": 200.0, "ttft_p95_ms": 1000.0}}},
        "baselines": {"burst": {"cb": {"tokens_per_s": 50.0}}, "single": {"naive": {"tokens_per_s": 10.0}}},
        "baseline_dtype": "float32",
    }
    rows = chart.chart_rows(report)
    burst_tps = [(system, value) for system, _, panel, value in rows if panel.startswith("burst: tokens/s")]
    assert burst_tps == [
        ("llama.cpp llama-server (Q4_1)", 100.0),
        ("rtserver serve auto = bfloat16", 150.0),
        ("engine float16 (in-process)", 200.0),
        ("transformers generate_batch float32", 50.0),
    ]
    arrival_ttft = next(p[0] for p in chart.PANELS if p[1:3] == ("arrival", "ttft_p95_ms"))
    assert ("llama.cpp llama-server (Q4_1)", "llama-server", arrival_ttft, 0.8) in rows  # TTFT in s
    svg = ET.fromstring(chart.render_svg(rows, "a <title> & more"))
    ns = "{http://www.w3.org/2000/svg}"
    bars = svg.findall(f"{ns}rect")[1:]  # the first one is the background
    assert len(bars) == len(rows)
    widths = [float(b.get("width")) for b in bars[:4]]  # the burst tokens/s panel, in the rows' order
    assert widths[2] == max(widths) and widths[0] == pytest.approx(widths[2] / 2)
    texts = [t.text for t in svg.findall(f"{ns}text")]
    assert "a <title> & more" in texts and "200.0" in texts and "0.80 s" in texts


def test_unique_prefix_figures_sit_beside_the_shared_ones():
    """Each prompt set's figures: their own ratios to llama-server, table rows and chart panels."""
    unique = {"tokens_per_s": 80.0, "ttft_p50_ms": 4000.0, "ttft_p95_ms": 8000.0, "exact_token_counts": True}
    ours = {"tokens_per_s": 120.0, "ttft_p50_ms": 900.0, "ttft_p95_ms": 2000.0, "exact_token_counts": True}
    arrival = {**SYSTEMS["llama-server"]["arrival"], "ttft_p95_ms": 1000.0}
    systems = {
        "llama-server": {**SYSTEMS["llama-server"], "burst-unique": unique, "arrival-unique": arrival},
        "rtserver-auto": {**SYSTEMS["rtserver-auto"], "burst-unique": ours},
    }
    r = server_bench.ratios(systems)["rtserver-auto"]
    assert r["burst_unique_tokens_per_s"] == 1.5 and r["burst_unique_ttft_p95"] == 0.25
    assert r["burst_tokens_per_s"] == 1.5 and r["arrival_unique_ttft_p95"] is None
    names = [n for n, _, _ in servers_report.table_rows({"systems": systems})]
    shared = names.index("[servers] rtserver-auto burst tokens/s; TTFT p50 / p95 ms")
    assert names[shared + 1] == "[servers] rtserver-auto burst-unique tokens/s; TTFT p50 / p95 ms"
    assert "[servers] llama-server arrival-unique TTFT p50 / p95 ms; decode step ms; p95 in steps" in names
    rows = {n: (v, bar) for n, v, bar in servers_report.table_rows({"systems": systems})}
    key = "[servers] rtserver-auto / llama-server, unique prefixes: burst tokens/s; burst TTFT p95, "
    assert rows[key + "arrival TTFT p95"] == ("1.50x; 0.25x, n/a", ">= 1.5x; <= 0.5x")
    # a run without the unique set has no row for it
    assert not any("unique" in n for n, _, _ in servers_report.table_rows({"systems": SYSTEMS}))
    panels = {
        panel: value
        for system, _, panel, value in chart.chart_rows({"servers": {"systems": systems}})
        if system.startswith("rtserver")
    }
    assert panels["burst-unique: tokens/s, unique prefixes"] == 120.0
    assert panels["burst: tokens/s (32 x 64 tokens), shared system prompt"] == 150.0


def test_prompt_sets_give_each_request_its_own_system_message():
    assert server_bench.systems(3, unique=False) == [None, None, None]
    unique = server_bench.systems(2, unique=True, first=32)
    assert unique == [
        "Conversation 032. You are a helpful AI assistant named SmolLM, trained by Hugging Face",
        "Conversation 033. You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    ]
    chat = server_bench.CHAT.body("Hi.", 8, {}, unique[0])
    assert chat["messages"] == [{"role": "system", "content": unique[0]}, {"role": "user", "content": "Hi."}]
    assert server_bench.CHAT.body("Hi.", 8, {})["messages"] == [{"role": "user", "content": "Hi."}]
    assert server_bench.CHAT.path == "/v1/chat/completions"
    base = server_bench.Prompts(completion=True)
    body = base.body("Hi.", 8, {"cache_prompt": True}, unique[1])
    assert base.path == "/v1/completions" and "messages" not in body
    assert body["prompt"] == f"{unique[1]}\nQuestion: Hi.\nAnswer:" and body["cache_prompt"] is True
    assert body["max_tokens"] == 8 and body["ignore_eos"] and body["stream"]
    assert base.body("Hi.", 8, {})["prompt"] == "Question: Hi.\nAnswer:"


def test_write_chart_skips_a_report_without_figures(tmp_path):
    assert chart.write_chart({"engine": {}}, tmp_path / "x.svg") is None and not (tmp_path / "x.svg").exists()
    path = chart.write_chart({"servers": {"systems": SYSTEMS}}, tmp_path / "y.svg")
    assert path is not None and ET.parse(path).getroot().tag.endswith("svg")


@pytest.mark.asyncio
async def test_stream_chat_against_rtserver(smol):
    """The client reads the server's count of tokens and first-token time; a refused request raises
    with the server's message (rtserver refuses llama-server's `cache_prompt`, so the bench sends that
    field to llama-server only)."""
    settings = make_settings(tasks={"auto_tasks": []})
    async with serve(create_app(settings, lambda: smol), settings) as (base, url):
        async with client_session() as http:
            seen = []
            r = await stream_chat(http, base, chat_body("Say hi.", 12), lambda: seen.append(1))
            assert r.tokens == 12 and r.finish_reason == "length" and r.prompt_tokens and r.prompt_tokens > 30
            assert r.ttft_ms is not None and r.ttft_ms > 0 and len(r.chunk_at) == len(seen) > 0
            with pytest.raises(RuntimeError, match="HTTP 400.*cache_prompt"):
                await stream_chat(http, base, chat_body("Say hi.", 4, {"cache_prompt": False}))
            done = await stream_chat(
                http, base, completion_body("Once upon a time", 6), None, COMPLETIONS_PATH
            )
            assert done.tokens == 6 and done.ttft_ms is not None and len(done.chunk_at) > 0


@pytest.mark.asyncio
async def test_unique_prefix_burst_against_rtserver(smol):
    """The unique set reaches the server as its own system messages: longer prompts than the template's
    default system prompt, every request still exact."""
    settings = make_settings(tasks={"auto_tasks": []})
    progress = server_bench.Progress("test", out=lambda line: None)
    texts = server_bench.BURST_TEXTS[:3]
    async with serve(create_app(settings, lambda: smol), settings) as (base, url):
        shared = await server_bench.burst(base, texts, 4, {}, progress)
        unique = await server_bench.burst(base, texts, 4, {}, progress, unique=True)
    assert shared["exact_token_counts"] and unique["exact_token_counts"]
    assert unique["prompt_tokens_mean"] > shared["prompt_tokens_mean"]


@pytest.mark.asyncio
async def test_arrival_keeps_its_background_streaming_when_they_end_before_all_start(smol, monkeypatch):
    """Background streams shorter than the server takes to admit them all: each is sent again when it
    ends, so the arrivals still meet 32 (here 3) decoding streams (this raised before)."""
    monkeypatch.setattr(server_bench, "BURST_TEXTS", server_bench.BURST_TEXTS[:3])
    monkeypatch.setattr(server_bench, "BACKGROUND_TOKENS", 1)
    settings = make_settings(tasks={"auto_tasks": []})
    progress = server_bench.Progress("test", out=lambda line: None)
    async with serve(create_app(settings, lambda: smol), settings) as (base, url):
        out = await server_bench.arrival(base, 2, {}, progress)
    assert out["arrivals"] == 2 and out["exact_token_counts"]
    assert out["background_streams"] == 3 and out["background_restarts"] > 0


@pytest.mark.skipif(not slow_tests_on(), reason="slow: set RTSERVER_SLOW_TESTS=1")
def test_servers_comparison_on_a_tiny_budget(monkeypatch, tmp_path):
    """llama-server and `rtserver serve` driven by the same clients: every workload ran on both, token
    counts exact, each server's peak RSS read."""
    binary = built_llama_server()
    monkeypatch.setattr(server_bench, "BURST_TEXTS", server_bench.BURST_TEXTS[:4])
    monkeypatch.setattr(server_bench, "WARM_UP_TEXTS", server_bench.WARM_UP_TEXTS[:4])
    monkeypatch.setattr(server_bench, "BURST_TOKENS", 8)
    monkeypatch.setattr(server_bench, "SINGLE_TOKENS", 8)
    monkeypatch.setattr(server_bench, "BACKGROUND_TOKENS", 60)
    out = server_bench.run_servers_bench(["float32"], 2, arrivals=3, llama_binary=binary, workdir=tmp_path)
    assert list(out["systems"]) == ["llama-server", "rtserver-float32"]
    for s in out["systems"].values():
        assert s["burst"]["exact_token_counts"] and s["burst"]["generated_tokens"] == 32
        assert s["single"]["exact_token_counts"] and s["single"]["generated_tokens"] == 8
        assert s["arrival"]["arrivals"] == 3 and s["arrival"]["exact_token_counts"]
        assert s["arrival"]["background_restarts"] >= 0 and s["arrival"]["decode_step_ms"] > 0
        assert s["peak_rss_mb"] > 50
        assert s["burst-unique"]["exact_token_counts"] and s["arrival-unique"]["arrivals"] == 3
        assert s["peak_rss_mb"] >= s["peak_hwm_mb"] > 50
    assert out["systems"]["rtserver-float32"]["runs_as"] == "float32"
    # the same prompts reach both: the chat template's default system prompt on each side
    prompts = [s["burst"]["prompt_tokens_mean"] for s in out["systems"].values()]
    assert prompts[0] == prompts[1]
    unique = [s["burst-unique"]["prompt_tokens_mean"] for s in out["systems"].values()]
    assert unique[0] == unique[1] > prompts[0]
