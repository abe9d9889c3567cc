"""KV cache manager: where every sequence's keys and values live, inside one fixed memory budget.

One preallocated pool is cut into blocks. A `KVHandle` is a list of blocks and the tokens they hold. Blocks
are reused, reference counted, for a session's next turn. They are also reused for prompts that share a
public prefix (`public_tokens`: text the server wrote). A customer's text is never offered to other
sessions. So what is cached says nothing about another session. A prompt about one conversation (an agent's
assist call) may start from that session's own KV. That KV may be idle or running (`fork`). Shared blocks
are never written. Idle entries are evicted LRU. The pool never grows.

KV may also move: a segment's own KV is copied into the prompts that hold it (`splice`), and a session's
next turn that leaves out an inserted block keeps the KV after it, moved back (`_from_session`). Keys are
rotated as they move (`KeyMover`, the runner).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .kv_rows import row_width


@dataclass
class KVHandle:
    """The blocks of one sequence (or cached session/prefix). Also which tokens they hold."""

    blocks: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    slot_table: torch.Tensor | None = None  # slot of each position, length = len(blocks) * block_tokens
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache keys of its leading full blocks
    owner: Hashable | None = None  # the session whose running sequence holds it (see `fork`)
    # Blocks of text held for one turn only (a knowledge turn's sources): the next turn may leave one out
    # and keep the KV after it, moved back (`_from_session`).
    inserted: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def slots(self) -> torch.Tensor:
        """The slot table of a handle that holds room (acquired). The runner reads and writes these."""
        assert self.slot_table is not None, "a KV handle without room"
        return self.slot_table


@dataclass
class KVStats:
    budget_bytes: int
    used_bytes: int
    block_bytes: int
    free_blocks: int
    total_blocks: int
    cached_sessions: int
    cached_prefix_blocks: int
    evictions: int
    rebuilds: int
    prefix_hits: int  # prompt tokens served from the prefix cache
    session_hits: int
    fork_hits: int  # prompt tokens served from another sequence's KV of the same conversation
    moved_hits: int = 0  # prompt tokens served from a session's KV moved back past a left-out block
    spliced_hits: int = 0  # prompt tokens served from segments' own KV


@dataclass(frozen=True)
class SegmentKey:
    """Where a segment's own KV is kept: a prompt's public prefix and the segment's ids, hashed."""

    digest: int


PREFAULT_AHEAD = 64  # blocks touched ahead of use while idle (see `prefault`) ...
PREFAULT_AHEAD_BYTES = 16 << 20  # ... and at most this many bytes of them
PREFAULT_BATCH = 8  # blocks a round of `prefault` calls touches


class KeyMover(Protocol):
    """Moves KV to other positions: RoPE composes, so a key moved d positions on is rotated by d's angles."""

    def shift_keys(self, k: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """K rows [layers, n, kv heads, row] of the pool, each rotated by its own `shift` [n]."""
        ...

    def move_rows(
        self, k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, shift: torch.Tensor
    ) -> None:
        """Rows of pools k and v copied from slots `src` to `dst` (not overlapping), keys rotated."""
        ...


class OutOfKVMemory(Exception):
    """Not enough free blocks even after evicting every idle cache entry."""


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KVCacheManager:
    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        budget_bytes: int,
        block_tokens: int = 16,
    ):
        self.block_tokens = block_tokens
        width = row_width(dtype, head_dim)  # a row's elements: head_dim, or its q8_0 bytes
        elem = torch.tensor([], dtype=dtype).element_size()
        self.bytes_per_token = num_layers * 2 * kv_heads * width * elem
        self.block_bytes = self.bytes_per_token * block_tokens
        self.total_blocks = max(1, budget_bytes // self.block_bytes - 1)  # - the zero block below
        # Block 0 is never handed out: it stays zero, and padded attention lanes read it (they must see
        # finite numbers: 0 * NaN = NaN). The rest is left uninitialised so untouched blocks cost no RSS;
        # every position a sequence reads was written first.
        slots = (self.total_blocks + 1) * block_tokens
        self.k = torch.empty(num_layers, slots, kv_heads, width, dtype=dtype)
        self.v = torch.empty(num_layers, slots, kv_heads, width, dtype=dtype)
        self.k[:, :block_tokens] = 0
        self.v[:, :block_tokens] = 0
        self._offsets = torch.arange(block_tokens, dtype=torch.long)
        self.prefault_ahead = max(1, min(PREFAULT_AHEAD, PREFAULT_AHEAD_BYTES // self.block_bytes))
        self._free: list[int] = list(range(self.total_blocks, 0, -1))
        self._handed = 0  # the highest block ever handed out
        self._touched = 0  # blocks 1.. up to this one have been written (`prefault`)
        self._layer = 0  # the next layer's rows `prefault` touches (K, then V)
        self._refs = [0] * (self.total_blocks + 1)
        self.sessions: OrderedDict[Hashable, KVHandle] = OrderedDict()
        self.live: dict[Hashable, KVHandle] = {}  # running sessions' handles, by session key
        # prefix cache: chain hash -> (parent hash, block tokens, block); LRU order
        self.prefix_blocks: OrderedDict[int, tuple[int, tuple[int, ...], int]] = OrderedDict()
        # (parent hash, first token) -> the cached blocks that continue that parent with that token, so a
        # prompt that leaves a cached block part-way (a task's fixed prefix followed by new text) can reuse
        # the part it shares
        self._children: dict[tuple[int, int], dict[int, None]] = {}
        # sessions whose KV was evicted (their next turn counts as a rebuild), newest last, bounded
        self.evicted_sessions: OrderedDict[Hashable, None] = OrderedDict()
        self.evictions = 0
        self.rebuilds = 0
        self.prefix_hits = 0
        self.session_hits = 0
        self.fork_hits = 0
        self.moved_hits = 0  # prompt tokens served from a session's KV moved back past a left-out block
        self.spliced_hits = 0  # prompt tokens served from segments' own KV
        self.mover: KeyMover | None = None  # the runner; without it nothing is moved
        self.lock = threading.RLock()

    # -- blocks ---------------------------------------------------------------------------------
    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_tokens)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - len(self._free)

    def _take(self, n: int) -> list[int]:
        if n > len(self._free):
            self._evict_until(n)
        taken = [self._free.pop() for _ in range(n)]
        for b in taken:
            self._refs[b] = 1
        self._handed = max(self._handed, *taken)
        return taken

    def prefault(self) -> bool:
        """Touch the next never-used blocks, one layer's K or V rows a call, while the engine is idle. Blocks
        are handed out lowest first, so those are the next to be written. Their pages fault now, not in a
        step. At most `prefault_ahead` blocks are touched ahead of use. False: nothing to do.
        """
        with self.lock:
            if self._handed > self._touched:  # blocks were handed out: start past them, never on them
                self._touched, self._layer = self._handed, 0
            used = self.total_blocks - len(self._free)
            if self._touched >= min(self.total_blocks, used + self.prefault_ahead):
                return False
            start = self._touched + 1
            stop = min(self.total_blocks, start + PREFAULT_BATCH - 1)
            layers = self.k.shape[0]
            pool = self.k if self._layer < layers else self.v
            pool[self._layer % layers, start * self.block_tokens : (stop + 1) * self.block_tokens] = 0
            self._layer += 1
            if self._layer == 2 * layers:
                self._touched, self._layer = stop, 0
            return True

    def _drop_blocks(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def _evict_until(self, needed: int) -> None:
        """Free blocks by dropping idle cache entries. Prefix blocks nobody uses go first, then idle
        sessions.
        """
        while len(self._free) < needed:
            victim = next((h for h, (_, _, b) in self.prefix_blocks.items() if self._refs[b] == 1), None)
            if victim is not None:
                self._forget_prefix(victim)
            elif self.sessions:
                key, handle = self.sessions.popitem(last=False)
                if not isinstance(key, SegmentKey):  # a segment is no session: its loss is no rebuild
                    self.evicted_sessions[key] = None
                if len(self.evicted_sessions) > self.total_blocks:
                    self.evicted_sessions.popitem(last=False)
                self._drop_blocks(handle.blocks)
            else:
                raise OutOfKVMemory(f"needs {needed} blocks, {len(self._free)} free, nothing idle to evict")
            self.evictions += 1

    def reclaimable_blocks(self) -> int:
        """Free blocks plus what evicting every idle entry could free. It is an upper bound."""
        idle = sum(len(h.blocks) for h in self.sessions.values())
        idle += sum(1 for _, _, b in self.prefix_blocks.values() if self._refs[b] == 1)
        return len(self._free) + idle

    def _set_slots(self, handle: KVHandle) -> None:
        blocks = torch.tensor(handle.blocks, dtype=torch.long)
        handle.slot_table = (blocks[:, None] * self.block_tokens + self._offsets).reshape(-1)

    def _grow(self, handle: KVHandle, capacity_tokens: int) -> None:
        extra = self.blocks_for(capacity_tokens) - len(handle.blocks)
        if extra > 0:
            handle.blocks += self._take(extra)
        self._set_slots(handle)

    def _copy_block(self, src: int, dst: int) -> None:
        s = slice(src * self.block_tokens, (src + 1) * self.block_tokens)
        d = slice(dst * self.block_tokens, (dst + 1) * self.block_tokens)
        self.k[:, d] = self.k[:, s]
        self.v[:, d] = self.v[:, s]

    def _own_last_block(self, handle: KVHandle) -> None:
        """Give the handle its own copy of a partly filled shared last block. Done before writing into it."""
        if handle.num_tokens % self.block_tokens and self._refs[handle.blocks[-1]] > 1:
            (own,) = self._take(1)
            self._copy_block(handle.blocks[-1], own)
            self._drop_blocks([handle.blocks[-1]])
            handle.blocks[-1] = own

    # -- prefix cache ---------------------------------------------------------------------------
    def _chain(self, parent: int, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))

    def _forget_prefix(self, key: int) -> None:
        parent, tokens, block = self.prefix_blocks.pop(key)
        siblings = self._children.get((parent, tokens[0]))
        if siblings is not None:
            siblings.pop(key, None)
            if not siblings:
                del self._children[(parent, tokens[0])]
        self._drop_blocks([block])

    def _match_prefix(self, prompt_ids: list[int], limit: int, root: int = 0) -> KVHandle:
        """A handle sharing the longest run of cached KV that starts the prompt. It takes at most `limit`
        tokens. First come whole cached blocks. Then comes the leading part of a cached block the prompt
        leaves part-way. Its tokens up to there have the same KV whatever follows them. The handle gets its
        own copy of that block before writing. `root` starts the chain. It is 0 for the cache all sessions
        share, another value for a namespace of its own.
        """
        handle = KVHandle()
        parent = root
        bs = self.block_tokens
        for k in range(limit // bs):
            tokens = tuple(prompt_ids[k * bs : (k + 1) * bs])
            key = self._chain(parent, tokens)
            entry = self.prefix_blocks.get(key)
            if entry is None or entry[0] != parent or entry[1] != tokens:
                break
            self.prefix_blocks.move_to_end(key)
            self._refs[entry[2]] += 1
            handle.blocks.append(entry[2])
            handle.block_hashes.append(key)
            handle.token_ids.extend(tokens)
            parent = key
        start = len(handle.token_ids)
        want = prompt_ids[start : min(start + bs, limit)]
        siblings = self._children.get((parent, want[0])) if want else None
        if siblings:
            best, best_n = next(iter(siblings)), 0  # every sibling shares at least want[0]
            for key in siblings:
                n = _common_prefix(self.prefix_blocks[key][1], want)
                if n > best_n:
                    best, best_n = key, n
                    if n == len(want):
                        break
            self.prefix_blocks.move_to_end(best)
            block = self.prefix_blocks[best][2]
            self._refs[block] += 1
            handle.blocks.append(block)
            handle.token_ids.extend(want[:best_n])
        return handle

    def register_prefix(self, handle: KVHandle, public_tokens: int = 0, root: int = 0) -> None:
        """Offer the computed blocks of a sequence's public prefix to the prefix cache. The prefix is its
        first `public_tokens` tokens. The block that prefix ends in is offered under its public tokens only.
        A later prompt may reuse those, but never compare against the private rest.
        """
        with self.lock:
            bs = self.block_tokens
            public = min(public_tokens, handle.num_tokens)
            full = public // bs
            parent = handle.block_hashes[-1] if handle.block_hashes else root
            for k in range(len(handle.block_hashes), full):
                parent = self._offer(parent, tuple(handle.token_ids[k * bs : (k + 1) * bs]), handle.blocks[k])
                handle.block_hashes.append(parent)
            if public % bs and len(handle.block_hashes) == full:
                # computed up to its end: a leaf of the chain (no full block continues it)
                self._offer(parent, tuple(handle.token_ids[full * bs : public]), handle.blocks[full])

    def _offer(self, parent: int, tokens: tuple[int, ...], block: int) -> int:
        """Cache `block` as holding `tokens` after the chain `parent`, unless one is already. Returns its
        key.
        """
        key = self._chain(parent, tokens)
        if key not in self.prefix_blocks:
            self.prefix_blocks[key] = (parent, tokens, block)
            self._children.setdefault((parent, tokens[0]), {})[key] = None
            self._refs[block] += 1
        return key

    # -- sequences ------------------------------------------------------------------------------
    def _fork(self, key: Hashable, prompt_ids: list[int]) -> KVHandle | None:
        """A handle sharing what session `key`'s KV holds of the prompt's start. That KV may be running or
        idle, and the session keeps all of it. The computed blocks it shares are never written again. The
        session writes past them. The handle copies a partial last block before writing (`acquire`).
        """
        source = self.live.get(key) or self.sessions.get(key)
        if source is None:
            return None
        if key in self.sessions:
            self.sessions.move_to_end(key)  # in use: the last idle session to evict
        reused = min(_common_prefix(source.token_ids, prompt_ids), len(prompt_ids) - 1)
        blocks = source.blocks[: self.blocks_for(reused)]
        for b in blocks:
            self._refs[b] += 1
        return KVHandle(blocks=list(blocks), token_ids=prompt_ids[:reused])

    def acquire(
        self,
        prompt_ids: list[int],
        capacity_tokens: int,
        session_key: Hashable | None = None,
        max_reuse: int | None = None,
        public_tokens: int = 0,
        evict: bool = True,
        root: int = 0,
        fork: Hashable | None = None,
    ) -> tuple[KVHandle, int]:
        """A handle with room for capacity_tokens, reusing cached KV. Returns (handle, reused tokens). The
        session's own KV is matched against the whole prompt. The prefix cache is matched only against its
        first `public_tokens` tokens. `max_reuse` caps the prefix-cache reuse too. Positions from there on
        are computed, e.g. to pool their hidden states.

        Raises OutOfKVMemory when the pool cannot hold it; a session's cache stays in place. Without `evict`
        it also raises when it cannot fit without evicting what other sessions keep. `root`: the prefix
        cache's namespace (see `_match_prefix`). `fork`: a session whose KV the prompt may start from.
        Without a `session_key` the handle is the sequence's own, freed at its end. At least one prompt
        token is always left to compute, since its logits are needed.
        """
        with self.lock:
            need = self.blocks_for(capacity_tokens)
            if need > self.total_blocks:
                raise OutOfKVMemory(
                    f"{capacity_tokens} tokens exceed the whole KV budget "
                    f"({self.total_blocks * self.block_tokens} tokens)"
                )
            handle: KVHandle | None = None
            if session_key is not None:
                handle = self._from_session(session_key, prompt_ids)
            elif fork is not None:
                handle = self._from_fork(fork, prompt_ids)
            from_session = handle is not None and session_key is not None
            if handle is None or handle.num_tokens < self.block_tokens:
                if handle is not None:  # less than a block: the prefix cache may hold more
                    self._drop_blocks(handle.blocks)
                    from_session = False
                handle = self._from_prefix(prompt_ids, public_tokens, max_reuse, root)
            self._fit(handle, capacity_tokens, evict, session_key if from_session else None)
            if session_key is not None:
                handle.owner = session_key
                self.live[session_key] = handle
            return handle, handle.num_tokens

    def _from_session(self, key: Hashable, prompt_ids: list[int]) -> KVHandle | None:
        """The session's kept KV, cut to what it shares with the prompt. The session gives it up."""
        cached = self.sessions.pop(key, None)
        if cached is None:
            if key in self.evicted_sessions:
                del self.evicted_sessions[key]
                self.rebuilds += 1
            return None
        reused = min(_common_prefix(cached.token_ids, prompt_ids), len(prompt_ids) - 1)
        if self.mover is not None:  # a prompt that leaves a block part-way leaves all of it
            reused = next((s for s, e in cached.inserted if s < reused < e), reused)
        runs = self._runs_after_inserted(cached, prompt_ids, reused)
        src = torch.cat([cached.slots[j : j + n] for j, _, n in runs]) if runs else None
        keep = self.blocks_for(reused)
        tail = cached.blocks[keep:]  # freed once what moves is copied out of it
        cached.blocks = cached.blocks[:keep]
        cached.token_ids = cached.token_ids[:reused]
        cached.block_hashes = cached.block_hashes[: reused // self.block_tokens]
        cached.inserted = [r for r in cached.inserted if r[1] <= reused]
        self.session_hits += 1
        if src is not None:
            self._move_in(cached, prompt_ids, runs, src)
        self._drop_blocks(tail)
        return cached

    def _runs_after_inserted(
        self, cached: KVHandle, prompt_ids: list[int], at: int
    ) -> list[tuple[int, int, int]]:
        """Runs (cached position, prompt position, length) the prompt continues with once it leaves out the
        cached KV's inserted blocks that start at `at`. Like llama.cpp's context shift, the KV after a left
        out block is moved back, its keys rotated. Only inserted blocks are left out: elsewhere a different
        token is a different prompt.
        """
        if self.mover is None or not cached.inserted or cached.slot_table is None:
            return []
        starts = dict(cached.inserted)
        runs: list[tuple[int, int, int]] = []
        i = j = at
        limit = len(prompt_ids) - 1  # at least one token is left to compute
        while j in starts and i < limit:
            j = starts[j]
            n = _common_prefix(cached.token_ids[j:], prompt_ids[i:limit])
            if n == 0:
                break
            runs.append((j, i, n))
            i, j = i + n, j + n
        return runs

    def _move_in(
        self, handle: KVHandle, prompt_ids: list[int], runs: list[tuple[int, int, int]], src: torch.Tensor
    ) -> None:
        """Copy the runs' rows (at slots `src`, in blocks not yet freed) after the handle's tokens. Without
        room for them the handle stays as it is.
        """
        assert self.mover is not None
        end = runs[-1][1] + runs[-1][2]
        try:
            self._own_last_block(handle)
            self._grow(handle, end)
        except OutOfKVMemory:
            return
        dst = torch.cat([handle.slots[i : i + n] for _, i, n in runs])
        shift = torch.cat([torch.full((n,), i - j) for j, i, n in runs])
        if set(src.tolist()) & set(dst.tolist()):  # a short block: the last kept block holds both
            k, v = self.mover.shift_keys(self.k[:, src], shift), self.v[:, src].clone()
            self.k[:, dst], self.v[:, dst] = k, v
        else:
            self.mover.move_rows(self.k, self.v, src, dst, shift)
        handle.token_ids = prompt_ids[:end]
        self.moved_hits += end - runs[0][1]

    def holds(self, key: SegmentKey) -> bool:
        """Whether a segment's own KV is cached."""
        with self.lock:
            return key in self.sessions

    def segment_slots(self, key: SegmentKey, context: list[int], ids: list[int]) -> torch.Tensor | None:
        """The slots of a segment's own KV: the entry `key` holds `context`, then `ids`. None when that
        entry is gone (evicted): the caller computes the ids instead.
        """
        with self.lock:
            entry = self.sessions.get(key)
            n = len(context)
            if entry is None or self.mover is None or entry.token_ids[: n + len(ids)] != context + ids:
                return None
            self.sessions.move_to_end(key)
            return entry.slots[n : n + len(ids)]

    def splice(self, handle: KVHandle, pieces: list[tuple[int, int, torch.Tensor]]) -> None:
        """Copy segments' KV into `handle`: (position there, position in the entry, the entry's slots) each,
        found by `segment_slots` in the same step. One gather, rotation and write for all of them.
        """
        with self.lock:
            src = torch.cat([slots for _, _, slots in pieces])
            dst = torch.cat([handle.slots[at : at + len(slots)] for at, _, slots in pieces])
            shift = torch.cat([torch.full((len(slots),), at - was) for at, was, slots in pieces])
            assert self.mover is not None  # segment_slots found them
            self.mover.move_rows(self.k, self.v, src, dst, shift)
            self.spliced_hits += len(src)

    def _from_fork(self, key: Hashable, prompt_ids: list[int]) -> KVHandle | None:
        """What session `key`'s KV holds of the prompt's start, shared (see `_fork`)."""
        handle = self._fork(key, prompt_ids)
        if handle is not None and handle.num_tokens >= self.block_tokens:
            self.fork_hits += handle.num_tokens
        return handle

    def _from_prefix(
        self, prompt_ids: list[int], public_tokens: int, max_reuse: int | None, root: int
    ) -> KVHandle:
        """The prefix cache's longest match within the public tokens (and `max_reuse`)."""
        limit = min(len(prompt_ids) - 1, public_tokens)  # leave at least one token to compute
        handle = self._match_prefix(prompt_ids, limit if max_reuse is None else min(limit, max_reuse), root)
        self.prefix_hits += handle.num_tokens
        return handle

    def _fit(self, handle: KVHandle, capacity_tokens: int, evict: bool, session_key: Hashable | None) -> None:
        """Grow `handle` to `capacity_tokens`, or give back what it holds and raise OutOfKVMemory.

        A handle from `session_key`'s kept KV goes back to the session, still valid, while it waits.
        """
        room = self.reclaimable_blocks() if evict else len(self._free)
        if self.blocks_for(capacity_tokens) - len(handle.blocks) > room:
            if session_key is not None:
                self.sessions[session_key] = handle
            else:
                self._drop_blocks(handle.blocks)
            raise OutOfKVMemory("KV budget full")
        try:
            self._own_last_block(handle)
            self._grow(handle, capacity_tokens)
        except OutOfKVMemory:
            self._drop_blocks(handle.blocks)
            raise

    def release(self, handle: KVHandle, session_key: Hashable | None = None) -> None:
        """A sequence ended. Keep its KV for the session's next turn, or free it."""
        with self.lock:
            if handle.owner is not None and self.live.get(handle.owner) is handle:
                del self.live[handle.owner]
            handle.owner = None
            if session_key is None:
                self._drop_blocks(handle.blocks)
                handle.blocks = []
                return
            keep = self.blocks_for(handle.num_tokens)
            self._drop_blocks(handle.blocks[keep:])
            handle.blocks = handle.blocks[:keep]
            handle.inserted = [r for r in handle.inserted if r[1] <= handle.num_tokens]
            old = self.sessions.pop(session_key, None)
            if old is not None:
                self._drop_blocks(old.blocks)
            if handle.blocks:
                self.sessions[session_key] = handle

    def drop_session(self, session_key: Hashable) -> None:
        with self.lock:
            handle = self.sessions.pop(session_key, None)
            self.evicted_sessions.pop(session_key, None)
            if handle is not None:
                self._drop_blocks(handle.blocks)

    def clear_prefix_cache(self) -> None:
        with self.lock:
            for _, _, block in self.prefix_blocks.values():
                self._drop_blocks([block])
            self.prefix_blocks.clear()
            self._children.clear()

    def stats(self) -> KVStats:
        with self.lock:
            return KVStats(
                budget_bytes=self.total_blocks * self.block_bytes,
                used_bytes=self.used_blocks * self.block_bytes,
                block_bytes=self.block_bytes,
                free_blocks=self.free_blocks,
                total_blocks=self.total_blocks,
                cached_sessions=len(self.sessions),
                cached_prefix_blocks=len(self.prefix_blocks),
                evictions=self.evictions,
                rebuilds=self.rebuilds,
                prefix_hits=self.prefix_hits,
                session_hits=self.session_hits,
                fork_hits=self.fork_hits,
                moved_hits=self.moved_hits,
                spliced_hits=self.spliced_hits,
            )
