"""The kld workload (rtbench/kld*.py): the KL-divergence arithmetic on distributions worked out by hand,
llama-perplexity's base file, the windows and the positions they score, llama-perplexity's printed
statistics, the table; one real run on the embedded model (float32 against itself gives 0, the default
path small but more); with llama-perplexity built, llama.cpp on the same weights in F32 against our
float32 reference (the ids, BOS and positions line up)."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import numpy as np
import pytest

from rtbench import bench_report, commands, kld_bench, kld_report, model_files
from rtbench.kld import Divergence, log_softmax, row_divergences
from rtbench.kld_base import BaseFile, BaseWriter, decode_rows, encode_rows, row_width
from rtbench.kld_windows import Windows
from rtbench.llama_build import tool_path
from rtserver.config import EngineSettings
from rtserver.engine.model import embedded_model_path

from ..components import missing, slow_tests_on

LN2 = math.log(2)


# -- the arithmetic ---------------------------------------------------------------------------------


def test_kl_divergence_of_distributions_worked_out_by_hand():
    p = np.log([[0.5, 0.25, 0.25]])
    q = np.log([[0.25, 0.5, 0.25]])
    kld, same = row_divergences(p, q)
    # 0.5 ln(0.5 / 0.25) + 0.25 ln(0.25 / 0.5) + 0.25 ln 1 = 0.5 ln 2 - 0.25 ln 2
    assert kld[0] == pytest.approx(0.25 * LN2, abs=1e-12)
    assert not same[0]  # 0 against 1 first
    kld, _ = row_divergences(q, p)  # not symmetric: 0.25 ln(1/2) + 0.5 ln 2 = 0.25 ln 2 here too, by chance
    assert kld[0] == pytest.approx(0.25 * LN2, abs=1e-12)
    kld, _ = row_divergences(np.log([[0.9, 0.1]]), np.log([[0.5, 0.5]]))
    assert kld[0] == pytest.approx(0.9 * math.log(1.8) + 0.1 * math.log(0.2), abs=1e-12)


def test_identical_distributions_give_zero_whatever_the_logits_offset():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (5, 1000))
    kld, same = row_divergences(log_softmax(logits), logits + 7.5)  # a constant added to a row's logits
    assert np.abs(kld).max() < 1e-12 and same.all()
    assert np.allclose(np.exp(log_softmax(logits)).sum(axis=1), 1.0)


def test_reference_terms_under_the_cut_are_left_out_as_llama_perplexity_does():
    # the reference puts e^-20 on token 1: llama-perplexity skips terms with log p_ref <= -16
    ref = np.array([[math.log1p(-math.exp(-20)), -20.0]])
    ours = np.log([[0.5, 0.5]])
    kld, _ = row_divergences(ref, ours)
    assert kld[0] == pytest.approx(math.exp(ref[0, 0]) * (ref[0, 0] + LN2), abs=1e-15)


def test_top1_agreement_takes_the_first_of_equal_largest_values():
    ref = np.log([[0.4, 0.4, 0.2], [0.2, 0.3, 0.5]])
    ours = np.log([[0.45, 0.45, 0.1], [0.5, 0.3, 0.2]])
    _, same = row_divergences(ref, ours)
    assert same.tolist() == [True, False]


def test_the_summary_of_gathered_rows():
    d = Divergence()
    uniform = np.log(np.full((1, 4), 0.25))
    d.add(np.repeat(uniform, 99, axis=0), np.zeros((99, 4)))  # 99 rows equal to the reference
    d.add(np.log([[0.5, 0.25, 0.25]]), np.log([[0.25, 0.5, 0.25]]).astype(np.float32))  # one of 0.25 ln 2
    s = d.summary()
    assert s["tokens_scored"] == 100 and d.count == 100
    assert s["mean_kld"] == pytest.approx(0.25 * LN2 / 100)
    assert s["median_kld"] == pytest.approx(0.0, abs=1e-15)
    # p99: k = 99 * 0.99 = 98.01 between the 99th (0) and the 100th value (0.25 ln 2)
    assert s["p99_kld"] == pytest.approx(0.01 * 0.25 * LN2)
    assert s["max_kld"] == pytest.approx(0.25 * LN2)
    assert s["top1_agreement"] == pytest.approx(99 / 100)  # the uniform rows' first entries agree
    assert Divergence().summary()["mean_kld"] is None


def test_rows_of_different_shapes_are_refused():
    with pytest.raises(ValueError, match="differ"):
        row_divergences(np.zeros((2, 3)), np.zeros((2, 4)))


# -- llama-perplexity's base file --------------------------------------------------------------------


def test_a_row_is_encoded_as_llama_perplexity_writes_it():
    logits = np.array([[0.0, -1.0, -20.0]], dtype=np.float32)
    row = encode_rows(logits)
    assert row.shape == (1, row_width(3)) == (1, 8)  # 4 header values, 3 entries, 1 of padding
    scale, smallest = row[0, :4].view(np.float32)
    lse = np.float32(math.log(1 + math.exp(-1) + math.exp(-20)))
    assert scale == np.float32(16) / np.float32(65535)  # max - max(min, max - 16), over 65535 steps
    assert smallest == pytest.approx(-16 - lse, abs=1e-6)  # the bottom's log-probability
    assert row[0, 4] == 65535 and row[0, 6] == 0 and row[0, 7] == 0  # top, below the range, padding
    assert row[0, 5] == round(15 / float(scale))  # logit -1 is 15 above the bottom
    log_probs = decode_rows(row, 3)
    assert log_probs[0, 0] == pytest.approx(-lse, abs=1e-4)
    assert log_probs[0, 1] == pytest.approx(-1 - lse, abs=1e-4)
    assert log_probs[0, 2] == pytest.approx(-16 - lse, abs=1e-4)  # reads back as the bottom


def test_rows_read_back_within_half_a_step_of_the_exact_log_probabilities():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 4, (6, 501)).astype(np.float32)  # an odd vocabulary: one padding value
    back = decode_rows(encode_rows(logits), 501)
    exact = log_softmax(logits)
    in_range = logits > logits.max(axis=1, keepdims=True) - 16
    step = 16 / 65535
    assert np.abs(back - exact)[in_range].max() <= step / 2 + 1e-5
    flat = np.zeros((1, 501), dtype=np.float32)  # every logit equal: scale 0, every entry the bottom
    assert np.allclose(decode_rows(encode_rows(flat), 501), -math.log(501), atol=1e-5)


def test_a_base_file_holds_its_header_ids_and_each_windows_rows(tmp_path):
    n_ctx, vocab = 8, 5
    windows = [list(range(8)), list(range(10, 18))]
    rng = np.random.default_rng(2)
    rows = [rng.normal(0, 2, (3, vocab)).astype(np.float32) for _ in windows]  # 8 - 1 - 4 scored each
    path = tmp_path / "base.kld"
    with BaseWriter(path, n_ctx, vocab, windows) as writer:
        for r in rows:
            writer.write(r)
    raw = path.read_bytes()
    assert raw[:8] == b"_logits_"
    assert np.frombuffer(raw, np.uint32, 1, 8)[0] == n_ctx
    assert np.frombuffer(raw, np.int32, 2, 12).tolist() == [vocab, 2]
    assert len(raw) == 20 + 4 * 16 + 2 * 3 * row_width(vocab) * 2
    read = BaseFile(path)
    assert (read.n_ctx, read.n_vocab, read.n_chunk, read.scored) == (8, 5, 2, 3)
    assert read.windows == windows
    for w, r in enumerate(rows):
        assert np.array_equal(read.log_probs(w), decode_rows(encode_rows(r), vocab))
    path.write_bytes(raw[:-2])
    with pytest.raises(ValueError, match="its header says"):
        BaseFile(path)
    with pytest.raises(ValueError, match="n_ctx = 8"):
        BaseWriter(tmp_path / "other.kld", 8, vocab, [list(range(7))])


# -- windows -----------------------------------------------------------------------------------------


def test_windows_cut_and_score_as_llama_perplexity_does():
    w = Windows(list(range(100, 120)), 8)  # 20 ids: two windows, the last 4 ids left out
    assert (w.count, w.first, w.scored, w.tokens_scored) == (2, 4, 3, 6)
    assert w.tokens(0) == list(range(100, 108)) and w.tokens(1) == list(range(108, 116))
    assert w.inputs(1) == w.tokens(1)  # no BOS: the text's own ids
    assert w.all_tokens() == [w.tokens(0), w.tokens(1)]
    with_bos = dataclasses.replace(w, bos=1)
    assert with_bos.inputs(1) == [1, *range(109, 116)]  # BOS in place of the window's first id
    assert with_bos.tokens(1) == w.tokens(1)  # what the base file records
    with pytest.raises(IndexError):
        w.tokens(2)
    with pytest.raises(ValueError, match="no window"):
        Windows(list(range(7)), 8)
    with pytest.raises(ValueError, match="even window"):
        Windows(list(range(20)), 7)


def test_the_embedded_model_takes_no_bos_and_gemma_does():
    assert kld_bench.bos_id(embedded_model_path()) is None
    try:
        gemma = model_files.gemma3_270m()
    except model_files.ModelFileError as exc:
        missing("the Gemma 3 270M packages", str(exc))
    assert kld_bench.bos_id(gemma) == 2


# -- llama-perplexity's statistics, the bar, the table, the command --------------------------------

LLAMA_TAIL = """
kl_divergence: computing over 4 chunks, n_ctx=64, batch_size=64, n_seq=1
====== KL divergence statistics ======
Mean    KLD:   0.012345 ±   0.000321
Maximum KLD:   0.987654
99.9%   KLD:   0.500000
99.0%   KLD:   0.123456
95.0%   KLD:   0.050000
Median  KLD:   0.004321
Same top p: 93.548 ± 2.209 %
"""


def test_llama_perplexity_statistics_are_read_with_rtservers_names():
    figures = kld_bench.parse_llama_kld(LLAMA_TAIL, 31)
    assert figures == {
        "mean_kld": 0.012345,
        "median_kld": 0.004321,
        "p99_kld": 0.123456,
        "max_kld": 0.987654,
        "top1_agreement": pytest.approx(0.93548),
        "tokens_scored": 124,
    }
    with pytest.raises(ValueError, match="no mean_kld"):
        kld_bench.parse_llama_kld("kl_divergence: computing over 1 chunks", 31)


def test_the_bar_holds_per_path_where_both_figures_are_at_most_llamas():
    llama = {"mean_kld": 0.02, "top1_agreement": 0.90}
    ours = {
        "prefill": {"mean_kld": 0.01, "top1_agreement": 0.95},
        "decode": {"mean_kld": 0.01, "top1_agreement": 0.85},
    }
    assert kld_bench.bar(ours, llama) == {"prefill": True, "decode": False}
    assert kld_bench.bar(ours, {"error": "no build"}) == {"prefill": None, "decode": None}


def test_the_table_rows_of_a_report():
    summary = {"mean_kld": 0.0123, "p99_kld": 0.2, "top1_agreement": 0.9512, "tokens_scored": 4080}
    row = {
        "windows": 16,
        "n_ctx": 512,
        "text": {"token_ids": 8300},
        "rtserver": {
            "dtype": "gguf",
            "activation_bits": 16,
            "prefill": summary,
            "decode": summary,
            "reference_against_its_stored_rows": {**summary, "mean_kld": 1e-6},
        },
        "llama.cpp": {"error": "RuntimeError: exited 1"},
        "bar": {"prefill": None, "decode": True},
    }
    report = {"engine": {}, "baselines": {}, "kld": {"rows": {"q4_k_m": row, "bad": {"error": "no file"}}}}
    rows = {name: (value, bar) for name, value, bar in bench_report.table(report)}
    figures = kld_report.FIGURES
    assert rows["[kld] q4_k_m: windows x n_ctx; token ids of the text"][0] == "16 x 512; 8,300"
    assert rows[f"[kld] q4_k_m rtserver prefill (gguf, 16-bit activations): {figures}"][0] == (
        "0.0123 / 0.2 / 95.12% / 4,080"
    )
    assert rows[f"[kld] q4_k_m llama.cpp (llama-perplexity): {figures}"][0] == "error: RuntimeError: exited 1"
    assert rows["[kld] q4_k_m float32 reference against its stored rows: mean KLD"][0] == "1e-06"
    assert rows["[kld] q4_k_m bar: prefill; decode"] == ("n/a; held", kld_report.BAR)
    assert rows["[kld] bad"][0] == "error: no file"


def test_kld_is_a_workload_asked_for_by_name():
    assert "kld" in commands.BENCH_WORKLOADS and "kld" not in commands.DEFAULT_WORKLOADS
    assert {"formats", "remote"}.isdisjoint(commands.DEFAULT_WORKLOADS)
    assert "servers" in commands.DEFAULT_WORKLOADS
    assert kld_bench.TEXT.is_file()


def test_the_shipped_text_is_ours_to_use():
    """Public domain, listed in data/SOURCES.md with its digest, and none of the held-out texts."""
    text = kld_bench.TEXT.read_bytes()
    digest = hashlib.sha256(text).hexdigest()
    sources = (kld_bench.TEXT.parent / "SOURCES.md").read_text()
    assert digest in sources and "public domain" in sources.lower()
    held_out = Path(__file__).resolve().parents[3] / "shared" / "data" / "heldout-exclude.sha256"
    if held_out.is_file():
        assert digest not in held_out.read_text().split()


# -- real runs ---------------------------------------------------------------------------------------

SHORT = 64  # n_ctx of the real runs: 32 scored positions a window less one


def _short_text() -> str:
    return kld_bench.read_text()[:1400]  # 340 ids of the embedded model: 5 windows of 64, 155 scored


def test_float32_against_itself_is_zero_and_the_default_path_is_small(tmp_path):
    settings = EngineSettings()
    same = kld_bench.measure_file(
        embedded_model_path(),
        "float32",
        settings,
        2,
        "~/.cache/rtserver",
        tmp_path / "f32",
        None,
        _short_text(),
        SHORT,
    )
    assert same["windows"] == 5 and same["tokens_scored"] == same["windows"] * (SHORT - 1 - SHORT // 2)
    ours = same["rtserver"]
    assert ours["prefill"]["against_exact_float32"]["mean_kld"] == 0.0  # the same arithmetic, row for row
    assert ours["prefill"]["against_exact_float32"]["top1_agreement"] == 1.0
    assert abs(ours["decode"]["against_exact_float32"]["max_kld"]) < 1e-6  # one row a step: float sums
    floor = ours["reference_against_its_stored_rows"]["mean_kld"]
    assert abs(floor) < 1e-4  # the 16-bit rows' own cost
    assert "llama.cpp" not in same and same["bar"] == {"prefill": None, "decode": None}

    default = kld_bench.measure_file(
        embedded_model_path(),
        "gguf",
        settings,
        2,
        "~/.cache/rtserver",
        tmp_path / "gguf",
        None,
        _short_text(),
        SHORT,
    )
    assert default["rtserver"]["dtype"] == "gguf"
    for path in kld_bench.PATHS:
        exact = default["rtserver"][path]["against_exact_float32"]
        assert 0 < exact["mean_kld"] < 0.01, (path, exact)  # rounded activations and 16-bit KV, nothing more
        assert exact["top1_agreement"] >= 0.9, (path, exact)
    assert not (tmp_path / "gguf" / "reference.kld").exists()  # gigabytes for a large vocabulary: deleted


@pytest.fixture(scope="module")
def perplexity_built() -> Path:
    if not slow_tests_on():
        pytest.skip("needs llama-perplexity (RTSERVER_SLOW_TESTS=1)")
    for tool in ("llama-perplexity", "llama-quantize"):
        if not tool_path(tool).is_file():
            missing(f"the {tool} build", "python scripts/build_llama_server.py (./run test builds it)")
    return tool_path("llama-perplexity")


@pytest.mark.slow
def test_llama_cpp_on_the_same_weights_in_f32_matches_our_float32_reference(perplexity_built, tmp_path):
    """The embedded model's weights in F32: llama.cpp's distributions, on the ids and positions of our base
    file, are the reference's own up to float rounding and the 16-bit rows. A shifted position, a wrong BOS
    or another id would put them far apart."""
    f32 = model_files.requantized("F32")
    out = kld_bench.measure_file(
        f32,
        "float32",
        EngineSettings(),
        2,
        "~/.cache/rtserver",
        tmp_path,
        perplexity_built,
        _short_text(),
        SHORT,
    )
    llama = out["llama.cpp"]
    assert "error" not in llama, llama
    assert llama["tokens_scored"] == out["tokens_scored"]
    assert llama["mean_kld"] < 1e-3 and llama["top1_agreement"] >= 0.97, llama
    assert out["bar"]["prefill"] is not None
