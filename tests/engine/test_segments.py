"""Inserted blocks on real models: segments computed once and spliced in, keys moved by RoPE, and a session's
next turn that leaves the block out and moves the KV after it back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rtserver.config import EngineSettings
from rtserver.engine import quant
from rtserver.engine.attention import rope
from rtserver.engine.backend import Inserted, SamplingParams
from rtserver.engine.core import Engine
from rtserver.tasks.chat import encode_chat

from ..conftest import reference_greedy

pytestmark = pytest.mark.asyncio

SOURCE_1 = "Refunds: an order can be returned within 30 days of delivery for a full refund.\n"
SOURCE_2 = "Shipping: parcels leave our warehouse within two working days and arrive in five.\n"


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, min_new_tokens=n)


def parts(tok, question: str) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """(public header, source 1, "[2] ", source 2, the question and generation prompt) as token ids."""
    prompt = encode_chat(tok, [{"role": "user", "content": "x"}])
    header = prompt.ids[: prompt.public_tokens]
    tail = prompt.ids[prompt.public_tokens + 1 :]  # after the stand-in "x": the generation prompt

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    return header, enc(SOURCE_1), enc("[2] "), enc(SOURCE_2), enc(f"Question: {question}") + tail


@pytest.fixture
async def engine(smol):
    eng = Engine(smol, EngineSettings(prefill_chunk_tokens=32, kv_budget_mb=64))
    eng.start()
    yield eng
    await eng.stop()


async def test_keys_moved_by_rope_equal_keys_computed_there(engine, smol):
    """Layer 0's keys depend on the token and its position alone: computed at p and moved by d, they equal
    the keys computed at p + d."""
    tok = smol.tokenizer
    ids = tok.encode("The parcel left the warehouse on Monday.", add_special_tokens=False)
    pad = tok.encode("Some words before it, to move it on.", add_special_tokens=False)
    kv = engine.kv
    await engine.generate(ids, greedy(1), session_key="a").result()
    await engine.generate(pad + ids, greedy(1), session_key="b").result()
    a, b = kv.sessions["a"], kv.sessions["b"]
    here = kv.k[:1, a.slots[: len(ids)]]
    there = kv.k[:1, b.slots[len(pad) : len(pad) + len(ids)]]
    moved = engine.runner.shift_keys(here, torch.full((len(ids),), len(pad)))
    assert torch.allclose(moved.float(), there.float(), atol=1e-4, rtol=1e-3)
    assert not torch.allclose(here.float(), there.float(), atol=1e-2)  # the move did something


async def test_a_segment_right_after_the_public_tokens_is_exact(engine, smol):
    """The first segment sees just what the whole prompt shows it: greedy output equals transformers'."""
    header, s1, _, _, question = parts(smol.tokenizer, "How long do I have to return an order?")
    prompt = header + s1 + question
    block = Inserted(len(header), len(header) + len(s1), ((len(header), len(header) + len(s1)),))
    want = reference_greedy(smol, prompt, 12)
    for _ in range(2):  # cold (its own sequence computes it first), then cached
        result = await engine.generate(prompt, greedy(12), public_tokens=len(header), inserted=block).result()
        assert result.token_ids == want
    assert engine.kv.spliced_hits == 2 * len(s1)


async def test_segments_give_the_same_tokens_cold_or_cached(engine, smol):
    header, s1, mark, s2, question = parts(smol.tokenizer, "When will my parcel arrive?")
    prompt = header + s1 + mark + s2 + question
    a = len(header)
    b = a + len(s1) + len(mark)
    block = Inserted(a, b + len(s2), ((a, a + len(s1)), (b, b + len(s2))))
    runs = []
    for _ in range(2):
        result = await engine.generate(prompt, greedy(10), public_tokens=a, inserted=block).result()
        runs.append(result.token_ids)
        # the segments are copied in, not computed: "[2] " and the question are
        assert result.usage.prefilled_tokens == len(prompt) - result.usage.cached_tokens - len(s1) - len(s2)
    assert runs[0] == runs[1]
    assert engine.kv.spliced_hits == 2 * (len(s1) + len(s2))


async def test_the_next_turn_leaves_the_block_out_and_moves_the_rest_back(engine, smol):
    header, s1, _, _, question = parts(smol.tokenizer, "Can I return it?")
    a, b = len(header), len(header) + len(s1)
    first = header + s1 + question
    block = Inserted(a, b, ((a, b),))
    reply = await engine.generate(first, greedy(8), public_tokens=a, session_key="s", inserted=block).result()
    kept = engine.kv.sessions["s"]
    old = kv_rows(engine, kept, b, b + len(question))
    # the next turn's prompt shows the question and reply without the sources
    second = header + question + reply.token_ids + smol.tokenizer.encode(" Thanks!", add_special_tokens=False)
    result = await engine.generate(second, greedy(4), public_tokens=a, session_key="s").result()
    moved = len(question) + len(reply.token_ids) - 1  # the last generated token was never computed
    assert engine.kv.moved_hits == moved
    assert result.usage.cached_tokens == a + moved
    new = kv_rows(engine, engine.kv.sessions["s"], a, a + len(question))
    assert torch.equal(new[1], old[1])  # values move as they are
    assert torch.allclose(
        new[0].float(), engine.runner.shift_keys(old[0], torch.full((len(question),), -len(s1))).float()
    )


async def test_a_block_must_sit_after_the_public_tokens(engine, smol):
    header, s1, _, _, question = parts(smol.tokenizer, "Hi")
    prompt = header + s1 + question
    with pytest.raises(ValueError, match="inserted block"):
        engine.generate(prompt, greedy(2), public_tokens=len(header), inserted=Inserted(1, 5))
    with pytest.raises(ValueError, match="segment"):
        bad = Inserted(len(header), len(header) + 4, ((len(header), len(header) + 9),))
        engine.generate(prompt, greedy(2), public_tokens=len(header), inserted=bad)


def kv_rows(engine, handle, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    slots = handle.slots[start:end]
    return engine.kv.k[:, slots].clone(), engine.kv.v[:, slots].clone()


@pytest.fixture(scope="module")
def kernel():
    k = quant.load_kernel(Path("~/.cache/rtserver").expanduser())
    if k is None:  # the default dtype depends on it: a machine that cannot build it must say so
        pytest.fail(f"the quantized kernel did not build: {quant.kernel_error()}")
    return k


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "q8_0"])
async def test_the_kernel_moves_rows_as_torch_does(kernel, dtype):
    """Keys rotated per row, values copied as they are, in every layer and every pool type."""
    from rtserver.engine.kv_rows import Q8_0, from_pool, row_width, to_pool

    pool_dtype = Q8_0 if dtype == "q8_0" else getattr(torch, dtype)
    layers, slots, heads, dim, n = 3, 40, 2, 64, 7
    g = torch.Generator().manual_seed(0)
    values = torch.randn(2, layers, slots, heads, dim, generator=g)
    k, v = (to_pool(x, pool_dtype).contiguous() for x in values)
    assert k.shape[-1] == row_width(pool_dtype, dim)
    src, dst = torch.arange(3, 3 + n), torch.arange(20, 20 + n)
    shift = torch.tensor([5, -5, 0, 9, -1, 3, -9])  # each row its own, either way
    angles = torch.rand(2, 10, dim // 2, generator=g) * 6  # two RoPE tables [positions], one for odd layers
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    tables = torch.tensor([0, 1, 0])
    kernel.move_rows(k, v, src, dst, shift, cos, sin, tables)
    for layer in range(layers):
        table = tables[layer]
        c = cos[table, shift.abs()][:, None, :]
        s = (sin[table, shift.abs()] * torch.where(shift < 0, -1.0, 1.0)[:, None])[:, None, :]
        want = to_pool(rope(from_pool(k[layer, src], torch.float32), c, s), pool_dtype)
        got = k[layer, dst]
        assert torch.allclose(
            from_pool(got, torch.float32), from_pool(want, torch.float32), atol=2e-2, rtol=1e-2
        )
        assert torch.equal(v[layer, dst], v[layer, src])
    if dtype != "q8_0":  # no rotation moves 16-bit rows bit for bit
        k2 = k.clone()
        kernel.move_rows(
            k2, v, dst, src, torch.zeros_like(shift), torch.ones_like(cos), torch.zeros_like(sin), tables
        )
        assert torch.equal(k2[:, src], k[:, dst])
