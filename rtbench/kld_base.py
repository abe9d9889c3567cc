"""llama-perplexity's `--kl-divergence-base` file: the reference's log-probabilities, written and read.

The layout (tools/perplexity/perplexity.cpp of the pinned sdist): "_logits_", then uint32 n_ctx, int32
n_vocab, int32 n_chunk and the int32 token ids of every window; then, window after window, one row for
each scored position. A row is nv = 2 * ceil(n_vocab / 2) + 4 uint16: a float32 scale and a float32
smallest log-probability, then each logit above max - 16 as round((logit - min) / scale), 0 below.
`encode_rows` writes its arithmetic in float32 as llama-perplexity does, so a file written here is the
file it would write for the same logits; `decode_rows` reads them back as it does.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[Any]
MAGIC = b"_logits_"
RANGE = 16.0  # nats below the largest logit that a row resolves; lower logits read back as its bottom


def row_width(n_vocab: int) -> int:
    """uint16 values in one row: the two float32 header values, the vocabulary, padded to even."""
    return 2 * ((n_vocab + 1) // 2) + 4


def encode_rows(logits: Array) -> Array:
    """Rows of logits ([n, n_vocab]) as the file's uint16 rows ([n, row_width])."""
    x = np.asarray(logits, dtype=np.float32)
    n, vocab = x.shape
    top = x.max(axis=1, keepdims=True)
    bottom = np.maximum(x.min(axis=1, keepdims=True), top - np.float32(RANGE))
    sum_exp = np.exp(x - top).astype(np.float64).sum(axis=1, keepdims=True)  # expf, summed in double
    log_sum_exp = np.log(sum_exp).astype(np.float32)
    min_log_prob = (bottom - top - log_sum_exp).astype(np.float32)
    scale = ((top - bottom) / np.float32(65535)).astype(np.float32)
    out = np.zeros((n, row_width(vocab)), dtype=np.uint16)
    header = np.concatenate([scale, min_log_prob], axis=1).astype(np.float32)
    out[:, :4] = header.view(np.uint16)
    with np.errstate(divide="ignore", invalid="ignore"):
        inverse = np.where(scale > 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
        steps = np.rint((inverse * (x - bottom)).astype(np.float32))  # nearest, ties to even (nearest_int)
    out[:, 4 : 4 + vocab] = np.where(x > bottom, steps, 0).astype(np.uint16)
    return out


def decode_rows(rows: Array, n_vocab: int) -> Array:
    """The file's rows back as float32 log-probabilities ([n, n_vocab]), scale * q + smallest."""
    r = np.asarray(rows, dtype=np.uint16)
    header = np.ascontiguousarray(r[:, :4]).view(np.float32)
    scale, smallest = header[:, :1], header[:, 1:2]
    return (scale * r[:, 4 : 4 + n_vocab].astype(np.float32) + smallest).astype(np.float32)


class BaseWriter:
    """Writes a base file: the header and token ids first, then each window's rows in order."""

    def __init__(self, path: Path, n_ctx: int, n_vocab: int, windows: list[list[int]]):
        if any(len(w) != n_ctx for w in windows):
            raise ValueError(f"every window holds n_ctx = {n_ctx} token ids")
        self.n_vocab = n_vocab
        self._file: BinaryIO = path.open("wb")
        self._file.write(MAGIC)
        np.array([n_ctx], dtype=np.uint32).tofile(self._file)
        np.array([n_vocab, len(windows)], dtype=np.int32).tofile(self._file)
        np.array(windows, dtype=np.int32).reshape(-1).tofile(self._file)

    def write(self, logits: Array) -> Array:
        """One window's scored rows, from their logits; returns the rows written."""
        rows = encode_rows(logits)
        rows.tofile(self._file)
        return rows

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> BaseWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class BaseFile:
    """A base file read back: its header, token ids, and each window's scored rows as log-probabilities."""

    def __init__(self, path: Path):
        data = np.memmap(path, np.uint8, mode="r")  # a real file's rows run to gigabytes
        if data[:8].tobytes() != MAGIC:
            raise ValueError(f"{path} is not a llama-perplexity log-probabilities file")
        self.n_ctx = int(data[8:12].view(np.uint32)[0])
        self.n_vocab, self.n_chunk = (int(v) for v in data[12:20].view(np.int32))
        at = 20 + 4 * self.n_ctx * self.n_chunk
        self.windows = data[20:at].view(np.int32).reshape(self.n_chunk, self.n_ctx).tolist()
        self.scored = self.n_ctx - 1 - self.n_ctx // 2
        width = row_width(self.n_vocab)
        expected = at + self.n_chunk * self.scored * width * 2
        if len(data) != expected:
            raise ValueError(f"{path} holds {len(data)} bytes, its header says {expected}")
        self._rows = data[at:].view(np.uint16).reshape(self.n_chunk, self.scored, width)

    def log_probs(self, window: int) -> Array:
        return decode_rows(self._rows[window], self.n_vocab)
