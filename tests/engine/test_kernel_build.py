"""The kernel's build folder: one builder at a time, and no lock left behind by a killed build."""

from __future__ import annotations

import subprocess
import sys
import threading

from rtserver.engine import quant


def test_a_killed_builders_lock_file_does_not_hold_the_next_build(tmp_path):
    # torch's builder waits while `lock` exists; a build killed mid-way left it, and every start hung.
    (tmp_path / "lock").write_text("")
    with quant._builder_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_second_builder_waits_for_the_first(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from rtserver.engine import quant\n"
            f"with quant._builder_lock(Path({str(tmp_path)!r})):\n"
            "    print('held', flush=True); sys.stdin.readline()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    assert holder.stdout.readline().strip() == "held"
    acquired = threading.Event()

    def second() -> None:
        with quant._builder_lock(tmp_path):
            acquired.set()

    t = threading.Thread(target=second)
    t.start()
    assert not acquired.wait(0.5), "a second builder went ahead while the first held the folder"
    holder.stdin.write("done\n")
    holder.stdin.flush()
    assert acquired.wait(30), "the second builder never got the folder after the first let go"
    t.join()
    holder.wait(timeout=30)
