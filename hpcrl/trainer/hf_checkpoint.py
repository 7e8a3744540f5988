"""A Hugging Face model directory's safetensors, opened lazily: names, shapes and dtypes come from
the file headers; a tensor (or a slice of one) is read only when asked for.

Every loader reads through this so that no rank ever reads more than the slices it owns
(``read(name, rows)``), and a 240 GB checkpoint costs a rank only its share of host memory. Reads are
plain file reads into a fresh tensor, never a memory map: safetensors' own ``safe_open`` (0.8) maps the
whole file and keeps every page a slice touched resident for the handle's life, so a rank reading its
pipeline stage slice by slice would still end up holding that whole stage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

INDEX = "model.safetensors.index.json"
BLOCK_BYTES = 64 << 20
"""A dim-1 slice is read in blocks of whole rows of at most this size (the slice is cut from each)."""


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Byte offset of the tensor's data in ``file``."""


class HFCheckpoint:
    """The tensors of ``model_dir/*.safetensors`` by name, from the file headers (nothing else read
    until asked). ``close`` or a ``with`` block releases the open files."""

    def __init__(self, model_dir: Path) -> None:
        self.dir = Path(model_dir)
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {self.dir}")
        self._where: dict[str, _Entry] = {}
        for f in files:
            self._where.update(_header(f))
        self._open: dict[Path, Any] = {}

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for handle in self._open.values():
            handle.close()
        self._open.clear()

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _entry(self, name: str) -> _Entry:
        try:
            return self._where[name]
        except KeyError:
            raise KeyError(f"{self.dir}: no tensor {name!r} in its safetensors files") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def nbytes(self, name: str) -> int:
        e = self._entry(name)
        return _numel(e.shape) * e.dtype.itemsize

    def meta(self, name: str) -> torch.Tensor:
        """A tensor of ``name``'s shape and dtype on the meta device (no data): for working out names
        and layouts without reading."""
        e = self._entry(name)
        return torch.empty(e.shape, dtype=e.dtype, device="meta")

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor."""
        return self.read(name)

    def read(self, name: str, rows: slice | None = None, dim: int = 0) -> torch.Tensor:
        """The tensor, or only ``rows`` (a contiguous slice) of it along ``dim`` (0 or 1): for dim 0 just
        those bytes are read; for dim 1 whole rows a block at a time, the slice cut from each."""
        e = self._entry(name)
        n = e.shape[0] if e.shape else 1
        if dim == 0 or rows is None:
            lo, hi = _bounds(rows, n)
            return self._rows(e, lo, hi)
        lo, hi = _bounds(rows, e.shape[1])
        out = torch.empty((n, hi - lo, *e.shape[2:]), dtype=e.dtype)
        step = max(1, BLOCK_BYTES // max(1, _numel(e.shape[1:]) * e.dtype.itemsize))
        for r in range(0, n, step):
            out[r : r + step] = self._rows(e, r, min(n, r + step))[:, lo:hi]
        return out

    def _rows(self, e: _Entry, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` (dim 0) of ``e``, read from its file into a new tensor."""
        row = _numel(e.shape[1:]) * e.dtype.itemsize
        buf = torch.empty((hi - lo) * row, dtype=torch.uint8)
        handle = self._open.get(e.file) or self._open.setdefault(e.file, open(e.file, "rb"))  # noqa: SIM115
        handle.seek(e.start + lo * row)
        if handle.readinto(buf.numpy()) != buf.numel():
            raise OSError(f"{e.file}: short read (a truncated safetensors file?)")
        shape = (hi - lo, *e.shape[1:]) if e.shape else ()
        return buf.view(e.dtype).reshape(shape)


def _header(path: Path) -> dict[str, _Entry]:
    """One safetensors file's tensors: an 8-byte little-endian header size, a JSON header of name ->
    dtype, shape, data offsets (relative to the end of the header)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return {
        name: _Entry(path, DTYPES[h["dtype"]], tuple(h["shape"]), 8 + size + h["data_offsets"][0])
        for name, h in header.items()
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _bounds(rows: slice | None, n: int) -> tuple[int, int]:
    lo, hi, step = (rows or slice(None)).indices(n)
    if step != 1:
        raise ValueError(f"a slice with step {step}: only contiguous slices are read")
    return lo, max(lo, hi)


DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def index_of(model_dir: Path) -> dict[str, str] | None:
    """``weight_map`` of a sharded directory's index file (name -> file), or None for one file."""
    path = Path(model_dir) / INDEX
    return dict(json.loads(path.read_text())["weight_map"]) if path.exists() else None
