"""Server processes as the bench runs them: the peak RSS of a process tree, followed from its start, and
a failed start that says why (the log's start-up failure)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from rtbench.serverproc import RssWatch, ServerProcess, log_reason, process_tree

# a parent holding ~80 MB that starts a child holding ~120 MB, both alive until stdin closes
HOLDER = """
import subprocess, sys
block = bytearray({mb} << 20)
for i in range(0, len(block), 4096):
    block[i] = 1
if {spawn}:
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE)
print("ready", flush=True)
sys.stdin.read()
"""


def test_process_tree_follows_parent_links():
    parents = {10: 1, 11: 10, 12: 11, 13: 10, 20: 1}
    assert sorted(process_tree(10, parents)) == [10, 11, 12, 13]
    assert process_tree(99, parents) == [99]


def test_rss_watch_counts_a_serving_child_and_keeps_the_peak_after_exit():
    """A child seen before `serving()` (a kernel build's compiler) stays out of the peak; once serving,
    the whole tree counts."""
    child_code = HOLDER.format(mb=120, spawn=False)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER.format(mb=80, spawn=True), child_code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    watch = RssWatch(every_s=0.05)
    watch.follow(proc.pid)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while watch.tree_mb < 190 and time.monotonic() < deadline:  # the child's block is written
            time.sleep(0.05)
        assert 190 < watch.tree_mb and 75 < watch.hwm_mb < 150  # the child counts in the tree only
        assert watch.peak_mb == watch.hwm_mb  # not serving yet
        watch.serving()
        watch.sample()
        assert watch.peak_mb == watch.serving_tree_mb > 190
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(30)
    watch.stop()
    seen = watch.figures()
    assert seen["peak_rss_mb"] == watch.serving_tree_mb and seen["peak_tree_rss_mb"] >= seen["peak_rss_mb"]
    assert seen["peak_hwm_mb"] == watch.hwm_mb


def test_rss_watch_before_any_process_reads_zero():
    watch = RssWatch()
    watch.stop()
    assert watch.figures() == {"peak_rss_mb": 0.0, "peak_hwm_mb": 0.0, "peak_tree_rss_mb": 0.0}


def test_log_reason_picks_the_last_marked_line(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "INFO starting\n"
        "2026-12-01 ERROR rtserver.web.app startup failed: cannot load the model: model type 'qwen3' is "
        "not supported (supported: llama, qwen2, mistral)\n"
        "INFO shutting down\n\n"
    )
    assert log_reason(log, "startup failed:") == (
        "startup failed: cannot load the model: model type 'qwen3' is not supported "
        "(supported: llama, qwen2, mistral)"
    )
    assert log_reason(log, "no such marker") == "INFO shutting down"
    assert log_reason(tmp_path / "missing.log", "error") == ""


def test_a_refused_model_stops_the_start_with_the_logs_reason(tmp_path):
    """The server's own start-up failure line ends the RuntimeError; the process is gone."""
    refuse = (
        "import sys; print('ERROR rtserver startup failed: cannot load the model: "
        "model type \\'gemma3_text\\' is not supported', flush=True); sys.exit(3)"
    )
    server = ServerProcess({}, tmp_path / "server.log", launcher=["-c", refuse])
    with pytest.raises(RuntimeError) as failed:
        server.start(timeout_s=60)
    message = str(failed.value)
    assert "exited with 3 during start-up" in message
    assert message.endswith(
        "startup failed: cannot load the model: model type 'gemma3_text' is not supported"
    )
    assert server.proc is not None and server.proc.poll() == 3


def test_a_start_that_never_gets_ready_is_stopped(tmp_path):
    server = ServerProcess({}, tmp_path / "server.log", launcher=["-c", "import time; time.sleep(60)"])
    with pytest.raises(RuntimeError, match="not up after"):
        server.start(timeout_s=1)
    assert server.proc is not None and server.proc.poll() is not None  # terminated, not left running
