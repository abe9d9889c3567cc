"""A GGUF file's metadata and tensor index, read in one pass; each tensor's bytes read when asked for.

gguf-py's GGUFReader builds a numpy view per array element, which takes tens of seconds on a large
vocabulary's token and merge lists. This reader parses the header with `struct`, takes numeric
arrays whole with numpy, and keeps gguf-py's type tables (block sizes, names). Tensors are read into
memory of their own rather than viewed in a mapping: the file's pages then never count beside the
copies the engine keeps.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
MAX_STRING = 1 << 24  # one metadata string; a chat template is a few KB
MAX_ITEMS = 1 << 24  # one metadata array; vocabularies are a few hundred thousand entries
MAX_DIMS = 4

# GGUF value types: (struct code, numpy dtype) for the fixed-size ones
_SCALARS: dict[int, tuple[str, Any]] = {
    0: ("B", np.uint8),
    1: ("b", np.int8),
    2: ("H", np.uint16),
    3: ("h", np.int16),
    4: ("I", np.uint32),
    5: ("i", np.int32),
    6: ("f", np.float32),
    7: ("?", np.bool_),
    10: ("Q", np.uint64),
    11: ("q", np.int64),
    12: ("d", np.float64),
}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a GGUF file this reader can take; the message says where it broke."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # rows first, as numpy holds it (GGUF lists dimensions innermost first)
    offset: int  # from the file's start

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) // block * size


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf = buf
        self.at = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.at + n > len(self.buf):
            raise GGUFError(f"truncated at byte {self.at} (wanted {n} more)")
        out = self.buf[self.at : self.at + n]
        self.at += n
        return out

    def scalar(self, code: str) -> Any:
        return struct.unpack_from("<" + code, self.take(struct.calcsize(code)))[0]

    def string(self) -> str:
        n = self.scalar("Q")
        if n > MAX_STRING:
            raise GGUFError(f"a {n}-byte string at byte {self.at}")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise GGUFError(f"unknown value type {vtype} at byte {self.at}")
        itype, count = self.scalar("I"), self.scalar("Q")
        if count > MAX_ITEMS:
            raise GGUFError(f"an array of {count} items at byte {self.at}")
        if itype in _SCALARS:
            dtype = np.dtype(_SCALARS[itype][1]).newbyteorder("<")
            return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).copy()
        return [self.value(itype) for _ in range(count)]


class GGUFFile:
    """Metadata (`metadata`, keys as in the file) and tensors (`tensors`, by GGUF name) of a .gguf file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if self.path.stat().st_size < 24:  # magic, version and the two counts
            raise GGUFError("not a GGUF file (too short)")
        with self.path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            self.size = len(mapped)
            view = memoryview(mapped)
            try:
                self._parse(_Cursor(view))
            finally:
                view.release()

    def _parse(self, cur: _Cursor) -> None:
        if bytes(cur.take(4)) != MAGIC:
            raise GGUFError("not a GGUF file (no GGUF magic)")
        self.version = cur.scalar("I")
        if self.version not in (2, 3):
            raise GGUFError(f"GGUF version {self.version} (2 and 3 are read)")
        n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
        if n_tensors > MAX_ITEMS or n_kv > MAX_ITEMS:
            raise GGUFError(f"{n_tensors} tensors, {n_kv} metadata keys")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("I"))
        infos = [self._tensor_info(cur) for _ in range(n_tensors)]
        align = int(self.metadata.get("general.alignment", 32))
        start = (cur.at + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, qtype, shape, offset in infos:
            info = TensorInfo(name, qtype, shape, start + offset)
            if info.offset + info.nbytes > self.size:
                raise GGUFError(f"tensor {name} runs past the end of the file")
            self.tensors[name] = info

    @staticmethod
    def _tensor_info(cur: _Cursor) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int]:
        name = cur.string()
        n_dims = cur.scalar("I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"tensor {name}: {n_dims} dimensions")
        dims = [cur.scalar("Q") for _ in range(n_dims)]
        raw_type = cur.scalar("I")
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFError(f"tensor {name}: unknown tensor type {raw_type}") from None
        block = GGML_QUANT_SIZES[qtype][0]
        if dims[0] % block:
            raise GGUFError(f"tensor {name}: rows of {dims[0]} are not whole {qtype.name} blocks")
        return name, qtype, tuple(reversed(dims)), cur.scalar("Q")

    def field(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """A tensor's bytes, read from the file: uint8 [rows, bytes a row] for block types, the element
        type ([rows, cols] or [cols]) for float and integer tensors."""
        info = self.tensors[name]
        block, size = GGML_QUANT_SIZES[info.qtype]
        data = np.fromfile(self.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        if data.size != info.nbytes:
            raise GGUFError(f"tensor {name} was cut short (the file changed while read)")
        if block > 1:
            return data.reshape(*info.shape[:-1], info.shape[-1] // block * size)
        dtype = {
            GGMLQuantizationType.F32: np.float32,
            GGMLQuantizationType.F16: np.float16,
            GGMLQuantizationType.F64: np.float64,
            GGMLQuantizationType.I8: np.int8,
            GGMLQuantizationType.I16: np.int16,
            GGMLQuantizationType.I32: np.int32,
            GGMLQuantizationType.I64: np.int64,
        }.get(info.qtype)
        if dtype is None:  # BF16: 2 bytes an element, kept as raw uint16
            return data.view(np.uint16).reshape(info.shape)
        return data.view(dtype).reshape(info.shape)
