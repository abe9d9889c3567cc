"""KV cache manager: budget, reference counts, session reuse, prefix sharing, eviction."""

from __future__ import annotations

import random

import pytest
import torch

from rtserver.engine.kv import (
    PREFAULT_AHEAD,
    PREFAULT_AHEAD_BYTES,
    PREFAULT_BATCH,
    KVCacheManager,
    OutOfKVMemory,
)


def make(blocks=8, bs=4) -> KVCacheManager:
    return KVCacheManager(1, 1, 2, torch.float32, budget_bytes=(blocks + 1) * bs * 2 * 2 * 4, block_tokens=bs)


def computed(kv, handle, tokens, public=None):
    """The handle's tokens are computed; the first `public` of them (default all) may be shared."""
    handle.token_ids = list(tokens)
    kv.register_prefix(handle, len(handle.token_ids) if public is None else public)


def test_budget_sets_block_count_and_zero_block_is_never_handed_out():
    kv = make(blocks=8)
    assert kv.total_blocks == 8
    h, _ = kv.acquire(list(range(30)), 32)
    assert 0 not in h.blocks and len(h.blocks) == 8
    with pytest.raises(OutOfKVMemory):
        kv.acquire([1, 2], 4)
    kv.release(h)
    assert kv.free_blocks == 8


def test_session_reuse_keeps_common_prefix_and_copies_a_shared_partial_block():
    kv = make()
    prompt = list(range(10))
    h, reused = kv.acquire(prompt, 12, session_key="s")
    assert reused == 0
    computed(kv, h, prompt + [50])  # 11 tokens: block 2 holds 8, 9, 50 and is offered to the prefix cache
    first = list(h.blocks)
    kv.k[:, first[2] * 4 : first[2] * 4 + 3] = 7.0  # stands for the KV computed there
    kv.release(h, "s")
    partial = first[2]
    assert kv._refs[partial] == 2  # the session's and the prefix cache's: shared, part full
    h2, reused = kv.acquire(prompt + [50, 51, 52], 16, session_key="s")
    assert reused == 11 and kv.session_hits == 1
    # the full blocks are kept; the shared partial block is copied before the session writes into it
    assert h2.blocks[:2] == first[:2] and h2.blocks[2] != partial
    assert kv._refs[h2.blocks[2]] == 1 and kv._refs[partial] == 1  # the cache still holds the original
    assert (kv.k[:, h2.blocks[2] * 4 : h2.blocks[2] * 4 + 3] == 7.0).all()


def test_prefix_cache_shares_full_blocks_between_unrelated_sequences():
    kv = make()
    a, _ = kv.acquire(list(range(10)), 10)
    computed(kv, a, range(10), 8)  # its two full blocks are public
    b, reused = kv.acquire(list(range(9)) + [99, 98], 12, public_tokens=11)
    assert reused == 8 and b.blocks[:2] == a.blocks[:2]
    kv.release(a)
    kv.release(b)
    assert kv.used_blocks == len(kv.prefix_blocks) == 2
    kv.clear_prefix_cache()
    assert kv.used_blocks == 0


def test_idle_sessions_are_evicted_lru_and_counted():
    kv = make(blocks=6)
    for key in ("old", "new"):
        h, _ = kv.acquire(list(range(8)) if key == "old" else list(range(100, 108)), 8, session_key=key)
        computed(kv, h, h.token_ids or (range(8) if key == "old" else range(100, 108)))
        kv.release(h, key)
    kv.clear_prefix_cache()
    h, _ = kv.acquire(list(range(200, 212)), 16)  # needs 4 of 6 blocks: "old" must go
    assert "old" not in kv.sessions and "new" in kv.sessions and kv.evictions == 1
    kv.release(h)
    again, reused = kv.acquire(list(range(8)) + [1], 12, session_key="old")
    assert reused == 0 and kv.rebuilds == 1


def test_the_evicted_sessions_kept_for_counting_are_bounded():
    """A stream of one-turn sessions evicted one after another (a hub's customers, or API callers'
    session ids): the keys remembered for the rebuild count stay within the pool's block count."""
    kv = make(blocks=6)
    for n in range(40):
        ids = list(range(1000 * n, 1000 * n + 8))
        h, _ = kv.acquire(ids, 8, session_key=n)
        computed(kv, h, ids)
        kv.release(h, n)
        kv.clear_prefix_cache()
    assert kv.evictions > 20 and len(kv.evicted_sessions) <= kv.total_blocks
    assert 0 not in kv.evicted_sessions and 36 in kv.evicted_sessions  # the oldest forgotten first


def test_random_workload_never_leaks_blocks():
    rng = random.Random(0)
    kv = make(blocks=32)
    live = []
    for _ in range(300):
        if live and rng.random() < 0.5:
            h, key = live.pop(rng.randrange(len(live)))
            kv.release(h, key)
        else:
            prompt = [rng.randrange(4) for _ in range(rng.randint(1, 20))]
            key = rng.choice([None, "a", "b", "c"])
            if any(k == key for _, k in live if key is not None):
                continue
            try:
                public = rng.randint(0, len(prompt))
                h, reused = kv.acquire(
                    prompt, len(prompt) + rng.randint(0, 8), session_key=key, public_tokens=public
                )
            except OutOfKVMemory:
                continue
            computed(kv, h, prompt, public)
            live.append((h, key))
        assert kv.used_blocks <= kv.total_blocks
        assert sum(kv._refs) >= kv.used_blocks
    for h, key in live:
        kv.release(h, key)
    for key in "abc":
        kv.drop_session(key)
    kv.clear_prefix_cache()
    assert kv.used_blocks == 0 and kv.free_blocks == kv.total_blocks and sum(kv._refs) == 0


# -- what is shared across sessions: only the public prefix ---------------------------------------


def test_only_the_public_prefix_is_matched_and_offered():
    kv = make(blocks=16)
    header = [7, 7, 7, 7, 7, 7]  # the server's text: a block and a half
    secret = header + [4, 9, 2, 9, 1, 2, 3, 4]
    a, _ = kv.acquire(secret, len(secret) + 1, session_key="A", public_tokens=len(header))
    computed(kv, a, secret, len(header))
    kv.release(a, "A")
    # a fresh session guessing A's digits reuses the header only, whether its guess is right or wrong
    for guess in ([4, 9, 2], [4, 8, 2], [5]):
        b, reused = kv.acquire(header + guess, 12, public_tokens=len(header))
        assert reused == len(header)
        kv.release(b)
    # a prompt that shares nothing public reuses nothing, even where its text is the same as A's
    b, reused = kv.acquire(secret, len(secret) + 1)
    assert reused == 0
    kv.release(b)
    # A's own next turn still reuses all of its own KV
    a2, reused = kv.acquire(secret + [5, 6], len(secret) + 3, session_key="A", public_tokens=len(header))
    assert reused == len(secret)
    kv.release(a2)
    kv.drop_session("A")
    kv.clear_prefix_cache()
    assert kv.used_blocks == 0 and sum(kv._refs) == 0


def test_a_public_prefix_ending_mid_block_is_shared_up_to_its_end_only():
    kv = make(blocks=16)
    prefix = [1, 2, 3, 4, 5, 6]  # a task's fixed instruction, ending in the second block
    a, _ = kv.acquire(prefix + [8, 8, 8], 12, public_tokens=len(prefix))
    computed(kv, a, prefix + [8, 8, 8], len(prefix))
    first = list(a.blocks)
    kv.release(a)
    # the next call's text starts like the last one's: still only the prefix is reused
    b, reused = kv.acquire(prefix + [8, 8, 9], 12, public_tokens=len(prefix))
    assert reused == len(prefix) and b.blocks[0] == first[0]
    assert b.blocks[1] != first[1]  # its own copy of the block the prefix ends in: it writes there
    kv.release(b)
    kv.clear_prefix_cache()
    assert kv.used_blocks == 0 and sum(kv._refs) == 0


def test_a_scope_shares_a_whole_prompt_within_itself_only():
    """One call's samples (a scope) share their whole prompt, customer text included; the shared
    cache, and another scope, see none of it."""
    kv = make(blocks=16)
    prompt = list(range(100, 110))  # 10 tokens, none of them public
    lead, reused = kv.acquire(prompt, 12, public_tokens=len(prompt), root=77)
    assert reused == 0
    lead.token_ids = list(prompt)  # computed
    kv.register_prefix(lead, len(prompt), root=77)
    follower, reused = kv.acquire(prompt, 12, public_tokens=len(prompt), root=77)
    assert reused == 9  # all but the last token, whose logits are needed
    assert follower.blocks[:2] == lead.blocks[:2]
    for stranger_root in (0, 78):
        other, reused = kv.acquire(prompt, 12, public_tokens=len(prompt), root=stranger_root)
        assert reused == 0 and not set(other.blocks) & set(lead.blocks)
        kv.release(other)


def test_prefault_touches_blocks_ahead_within_its_bytes_and_not_past_them():
    """Idle prefaulting writes the next never-used blocks, one layer's rows a call, and stops at
    PREFAULT_AHEAD_BYTES ahead of use: RSS follows the KV in use."""
    bs, layers = 16, 2
    block_bytes = layers * 2 * 16 * 128 * 4 * bs  # 16 heads of 128 float32: 512 KB a block
    kv = KVCacheManager(layers, 16, 128, torch.float32, budget_bytes=128 * block_bytes, block_tokens=bs)
    assert kv.block_bytes == block_bytes
    assert kv.prefault_ahead == PREFAULT_AHEAD_BYTES // block_bytes < PREFAULT_AHEAD  # the bytes bind
    kv.k.fill_(float("nan")), kv.v.fill_(float("nan"))
    calls = 0
    while kv.prefault():
        calls += 1
    ahead = kv.prefault_ahead
    assert calls == 2 * layers * -(-ahead // PREFAULT_BATCH)  # K then V, layer by layer, in batches
    touched = slice(bs, (ahead + 1) * bs)
    assert not kv.k[:, touched].isnan().any() and not kv.v[:, touched].isnan().any()
    assert kv.k[:, (ahead + 1) * bs :].isnan().all()  # nothing past the bound
    handle, _ = kv.acquire(list(range(40)), 48)  # blocks 1-3 handed out: the bound moves on by them
    assert kv.prefault()
    kv.release(handle)
