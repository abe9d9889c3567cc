"""`rtserver loadtest --quick` end to end (slow: real servers, the real model): every check passes."""

from __future__ import annotations

import pytest

from rtbench.loadtest import run_loadtest

pytestmark = pytest.mark.slow


def test_quick_loadtest_passes_every_check(tmp_path):
    report = run_loadtest(idle=200, chatting=16, disconnects=20, out_dir=str(tmp_path))
    failed = [c["check"] for c in report["checks"] if not c["passed"]]
    assert not failed, failed
    assert report["shutdown"]["exit_code"] == 0 and report["server_a"]["exit_code"] == 0
    assert not report["server_a"]["errors_logged"] and not report["server_b"]["errors_logged"]
    # the first turns' burst (16 new chats + their sentiment calls) is reported on its own
    load = report["load"]
    assert (
        load["auto_tasks"] == ["sentiment"]
        and load["first_turn_ttft_p95_ms"] >= load["first_turn_ttft_p50_ms"]
    )
