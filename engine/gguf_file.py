"""A GGUF file's metadata and tensors, read directly: header, key-value fields, tensor table.

Why not `gguf.GGUFReader`: it builds a numpy view for every part of every field, and a tokenizer's
49k tokens and merges made that ~4 s of each engine start (most of it). Here string arrays are
decoded in one pass over the memory-mapped bytes and number arrays are single `frombuffer` views;
tensors are the same memory-mapped arrays GGUFReader gives (quantised ones as bytes per row), and the
`gguf` package still supplies the quantisation types and dequantisation.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
# Field value types of the format (gguf's GGUFValueType).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands (the message says where it broke)."""


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    data: np.ndarray  # memory-mapped: the values, or for quantised types [rows..., bytes per row] uint8
    file: GGUFFile | None = None

    def release(self) -> None:
        """Drops `data`'s pages from this process's resident set (the page cache keeps them, and reading
        it again maps them back). A loader that has copied a tensor out calls this, so
        loading a model never holds the whole file resident beside what it built from it."""
        if self.file is not None:
            self.file.release(self.data)


class GGUFFile:
    def __init__(self, path: str | Path):
        with open(path, "rb") as f:
            if Path(path).stat().st_size < 24:
                raise GGUFFormatError(f"{path}: too short to be a GGUF file")
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse(path)
        except (struct.error, ValueError) as e:
            if isinstance(e, GGUFFormatError):
                raise
            raise GGUFFormatError(f"{path}: truncated or corrupt GGUF file ({e})") from e

    def _parse(self, path: str | Path) -> None:
        buf = self._buf
        if buf[:4] != _MAGIC:
            raise GGUFFormatError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise GGUFFormatError(f"{path}: GGUF version {version} is too old (2 or newer is read)")
        self._pos = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.fields[key] = self._value(kind)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, dims, kind, offset))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        out = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._buf, self._pos)
        start = self._pos + 8
        self._pos = start + n
        return self._buf[start:start + n].decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])[0]
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise GGUFFormatError(f"unknown GGUF field type {kind} at byte {self._pos}")
        item, count = self._unpack("<IQ")
        if item in _NUMPY:
            arr: np.ndarray = np.frombuffer(self._buf, dtype=_NUMPY[item], count=count, offset=self._pos)
            self._pos += arr.nbytes
            return arr.tolist()
        if item == _STRING:
            return [self._string() for _ in range(count)]
        return [self._value(item) for _ in range(count)]

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], kind: int, offset: int) -> GGUFTensor:
        qtype = GGMLQuantizationType(kind)
        shape = tuple(reversed(dims))  # numpy order: outermost first
        n = int(np.prod(dims))
        if qtype in _PLAIN:
            data = np.frombuffer(self._buf, dtype=_PLAIN[qtype], count=n, offset=start + offset).reshape(shape)
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            if shape[-1] % block:
                raise GGUFFormatError(f"tensor {name}: {shape[-1]} is not a multiple of {qtype.name}'s {block}")
            rows = (*shape[:-1], shape[-1] // block * size)
            data = np.frombuffer(self._buf, dtype=np.uint8, count=n // block * size,
                                 offset=start + offset).reshape(rows)
        return GGUFTensor(name, qtype, tuple(int(d) for d in dims), data, self)

    def release(self, data: np.ndarray) -> None:
        """Drops the whole pages of `data` (a view of this file) from the resident set (MADV_DONTNEED on
        a read-only file mapping: the next read faults them back in from the page cache)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        base = np.frombuffer(self._buf, dtype=np.uint8).ctypes.data
        start = data.ctypes.data - base
        a = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # the pages wholly inside the tensor only
        b = (start + data.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if b > a:
            self._buf.madvise(mmap.MADV_DONTNEED, a, b - a)
