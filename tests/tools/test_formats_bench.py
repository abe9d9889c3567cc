"""The formats matrix (tools/formats_bench.py) on fake servers: its rows and their picking, a row whose
file cannot be made or whose server refuses the model, the ratios and bars, the printed rows, the chart
and the bench's JSON. With RTSERVER_SLOW_TESTS=1 and llama-server built, one real row on a tiny budget."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from rtserver.config import EngineSettings
from rtserver.engine.model import embedded_model_path
from rtserver.tools import bench, chart, formats_bench, model_files, server_bench
from rtserver.tools.formats_bench import RSS_BAR, FormatRow, pick, row_bars, run_row

from ..components import slow_tests_on
from ..llamautil import built_llama_server

ALL_ROWS = [
    "embedded",
    "q4_0",
    "q4_k_m",
    "q5_k_m",
    "q6_k",
    "q8_0",
    "qwen3-0.6b-q4_k_m",
    "qwen3-0.6b-q8_0",
    "gemma3-270m-q4_k_m",
]

SYSTEM_FIGURES = "burst / single tokens/s; burst TTFT p95 ms; arrival TTFT p95 ms; peak RSS MB"


def figures(burst_tps: float, single_tps: float, ttft_p95: float, rss: float) -> dict:
    return {
        "burst-unique": {"tokens_per_s": burst_tps, "ttft_p95_ms": ttft_p95, "exact_token_counts": True},
        "single": {"tokens_per_s": single_tps, "ttft_p95_ms": 20.0, "exact_token_counts": True},
        "arrival-unique": {"ttft_p95_ms": 150.0},
        "peak_rss_mb": rss,
    }


def fake_runners(seen: list, refuse: str = "") -> dict:
    """llama-server and rtserver stand-ins; rtserver refuses the rows named `refuse` as the server does."""

    def llama(row: FormatRow, path: Path, folder: Path, kv_budget_mb: float) -> dict:
        seen.append(("llama-server", row.name, path, folder, row.prompts().path))
        return figures(200.0, 100.0, 2000.0, 300.0)

    def rtserver(row: FormatRow, path: Path, folder: Path, kv_budget_mb: float) -> dict:
        seen.append(("rtserver", row.name, path, folder, row.prompts().path, kv_budget_mb))
        if row.name == refuse:
            raise RuntimeError(
                "server exited with 3 during start-up; see x.log: startup failed: model type "
                "'qwen3' is not supported (supported: llama, qwen2, mistral)"
            )
        return figures(300.0, 120.0, 800.0, 700.0)

    return {"llama-server": llama, "rtserver": rtserver}


def test_the_matrix_rows_and_picking_them():
    rows = formats_bench.matrix()
    assert [r.name for r in rows] == ALL_ROWS
    embedded, gemma = rows[0], rows[-1]
    assert embedded.spec == "embedded" and embedded.make() == embedded_model_path()
    assert gemma.completion and gemma.prompts().path == "/v1/completions"
    assert (
        not rows[2].completion and rows[2].spec is None and rows[2].prompts().path == "/v1/chat/completions"
    )
    assert [r.name for r in pick(rows, ["Q8_0", " embedded", "q4_k_m"])] == ["embedded", "q4_k_m", "q8_0"]
    assert pick(rows, None) == rows and pick(rows, []) == rows
    with pytest.raises(ValueError, match=r"unknown formats rows q3_k.*known: embedded, q4_0"):
        pick(rows, ["q3_k", "embedded"])


def test_rtserver_gets_the_kv_that_holds_llama_servers_context(tmp_path):
    """The embedded model's float32 K/V: 30 layers x 2 x 3 heads x 64 x 4 bytes a token, 8,448 tokens
    (llama-server's 33 slots of 256) = 371.25 MB, in whole 16 MB: 384; never below the configured."""
    path = embedded_model_path()
    assert formats_bench.kv_budget_for(path, 100) == 384.0
    assert formats_bench.kv_budget_for(path, 1000) == 1000.0
    seen: list = []
    out = run_row(FormatRow("embedded", lambda: path), 100, fake_runners(seen), tmp_path)
    assert out["kv_budget_mb"] == 384.0 and seen[1][5] == 384.0 and "kv_budget_error" not in out


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
    out = run_row(row, 384, fake_runners(calls), tmp_path)
    assert (
        out["error"]
        == "cannot make the model file: ModelFileError: llama-quantize to Q4_K_M failed: out of disk"
    )
    assert calls == [] and "systems" not in out  # no server ran without a file


def test_a_row_where_rtserver_refuses_the_model_keeps_llama_servers_figures(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * (3 << 20))
    seen: list = []
    row = FormatRow("qwen3-0.6b-q8_0", lambda: model)
    out = run_row(row, 384, fake_runners(seen, refuse="qwen3-0.6b-q8_0"), tmp_path)
    assert [s[0] for s in seen] == ["llama-server", "rtserver"]
    assert seen[0][2] == model and seen[0][3] == tmp_path / "qwen3-0.6b-q8_0" and seen[0][3].is_dir()
    assert out["file_mb"] == 3.0 and out["rss_bar_mb"] == 3.0 + 384 + 600
    assert "model type 'qwen3' is not supported" in out["systems"]["rtserver"]["error"]
    assert out["systems"]["llama-server"]["burst-unique"]["tokens_per_s"] == 200.0
    assert out["ratios"] == {"burst_tokens_per_s": None, "single_tokens_per_s": None, "burst_ttft_p95": None}
    assert out["bars"]["met"] is False and set(out["bars"].values()) == {None, False}
    rows = {n: (v, bar) for n, v, bar in formats_bench.table_rows({"rows": {row.name: out}})}
    refused = rows["[formats] qwen3-0.6b-q8_0 rtserver: " + SYSTEM_FIGURES]
    assert refused[0].startswith("error: server exited with 3") and refused[1] == "RSS <= 987.0"
    assert rows["[formats] qwen3-0.6b-q8_0 bars"][0].startswith("no figure: single >= 1.0x, burst >= 1.5x")


def test_a_row_that_ran_on_both_servers_has_ratios_and_bars(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * (1 << 20))
    out = run_row(FormatRow("q8_0", lambda: model), 100, fake_runners([]), tmp_path)
    assert out["ratios"] == pytest.approx(
        {"burst_tokens_per_s": 1.5, "single_tokens_per_s": 1.2, "burst_ttft_p95": 0.4}
    )
    # RSS 700 MB against 1 + 100 + 600 = 701 MB
    assert out["bars"] == {
        "single >= 1.0x": True,
        "burst >= 1.5x": True,
        "burst TTFT p95 <= 0.5x": True,
        RSS_BAR: True,
        "met": True,
    }
    rows = {n: v for n, v, _ in formats_bench.table_rows({"rows": {"q8_0": out}})}
    assert rows["[formats] q8_0 rtserver / llama-server: burst, single tokens/s; burst TTFT p95"] == (
        "1.50x, 1.20x; 0.40x"
    )
    assert rows["[formats] q8_0 file MB + KV budget MB + 600 = RSS bar MB"] == "1.0 + 100.0 + 600 = 701.0"
    assert rows["[formats] q8_0 bars"] == "all met"
    assert rows["[formats] q8_0 llama-server: " + SYSTEM_FIGURES] == "200.0 / 100.0; 2,000.0; 150.0; 300.0"


def test_each_bar_at_its_edge():
    at_edge = {"burst_tokens_per_s": 1.5, "single_tokens_per_s": 1.0, "burst_ttft_p95": 0.5}
    assert row_bars(at_edge, 1000.0, 1000.0)["met"] is True
    below = row_bars({**at_edge, "single_tokens_per_s": 0.99, "burst_ttft_p95": 0.51}, 1000.1, 1000.0)
    assert below == {
        "single >= 1.0x": False,
        "burst >= 1.5x": True,
        "burst TTFT p95 <= 0.5x": False,
        RSS_BAR: False,
        "met": False,
    }
    assert formats_bench.bars_cell(below) == (f"NOT met: single >= 1.0x, burst TTFT p95 <= 0.5x, {RSS_BAR}")


def test_the_bench_writes_the_matrix_into_its_json_table_and_chart(monkeypatch, tmp_path):
    """`rtserver bench --workloads formats --formats embedded,qwen3-0.6b-q8_0`: the rows in order, the
    JSON rewritten after each, a file that cannot be made one row's error, the table and the chart."""
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

        kw |= {"llama_binary": tmp_path / "llama-server", "workdir": tmp_path / "work"}
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
        formats=["qwen3-0.6b-q8_0", "embedded"],
    )
    assert rows_on_disk == [["embedded"], ["embedded", "qwen3-0.6b-q8_0"]]
    f = report["formats"]
    assert (
        list(f["rows"]) == ["embedded", "qwen3-0.6b-q8_0"]
        and f["kv_budget_mb"] == 128
        and f["dtype"] == "auto"
    )
    embedded = f["rows"]["embedded"]
    # the configured 128 MB is less than llama-server's context in float32 K/V: 384 (kv_budget_for)
    assert embedded["kv_budget_mb"] == 384 and embedded["bars"]["met"] is True
    assert embedded["rss_bar_mb"] == embedded["file_mb"] + 384 + 600
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
                    "systems": {
                        "llama-server": figures(200.0, 100.0, 2000.0, 300.0),
                        "rtserver": {"error": "refused"},
                    },
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
        ["embedded"], "auto", 2, 384, arrivals=2, llama_binary=binary, workdir=tmp_path
    )
    row = out["rows"]["embedded"]
    assert list(row["systems"]) == ["llama-server", "rtserver"]
    for s in row["systems"].values():
        assert s["burst-unique"]["exact_token_counts"] and s["burst-unique"]["generated_tokens"] == 32
        assert s["single"]["exact_token_counts"] and s["arrival-unique"]["arrivals"] == 2
        assert s["peak_rss_mb"] > 50
    assert all(v is not None for v in row["ratios"].values())
    assert row["systems"]["rtserver"]["runs_as"] == "gguf"


def test_the_command_line_refuses_an_unknown_row_before_anything_runs(capsys):
    from rtserver.cli import build_parser

    args = build_parser().parse_args(["bench", "--workloads", "formats", "--formats", "embedded,q3_k"])
    assert args.func(args) == 2
    assert "unknown formats rows q3_k (known: embedded, q4_0" in capsys.readouterr().err
