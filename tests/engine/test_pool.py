"""The kernel's worker threads (engine/kernels/pool.h): the scheduler's thread owns them, every loop of
a served step runs there, and a loop started on any other thread runs alone and is counted.

Each check runs in a fresh interpreter, so its counters start at zero.
"""

from __future__ import annotations

from .test_openmp import fresh_interpreter

SERVE = """
import asyncio, json, threading, torch
from rtserver.config import EngineSettings
from rtserver.engine import quant
from rtserver.engine.backend import SamplingParams
from rtserver.engine.core import Engine
from rtserver.engine.model import load_model

loaded = load_model("embedded", dtype="gguf", threads=2)
kernel = loaded.kernel
out = {"kernel": kernel is not None}

async def main():
    engine = Engine(loaded, EngineSettings(kv_budget_mb=64))
    out["before"] = kernel.pool_stats()
    engine.start()
    ids = loaded.tokenizer("Tell me about the sea, in a few words.")["input_ids"]
    params = SamplingParams(max_new_tokens=8, min_new_tokens=8)
    replies = await asyncio.gather(*[engine.generate(ids, params).result() for _ in range(3)])
    out["tokens"] = [len(r.token_ids) for r in replies]
    out["served"] = kernel.pool_stats()
    await engine.stop()
    # the main thread takes the pool over; the same call from a thread that does not own it
    kernel.bind_pool(2)
    weight = engine.runner.layers[0].gate_up.blocks
    x = torch.randn(64, weight.shape[1])
    owner = quant.quantized_matmul(kernel, x, weight)
    side = {}
    t = threading.Thread(target=lambda: side.update(y=quant.quantized_matmul(kernel, x, weight)))
    t.start(); t.join()
    out["side"] = kernel.pool_stats()
    out["side_equal"] = bool(torch.equal(side["y"], owner))

asyncio.run(main())
print(json.dumps(out))
"""


def test_served_steps_run_every_loop_on_the_scheduler_threads_pool():
    got = fresh_interpreter(SERVE)
    assert got["kernel"], "the kernel did not build"
    assert got["tokens"] == [8, 8, 8]
    before, served, side = got["before"], got["served"], got["side"]
    assert served["threads"] == 2
    assert served["loops"] > before["loops"] + 3 * 8  # every step runs several parallel loops
    assert served["off_owner"] == before["off_owner"], "a loop of a served step ran off the scheduler thread"
    # the check can fail: a loop from another thread is counted, and runs there alone, to the same bits
    assert side["off_owner"] > served["off_owner"]
    assert got["side_equal"]


PROBE = """
import json, time
from rtserver.engine.model import load_model
kernel = load_model("embedded", dtype="gguf", threads=2).kernel
kernel.bind_pool(2)
time.sleep(0.01)  # the worker is spinning or asleep: either way it joins the next loop
got = [kernel.pool_probe(64, 200_000) for _ in range(3)]
print(json.dumps(got))
"""


def test_a_stalled_worker_leaves_its_chunks_to_the_owner():
    # A worker that loses its core mid-loop (a busy machine) must not hold the step: the loop is cut in
    # chunks claimed as threads come, so the owner runs what the stalled worker has not claimed.
    for got in fresh_interpreter(PROBE):
        assert got["owner"] + got["workers"] == 64
        assert got["workers"] == 8, got  # the stalled worker's one chunk of eight
        assert got["owner"] == 56, got
