"""What glibc's heap keeps of freed memory: handed back after loading, bounded while serving."""

from __future__ import annotations

import ctypes
import gc

# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MIN_REUSED_BYTES = 32 << 20


def return_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc). Loading frees hundreds of MB (a tokenizer's
    parsed file, dense weights swapped for packed copies) in pieces that glibc would otherwise keep in
    its heap, resident. What only a reference cycle still holds goes first: the collector would free
    it at some later allocation count, after the trim."""
    gc.collect()
    trim()


def trim() -> None:
    """Hand the heaps' free pages back to the OS now (glibc's malloc_trim): a step of many rows frees
    buffers below the reuse limit in pieces, which would otherwise stay resident between its heaps'
    live blocks."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to do


def reused_bytes(max_rows: int, vocab_size: int) -> int:
    """How big a freed buffer the heap keeps for the next step: a full decode step's logits (float32
    [rows, vocab]), the biggest buffer every step allocates again, and never less than _MIN_REUSED_BYTES.
    A prompt's bigger activations are mapped and unmapped with their step: kept, a burst's prefill would
    stay resident for good."""
    return max(_MIN_REUSED_BYTES, max_rows * vocab_size * 4)


def reuse_freed_buffers(limit: int) -> None:
    """From now on keep freed buffers below `limit` bytes in the heap for the next step (glibc), and at
    most `limit` free bytes at each heap's top. Steps allocate the same big tensors again and again (a
    large vocabulary's logits); glibc would map each above 128 KB afresh, and every page of it faults on
    first touch. Called once loading is done, so start-up's temporaries are not kept."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, limit)
        libc.mallopt(_M_TRIM_THRESHOLD, limit)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to do
