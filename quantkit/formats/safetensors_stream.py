"""safetensors files written one tensor, or one block of rows, at a time: the bytes safetensors' `save_file` writes
for the same tensors, without holding them all in memory (save_file takes every tensor at once, so a checkpoint
larger than memory cannot go through it).

The file, as save_file lays it out:
    u64 little-endian n | n bytes of JSON header, padded with spaces to a multiple of 8 | the tensors' bytes
    header = {"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...}
    (compact JSON, keys in data order); the data order is by dtype, in `DTYPES`' order (safetensors sorts by its
    dtype enum, widest first), then by name; each tensor row-major, offsets relative to the end of the header.
tests/quantkit/test_bounded_calibration.py checks the bytes against save_file's.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

# dtype -> safetensors name, in safetensors' data order
DTYPES = {torch.uint64: "U64", torch.int64: "I64", torch.float64: "F64", torch.float32: "F32", torch.uint32: "U32",
          torch.int32: "I32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint16: "U16", torch.int16: "I16",
          torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
_RANK = {dtype: i for i, dtype in enumerate(DTYPES)}


@dataclass(frozen=True)
class Stored:
    """One tensor to be written: dtype, shape, and `pieces()`, which yields its contents as consecutive blocks of
    rows (tensors of that dtype whose concatenation along dim 0 is the tensor), produced only when the writer
    reaches it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: Callable[[], Iterable[torch.Tensor]]

    @classmethod
    def of(cls, t: torch.Tensor) -> "Stored":
        """A tensor already in memory."""
        return cls(t.dtype, tuple(t.shape), lambda: (t,))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def header(tensors: dict[str, Stored], metadata: Optional[dict[str, str]]) -> tuple[bytes, list[str]]:
    """-> (the file's first bytes: length + padded JSON header, the tensor names in data order)."""
    order = sorted(tensors, key=lambda name: (_RANK[tensors[name].dtype], name))
    entries: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        entries[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def write_bytes(f, t: torch.Tensor) -> int:
    """Append t's bytes (row-major) to the open binary file f; returns how many."""
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()  # a view: no copy
    f.write(memoryview(data))
    return data.nbytes


def write_safetensors(path: Path, tensors: dict[str, Stored], metadata: Optional[dict[str, str]] = None) -> None:
    """The safetensors file of `tensors` at `path` (not atomic: the caller writes into a temporary folder or name)."""
    head, order = header(tensors, metadata)
    with open(path, "wb") as f:
        f.write(head)
        for name in order:
            t, written = tensors[name], 0
            for piece in t.pieces():
                if piece.dtype != t.dtype:
                    raise ValueError(f"{name}: a {piece.dtype} piece of a {t.dtype} tensor")
                written += write_bytes(f, piece)
            if written != t.nbytes:
                raise ValueError(f"{name}: {written} bytes produced, its shape {list(t.shape)} needs {t.nbytes}")


class RowWriter:
    """A one-tensor safetensors file [N, ...] written a block of rows at a time, in order, as they are computed
    (calibration's activations). `close()` checks that every row came and makes the file durable (fsync)."""

    def __init__(self, path: Path, name: str, dtype: torch.dtype, shape: tuple[int, ...], metadata: dict[str, str]):
        self.path, self.tensor = Path(path), Stored(dtype, tuple(shape), tuple)
        self.f = open(self.path, "wb")
        self.f.write(header({name: self.tensor}, metadata)[0])
        self.written = 0

    def write(self, rows: torch.Tensor) -> None:
        """rows [n, ...] in the tensor's dtype: the next n rows."""
        if rows.dtype != self.tensor.dtype or tuple(rows.shape[1:]) != self.tensor.shape[1:]:
            raise ValueError(f"{self.path}: rows {rows.dtype} {list(rows.shape)} for a {self.tensor.dtype} "
                             f"{list(self.tensor.shape)} tensor")
        self.written += write_bytes(self.f, rows)

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        if self.written != self.tensor.nbytes:
            raise ValueError(f"{self.path}: {self.written} bytes written of {self.tensor.nbytes}")
