"""OpenMP pools (rtserver/engine/openmp.py): only the scheduler's thread keeps one once the server runs.

Each check runs in a fresh interpreter, so no other test's threads are counted. libgomp's workers are the
process's threads that Python did not start: a pool of two threads is one such worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ..serverutil import TIMEOUT

COUNT = """
import os, threading
def workers():  # threads Python did not start: libgomp's (rayon's are off, OpenBLAS's came at import)
    return len(os.listdir("/proc/self/task")) - threading.active_count()
"""

pytestmark = pytest.mark.skipif(
    "parallel backend: OpenMP" not in torch.__config__.parallel_info(),
    reason="torch does not use OpenMP here",
)


def fresh_interpreter(script: str, **env: str) -> dict:
    """Runs `script` in a new Python and gives back the JSON of its last printed line."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=dict(os.environ, TOKENIZERS_PARALLELISM="false", **env),
        timeout=4 * TIMEOUT,
        cwd=os.getcwd(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run(script: str) -> dict:
    return fresh_interpreter(textwrap.dedent(COUNT) + textwrap.dedent(script), OMP_NUM_THREADS="2")


def test_release_pool_ends_the_calling_threads_workers_only():
    got = _run(
        """
        import json, threading, torch
        from rtserver.engine.openmp import release_pool
        torch.set_num_threads(2)
        before = workers()
        a = torch.randn(1500, 1500)
        a @ a  # the main thread's pool: one worker
        main_pool = workers()
        out = {}
        def other():
            a @ a  # a second pool beside it
            out["both"] = workers()
            out["released"] = release_pool()
            out["after"] = workers()
        t = threading.Thread(target=other); t.start(); t.join()
        print(json.dumps({"before": before, "main": main_pool, **out}))
        """
    )
    assert got == {
        "before": got["before"],
        "main": got["before"] + 1,
        "both": got["before"] + 2,
        "released": True,
        "after": got["before"] + 1,
    }


def test_a_served_model_on_blocks_leaves_no_pool_but_the_kernels():
    """The app loads the model, tokenizer and tasks on executor threads and builds the engine on one; each
    lets its pool go. With every linear on the kernel's blocks, the scheduler's torch operations run on
    its own thread (`limit_team`), so no libgomp worker spins beside the kernel's (kernels/pool.h). Other
    threads keep the model's count."""
    got = _run(
        """
        import asyncio, json, httpx, torch
        from rtserver.web.app import create_app
        from tests.serverutil import make_settings, serve
        torch.set_num_threads(2)
        before = workers()
        async def main():
            settings = make_settings(model={"dtype": "auto", "threads": 2})
            async with serve(create_app(settings), settings) as (base, _):
                async with httpx.AsyncClient(timeout=120) as client:
                    r = await client.post(base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
                    r.raise_for_status()
                    health = (await client.get(base + "/health")).json()
                return workers(), health["backends"]["local"]["kernels"]["torch_threads"]
        serving, shown = asyncio.run(main())
        from pathlib import Path
        from rtserver.engine.quant import load_kernel
        kernel_workers = load_kernel(Path("~/.cache/rtserver").expanduser()).pool_stats()["threads"] - 1
        print(json.dumps({"before": before, "serving": serving, "kernel_workers": kernel_workers,
                          "shown": shown, "main": torch.get_num_threads()}))
        """
    )
    assert got["kernel_workers"] == 1
    assert got["serving"] == got["before"] + got["kernel_workers"], got
    assert (got["shown"], got["main"]) == (1, 2), got


def test_limit_team_caps_the_calling_thread_alone():
    got = _run(
        """
        import json, threading, torch
        from rtserver.engine.openmp import limit_team
        torch.set_num_threads(2)
        before = workers()
        out = {}
        def capped():
            out["limited"] = limit_team(1)
            a = torch.randn(1500, 1500)
            a @ a  # inline: no pool for this thread
            torch.randn(1 << 20).exp()  # MKL's vector math, which opens regions by its own count
            out["threads"], out["workers"] = torch.get_num_threads(), workers() - before
        t = threading.Thread(target=capped); t.start(); t.join()
        print(json.dumps({**out, "main": torch.get_num_threads()}))
        """
    )
    assert got == {"limited": True, "threads": 1, "workers": 0, "main": 2}
