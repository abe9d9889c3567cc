"""The formats matrix (rtbench/formats_bench.py) on fake servers: its rows and their picking, the bars
(rtserver's lower single figure against llama-server's better one, the bandwidth floor, refusals, the
RSS bar from the KV in use), the pairs of a repeated row (A B A B, every pair reported), a row whose
file cannot be made or whose server refuses the model, the printed rows, the chart and the bench's
JSON. With RTSERVER_SLOW_TESTS=1 and llama-server built, one real row on a tiny budget."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from rtbench import bench, chart, formats_bench, formats_report, model_files, read_bandwidth, server_bench
from rtbench.formats_bench import (
    BURST_BAR,
    KV_FROM_BUDGET,
    KV_FROM_METRICS,
    REFUSAL_BAR,
    RSS_BAR,
    SINGLE_BAR,
    TTFT_BAR,
    FormatRow,
    pair_figures,
    pick,
    row_bars,
    run_row,
    single_bar,
)
from rtserver.config import EngineSettings
from rtserver.engine.core import file_matmul_bytes
from rtserver.engine.gguf_file import GGUFFile
from rtserver.engine.model import embedded_model_path

from ..components import slow_tests_on
from ..llamautil import built_llama_server

ALL_ROWS = [
    "embedded",
    "q4_0",
    "q4_k_m",
    "iq4_xs",
    "q5_k_m",
    "q6_k",
    "q8_0",
    "qwen3-0.6b-q4_k_m",
    "qwen3-0.6b-q8_0",
    "llama3.2-1b-q4_k_m",
    "qwen2.5-1.5b-q4_k_m",
    "gemma3-270m-q4_k_m",
]

SYSTEM_FIGURES = formats_report.SYSTEM_FIGURES
RATIOS_ROW = (
    "rtserver / llama-server: burst tokens/s; burst TTFT p95; single, rtserver's lower / llama-server's "
    "better (first, after burst)"
)


def figures(
    burst_tps: float, first_tps: float, after_tps: float, ttft_p95: float, rss: float, **extra
) -> dict:
    return {
        "single-first": {"tokens_per_s": first_tps, "exact_token_counts": True, "errors": 0},
        "burst-unique": {
            "tokens_per_s": burst_tps,
            "ttft_p95_ms": ttft_p95,
            "exact_token_counts": True,
            "errors": 0,
        },
        "single": {"tokens_per_s": after_tps, "exact_token_counts": True, "errors": 0},
        "arrival-unique": {"ttft_p95_ms": 150.0},
        "peak_rss_mb": rss,
        **extra,
    }


def llama_figures() -> dict:
    return figures(200.0, 100.0, 90.0, 2000.0, 300.0)


def rtserver_figures(**extra) -> dict:
    return figures(300.0, 130.0, 120.0, 800.0, 700.0, kv_used_peak_mb=50.0, **extra)


def fake_runners(seen: list, refuse: str = "", rtserver: list[dict] | None = None) -> dict:
    """llama-server and rtserver stand-ins; rtserver refuses the rows named `refuse` as the server does,
    and answers `rtserver`'s figures one run after another where given."""

    def llama(row: FormatRow, path: Path, folder: Path) -> dict:
        seen.append(("llama-server", row.name, path, folder, row.prompts().path))
        return llama_figures()

    def ours(row: FormatRow, path: Path, folder: Path) -> dict:
        seen.append(("rtserver", row.name, path, folder, row.prompts().path))
        if row.name == refuse:
            raise RuntimeError(
                "server exited with 3 during start-up; see x.log: startup failed: model type "
                "'qwen3' is not supported (supported: llama, qwen2, mistral)"
            )
        return rtserver.pop(0) if rtserver else rtserver_figures()

    return {"llama-server": llama, "rtserver": ours}


def a_file(tmp_path: Path, mb: int = 1) -> Path:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * (mb << 20))
    return model


def test_the_matrix_rows_and_picking_them():
    rows = formats_bench.matrix()
    assert [r.name for r in rows] == ALL_ROWS
    embedded, gemma = rows[0], rows[-1]
    assert embedded.spec == "embedded" and embedded.make() == embedded_model_path()
    assert gemma.completion and gemma.prompts().path == "/v1/completions"
    headline = rows[ALL_ROWS.index(formats_bench.HEADLINE)]
    assert (
        not headline.completion
        and headline.spec is None
        and headline.prompts().path == "/v1/chat/completions"
    )
    assert [r.name for r in pick(rows, ["Q8_0", " embedded", "q4_k_m"])] == ["embedded", "q4_k_m", "q8_0"]
    assert pick(rows, None) == rows and pick(rows, []) == rows
    with pytest.raises(ValueError, match=r"unknown formats rows q3_k.*known: embedded, q4_0"):
        pick(rows, ["q3_k", "embedded"])


def test_the_random_rows_are_made_in_their_shapes_and_types(monkeypatch):
    made: list = []
    monkeypatch.setattr(
        model_files, "random_gguf", lambda shape, qtype: made.append((shape, qtype)) or Path(shape)
    )
    for row in pick(formats_bench.matrix(), ["llama3.2-1b-q4_k_m", "qwen2.5-1.5b-q4_k_m", "qwen3-0.6b-q8_0"]):
        row.make()
    assert made == [("qwen3-0.6b", "Q8_0"), ("llama3.2-1b", "Q4_K_M"), ("qwen2.5-1.5b", "Q4_K_M")]


# -- the single-stream bar ----------------------------------------------------------------------


def single(first: float | None, after: float | None) -> dict:
    return {"single-first": {"tokens_per_s": first}, "single": {"tokens_per_s": after}}


def test_single_compares_rtservers_lower_with_llama_servers_better():
    """rtserver 150 first, 100 after the burst; llama-server 80 first, 95 after: 100 against 95."""
    bar = single_bar(single(150.0, 100.0), single(80.0, 95.0), None)
    assert bar["rtserver_lower"] == 100.0 and bar["llama_server_better"] == 95.0
    assert bar["ratio"] == pytest.approx(100 / 95)
    assert bar["needed_tokens_per_s"] == pytest.approx(104.5) and bar["held"] is False
    assert bar["needed_by"] == "1.1x llama-server's better" and bar["share_of_floor"] is None
    # rtserver's better figure never stands in for its lower one
    assert single_bar(single(115.0, 150.0), single(100.0, 60.0), None)["held"] is True
    assert single_bar(single(150.0, 109.9), single(100.0, 60.0), None)["held"] is False
    at_edge = single_bar(single(110.0, 110.0), single(100.0, 100.0), None)
    assert at_edge["held"] is True


def test_single_asks_92_percent_of_the_floor_where_that_is_lower():
    """A floor of 100 tokens/s (file bytes at the read bandwidth): 92 is needed, not 1.1 x 95."""
    bar = single_bar(single(93.0, 92.0), single(95.0, 90.0), 100.0)
    assert bar["needed_tokens_per_s"] == pytest.approx(92.0) and bar["needed_by"] == "92% of the floor"
    assert bar["held"] is True and bar["share_of_floor"] == pytest.approx(0.92)
    assert single_bar(single(93.0, 91.9), single(95.0, 90.0), 100.0)["held"] is False
    # a floor above what 1.1x asks changes nothing
    high = single_bar(single(105.0, 105.0), single(95.0, 90.0), 1000.0)
    assert high["needed_tokens_per_s"] == pytest.approx(104.5) and high["held"] is True


def test_single_without_one_of_its_four_figures_has_no_verdict():
    assert single_bar(single(None, 500.0), single(10.0, 10.0), 1000.0)["held"] is None
    assert single_bar(single(500.0, 500.0), single(10.0, None), 1000.0)["held"] is None
    assert single_bar({"error": "refused"}, single(10.0, 10.0), None)["rtserver_lower"] is None


# -- one pair's bars ----------------------------------------------------------------------------


def test_a_pair_that_holds_every_bar():
    """rtserver 300 / 130 / 120 against 200 / 100 / 90: burst 1.5x, single 120 / 100 = 1.2x, TTFT
    0.4x; RSS 700 against 1 + 50 (KV in use, /metrics) + 600 MB."""
    p = pair_figures({"llama-server": llama_figures(), "rtserver": rtserver_figures()}, 1.0, None)
    assert p["ratios"] == pytest.approx(
        {
            "single_tokens_per_s": 1.2,
            "single_first_tokens_per_s": 1.3,
            "single_after_burst_tokens_per_s": 120 / 90,
            "burst_tokens_per_s": 1.5,
            "burst_ttft_p95": 0.4,
        }
    )
    assert p["kv_in_use_mb"] == 50.0 and p["kv_in_use_source"] == KV_FROM_METRICS
    assert p["rss_bar_mb"] == 651.0 and p["bars"][RSS_BAR] is False  # 700 > 651
    ok = pair_figures({"llama-server": llama_figures(), "rtserver": rtserver_figures()}, 100.0, None)
    assert ok["bars"] == {
        SINGLE_BAR: True,
        BURST_BAR: True,
        TTFT_BAR: True,
        REFUSAL_BAR: True,
        RSS_BAR: True,
        "met": True,
    }
    assert ok["refused_or_failed"] == {"llama-server": 0, "rtserver": 0}


def test_each_ratio_bar_at_its_edge():
    edge = figures(300.0, 110.0, 110.0, 1600.0, 100.0, kv_used_peak_mb=0.0)
    held = pair_figures({"llama-server": llama_figures(), "rtserver": edge}, 1.0, None)["bars"]
    assert held[BURST_BAR] and held[TTFT_BAR] and held[SINGLE_BAR]
    past = figures(299.0, 110.0, 109.0, 1601.0, 100.0, kv_used_peak_mb=0.0)
    missed = pair_figures({"llama-server": llama_figures(), "rtserver": past}, 1.0, None)["bars"]
    assert missed == {
        SINGLE_BAR: False,
        BURST_BAR: False,
        TTFT_BAR: False,
        REFUSAL_BAR: True,
        RSS_BAR: True,
        "met": False,
    }
    assert formats_report.bars_cell(missed) == f"NOT met: {SINGLE_BAR}, {BURST_BAR}, {TTFT_BAR}"


def test_a_refused_request_fails_the_refusal_bar_and_is_counted():
    ours = rtserver_figures()
    ours["burst-unique"] |= {"errors": 3, "exact_token_counts": False}
    ours["arrival-unique"] = {"error": "RuntimeError: HTTP 429: over_budget"}
    p = pair_figures({"llama-server": llama_figures(), "rtserver": ours}, 100.0, None)
    assert p["refused_or_failed"] == {"llama-server": 0, "rtserver": 4}
    assert p["bars"][REFUSAL_BAR] is False and p["bars"]["met"] is False
    rows = {n: v for n, v, _ in formats_report.pair_rows("x", p, 100.0)}
    assert rows["[formats] x rtserver: " + SYSTEM_FIGURES].endswith("(NOT exact); 800.0; n/a; 700.0; 4")


def test_without_a_metrics_reading_the_rss_bar_takes_the_kv_budget():
    local = {"kind": "local", "kv": {"budget_mb": 256}, "kernels": {"decode_weight_mb": 80.5}}
    ours = figures(
        300.0, 130.0, 120.0, 800.0, 700.0, health={"backends": {"local": local}}, kv_used_peak_mb=None
    )
    p = pair_figures({"llama-server": llama_figures(), "rtserver": ours}, 10.0, None)
    assert p["kv_in_use_mb"] == 256.0 and p["kv_in_use_source"] == KV_FROM_BUDGET
    assert p["rtserver_decode_weight_mb"] == 80.5
    assert p["rss_bar_mb"] == 10.0 + 256 + 600 and p["bars"][RSS_BAR] is True
    bare = pair_figures({"llama-server": llama_figures(), "rtserver": figures(1, 1, 1, 1, 1)}, 10.0, None)
    assert bare["kv_in_use_mb"] is None and bare["bars"][RSS_BAR] is None


# -- rows and their pairs -----------------------------------------------------------------------


def test_a_repeated_row_alternates_the_servers_and_reports_every_pair(tmp_path):
    """Two pairs: A B A B, each in its own folder; the second pair misses the burst bar, so the row
    does, though the first pair met every bar (never the best of the pairs)."""
    model = a_file(tmp_path, 100)
    seen: list = []
    slow = figures(250.0, 130.0, 120.0, 800.0, 700.0, kv_used_peak_mb=50.0)
    runners = fake_runners(seen, rtserver=[rtserver_figures(), slow])
    out = run_row(FormatRow("q8_0", lambda: model), runners, tmp_path, reps=2)
    assert [s[0] for s in seen] == ["llama-server", "rtserver", "llama-server", "rtserver"]
    assert [s[3].name for s in seen] == ["pair1", "pair1", "pair2", "pair2"]
    assert [p["bars"]["met"] for p in out["pairs"]] == [True, False]
    assert [p["ratios"]["burst_tokens_per_s"] for p in out["pairs"]] == pytest.approx([1.5, 1.25])
    assert out["bars"][BURST_BAR] is False and out["bars"]["met"] is False
    assert out["systems"] is out["pairs"][0]["systems"]  # the chart's: the first pair
    rows = [n for n, _, _ in formats_report.table_rows({"rows": {"q8_0": out}})]
    assert "[formats] q8_0 pair 1 " + RATIOS_ROW in rows and "[formats] q8_0 pair 2 " + RATIOS_ROW in rows
    assert "[formats] q8_0 bars (every pair)" in rows


def test_row_bars_over_pairs():
    def pair(**held) -> dict:
        return {"bars": {bar: held.get(bar, True) for bar in formats_bench.BARS}}

    assert row_bars([pair(), pair()])["met"] is True
    assert row_bars([pair(), pair(**{TTFT_BAR: None})])[TTFT_BAR] is None
    mixed = row_bars([pair(**{TTFT_BAR: None}), pair(**{TTFT_BAR: False})])
    assert mixed[TTFT_BAR] is False and mixed["met"] is False


def test_the_floor_is_the_files_matmul_bytes_at_the_read_bandwidth(tmp_path):
    path = embedded_model_path()
    matmul = file_matmul_bytes(GGUFFile(path))
    floor = formats_bench.floor_figures(path, 20.0)
    assert floor["file_matmul_mb"] == matmul / (1 << 20)
    assert floor["floor_tokens_per_s"] == pytest.approx(20e9 / matmul)
    assert formats_bench.floor_figures(path, None)["floor_tokens_per_s"] is None
    out = run_row(FormatRow("embedded", lambda: path), fake_runners([]), tmp_path, read_gb_per_s=20.0)
    assert out["pairs"][0]["single"]["floor_tokens_per_s"] == floor["floor_tokens_per_s"]
    unreadable = run_row(
        FormatRow("q8_0", lambda: a_file(tmp_path)), fake_runners([]), tmp_path, read_gb_per_s=20.0
    )
    assert "floor_error" in unreadable and unreadable["pairs"][0]["single"]["floor_tokens_per_s"] is None


def test_the_read_bandwidth_is_measured_with_the_threads_asked():
    read = read_bandwidth.measure(1, size_mb=8, tries=2)
    assert read["gb_per_s"] > 0.1 and "1 threads, best of 2" in read["method"]
    assert all(len(tries) == 2 for tries in read["tries_gb_per_s"].values())


def _cannot_make(shape: str, qtype: str):
    raise model_files.ModelFileError(f"llama-quantize to {qtype} failed: out of disk")


def test_a_model_file_that_cannot_be_made_is_that_rows_error(monkeypatch, tmp_path):
    calls: list = []
    made = []
    monkeypatch.setattr(
        model_files, "random_gguf", lambda shape, qtype: made.append((shape, qtype)) or tmp_path
    )
    assert formats_bench.random_model("qwen3-0.6b", "Q8_0") == tmp_path and made == [("qwen3-0.6b", "Q8_0")]
    monkeypatch.setattr(model_files, "random_gguf", _cannot_make)
    [row] = pick(formats_bench.matrix(), ["qwen3-0.6b-q4_k_m"])
    out = run_row(row, fake_runners(calls), tmp_path)
    assert (
        out["error"]
        == "cannot make the model file: ModelFileError: llama-quantize to Q4_K_M failed: out of disk"
    )
    assert calls == [] and "systems" not in out  # no server ran without a file


def test_a_row_where_rtserver_refuses_the_model_keeps_llama_servers_figures(tmp_path):
    model = a_file(tmp_path, 3)
    seen: list = []
    row = FormatRow("qwen3-0.6b-q8_0", lambda: model)
    out = run_row(row, fake_runners(seen, refuse="qwen3-0.6b-q8_0"), tmp_path)
    assert [s[0] for s in seen] == ["llama-server", "rtserver"]
    assert seen[0][2] == model and seen[0][3] == tmp_path / "qwen3-0.6b-q8_0" and seen[0][3].is_dir()
    assert out["file_mb"] == 3.0
    assert "model type 'qwen3' is not supported" in out["systems"]["rtserver"]["error"]
    assert out["systems"]["llama-server"]["burst-unique"]["tokens_per_s"] == 200.0
    assert set(out["ratios"].values()) == {None}
    assert out["bars"]["met"] is False and set(out["bars"].values()) == {None, False}
    rows = {n: (v, bar) for n, v, bar in formats_report.table_rows({"rows": {row.name: out}})}
    refused = rows["[formats] qwen3-0.6b-q8_0 rtserver: " + SYSTEM_FIGURES]
    assert refused[0].startswith("error: server exited with 3")
    assert rows["[formats] qwen3-0.6b-q8_0 bars"][0].startswith(f"no figure: {SINGLE_BAR}, {BURST_BAR}")


def test_the_printed_rows_of_a_row_that_ran(tmp_path):
    out = run_row(FormatRow("q8_0", lambda: a_file(tmp_path)), fake_runners([]), tmp_path, read_gb_per_s=None)
    out["file_matmul_mb"], out["floor_tokens_per_s"] = 0.5, 200.0
    rows = {
        n: v
        for n, v, _ in formats_report.table_rows(
            {"rows": {"q8_0": out}, "read_bandwidth": {"gb_per_s": 20.0, "method": "m"}}
        )
    }
    assert rows["[formats] read bandwidth GB/s"] == "20.0"
    assert rows["[formats] q8_0 " + RATIOS_ROW] == "1.50x; 0.40x; 1.20x (1.30x, 1.33x)"
    assert rows["[formats] q8_0 file MB; matmul MB a token; floor tokens/s"] == "1.0; 0.5; 200.0"
    assert (
        rows["[formats] q8_0 llama-server: " + SYSTEM_FIGURES]
        == "200.0 / 100.0 / 90.0; 2,000.0; 150.0; 300.0; 0"
    )
    assert rows["[formats] q8_0 rtserver peak RSS MB; file MB + KV in use MB + 600"] == (
        "700.0; 1.0 + 50.0 + 600 = 651.0"
    )
    single = "[formats] q8_0 single: rtserver's lower tokens/s, needed, share of the floor; "
    single += "MB rtserver reads a token"
    assert rows[single] == "120.0, 110.0 (1.1x llama-server's better), n/a; n/a"


def test_the_bench_writes_the_matrix_into_its_json_table_and_chart(monkeypatch, tmp_path):
    """`rtserver bench --workloads formats --formats embedded,qwen3-0.6b-q8_0`: the read bandwidth, the
    rows in order, the JSON rewritten after each, a file that cannot be made one row's error, the
    table and the chart."""
    monkeypatch.setattr(model_files, "random_gguf", _cannot_make)
    seen: list = []
    monkeypatch.setattr(formats_bench, "server_runners", lambda *args: fake_runners(seen))
    out = tmp_path / "out"
    rows_on_disk: list[list[str]] = []
    original = formats_bench.run_formats_bench

    def run(*args, on_row, **kw):
        def then_read(report: dict) -> None:
            on_row(report)
            [saved] = out.glob("bench-*.json")
            rows_on_disk.append(list(json.loads(saved.read_text())["formats"]["rows"]))

        kw |= {
            "llama_binary": tmp_path / "llama-server",
            "workdir": tmp_path / "work",
            "bandwidth": lambda threads: {"gb_per_s": 10.0, "method": f"fake, {threads} threads"},
        }
        return original(*args, on_row=then_read, **kw)

    monkeypatch.setattr(formats_bench, "run_formats_bench", run)
    monkeypatch.setattr(bench, "say", lambda line: None)
    report = bench.run_bench(
        lambda dtype: pytest.fail("no engine workload loads a model"),
        ["auto"],
        "float32",
        EngineSettings(kv_budget_mb=128),
        ["formats"],
        False,
        4,
        str(out),
        threads=2,
        formats=["qwen3-0.6b-q8_0", "embedded"],
    )
    assert rows_on_disk == [["embedded"], ["embedded", "qwen3-0.6b-q8_0"]]
    f = report["formats"]
    assert list(f["rows"]) == ["embedded", "qwen3-0.6b-q8_0"] and f["dtype"] == "auto" and f["reps"] == 1
    assert f["read_bandwidth"]["method"] == "fake, 2 threads"
    embedded = f["rows"]["embedded"]
    assert embedded["bars"]["met"] is True and len(embedded["pairs"]) == 1
    assert embedded["floor_tokens_per_s"] == pytest.approx(
        10e9 / file_matmul_bytes(GGUFFile(embedded_model_path()))
    )
    assert "llama-quantize to Q8_0 failed" in f["rows"]["qwen3-0.6b-q8_0"]["error"]
    assert [(s[0], s[1]) for s in seen] == [("llama-server", "embedded"), ("rtserver", "embedded")]
    [saved] = out.glob("bench-*.json")
    assert json.loads(saved.read_text())["formats"]["rows"]["embedded"]["ratios"]["burst_tokens_per_s"] == 1.5
    names = [row[0] for row in report["table"]]
    assert "[formats] embedded bars" in names and "[formats] qwen3-0.6b-q8_0" in names
    svg = ET.parse(saved.with_suffix(".svg")).getroot()
    texts = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert "embedded: rtserver" in texts and "embedded: llama-server" in texts and "1.50x" in texts
    assert not any(t and t.startswith("qwen3") for t in texts)  # a row without figures has no bar


def test_chart_rows_of_the_matrix_skip_a_refused_server():
    report = {
        "formats": {
            "rows": {
                "q4_k_m": {
                    "systems": {"llama-server": llama_figures(), "rtserver": {"error": "refused"}},
                    "ratios": {
                        "burst_tokens_per_s": None,
                        "single_tokens_per_s": None,
                        "burst_ttft_p95": None,
                    },
                }
            }
        }
    }
    rows = chart.chart_rows(report)
    assert {r[0] for r in rows} == {"q4_k_m: llama-server"}
    assert ("q4_k_m: llama-server", "llama-server", "formats: peak RSS", 300.0) in rows
    assert ("q4_k_m: llama-server", "llama-server", "formats: burst-unique TTFT p95", 2.0) in rows


@pytest.mark.skipif(not slow_tests_on(), reason="slow: set RTSERVER_SLOW_TESTS=1")
def test_one_real_row_on_a_tiny_budget(monkeypatch, tmp_path):
    """The embedded row on both real servers: every workload exact, each server's peak RSS followed."""
    binary = built_llama_server()
    monkeypatch.setattr(server_bench, "BURST_TEXTS", server_bench.BURST_TEXTS[:4])
    monkeypatch.setattr(server_bench, "WARM_UP_TEXTS", server_bench.WARM_UP_TEXTS[:4])
    monkeypatch.setattr(server_bench, "BURST_TOKENS", 8)
    monkeypatch.setattr(server_bench, "SINGLE_TOKENS", 8)
    monkeypatch.setattr(server_bench, "BACKGROUND_TOKENS", 60)
    out = formats_bench.run_formats_bench(
        ["embedded"],
        "auto",
        2,
        arrivals=2,
        llama_binary=binary,
        workdir=tmp_path,
        bandwidth=lambda threads: read_bandwidth.measure(threads, size_mb=64),
    )
    row = out["rows"]["embedded"]
    assert list(row["systems"]) == ["llama-server", "rtserver"]
    for s in row["systems"].values():
        assert s["burst-unique"]["exact_token_counts"] and s["burst-unique"]["generated_tokens"] == 32
        assert s["single"]["exact_token_counts"] and s["single-first"]["exact_token_counts"]
        assert s["arrival-unique"]["arrivals"] == 2 and s["peak_rss_mb"] > 50
    assert all(v is not None for v in row["ratios"].values())
    ours = row["systems"]["rtserver"]
    assert ours["runs_as"] == "gguf" and ours["kv_used_peak_mb"] > 0
    assert "RTSERVER_ENGINE_KV_BUDGET_MB" not in ours["settings_set"]  # the default budget serves it
    assert "RTSERVER_SECURITY_API_KV_SHARE" not in ours["settings_set"]
    assert row["pairs"][0]["refused_or_failed"] == {"llama-server": 0, "rtserver": 0}
    assert row["floor_tokens_per_s"] > 0 and row["pairs"][0]["kv_in_use_source"] == KV_FROM_METRICS


def test_the_command_line_refuses_an_unknown_row_before_anything_runs(capsys):
    from rtserver.cli import build_parser

    args = build_parser().parse_args(["bench", "--workloads", "formats", "--formats", "embedded,q3_k"])
    assert args.func(args) == 2
    assert "unknown formats rows q3_k (known: embedded, q4_0" in capsys.readouterr().err
    args = build_parser().parse_args(["bench", "--workloads", "formats", "--reps", "0"])
    assert args.func(args) == 2
    assert "--reps 0: between 1 and 20" in capsys.readouterr().err
