"""A Hugging Face model directory's safetensors, opened lazily: names, shapes and dtypes come from
the file headers; a tensor (or a slice of one) is read only when asked for.

Every loader reads through this so that no rank ever reads more than the slices it owns
(``read(name, rows)``), and a 240 GB checkpoint costs a rank only its share of host memory.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import torch

INDEX = "model.safetensors.index.json"


class HFCheckpoint:
    """The tensors of ``model_dir/*.safetensors`` by name. Files stay open (memory-mapped, nothing
    read) for the object's life; ``close`` or a ``with`` block releases them."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open

        self.dir = Path(model_dir)
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {self.dir}")
        self._files = {f.name: safe_open(str(f), framework="pt", device="cpu") for f in files}
        self._where: dict[str, str] = {}
        for fname, handle in self._files.items():
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                self._where[name] = fname
        self._fds = {f.name: os.open(f, os.O_RDONLY) for f in files}
        self._offsets = {f.name: _data_offsets(f) for f in files}

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._files.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _slice(self, name: str) -> Any:
        try:
            return self._files[self._where[name]].get_slice(name)
        except KeyError:
            raise KeyError(f"{self.dir}: no tensor {name!r} in its safetensors files") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def nbytes(self, name: str) -> int:
        sl = self._slice(name)
        numel = 1
        for n in sl.get_shape():
            numel *= n
        return numel * _DTYPE_BYTES.get(sl.get_dtype(), 4)

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor."""
        return self._pread(name, slice(None))

    def read(self, name: str, rows: slice | None = None, dim: int = 0) -> torch.Tensor:
        """The tensor, or only ``rows`` of it along ``dim`` (0 or 1): just those bytes are read for
        dim 0, and just the needed row segments for dim 1."""
        if rows is None or dim == 0:
            return self._pread(name, rows or slice(None))
        return self._slice(name)[:, rows]

    def _pread(self, name: str, rows: slice) -> torch.Tensor:
        """Rows ``rows`` (dim 0, step 1) read with positional reads into fresh memory. Not through the
        memory map: the mapped pages a read touches stay in the process's resident set until the file
        is closed, which would count every tensor read so far against the rank a second time."""
        sl = self._slice(name)
        shape, dtype = list(sl.get_shape()), sl.get_dtype()
        row_bytes = _DTYPE_BYTES[dtype] * math.prod(shape[1:])
        start, stop, _ = rows.indices(shape[0]) if shape else (0, 1, 1)
        stop = max(start, stop)
        buf = bytearray((stop - start) * row_bytes)
        fname = self._where[name]
        os.preadv(self._fds[fname], [buf], self._offsets[fname][name] + start * row_bytes)
        out = (
            torch.frombuffer(buf, dtype=_TORCH_DTYPES[dtype])
            if buf
            else torch.empty(0, dtype=_TORCH_DTYPES[dtype])
        )
        return out.reshape([stop - start, *shape[1:]] if shape else [])


_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


_TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _data_offsets(path: Path) -> dict[str, int]:
    """Each tensor's first byte in a safetensors file: an 8-byte little-endian header length, the
    JSON header (``data_offsets`` relative to the data after it), then the data."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {k: 8 + size + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def index_of(model_dir: Path) -> dict[str, str] | None:
    """``weight_map`` of a sharded directory's index file (name -> file), or None for one file."""
    path = Path(model_dir) / INDEX
    return dict(json.loads(path.read_text())["weight_map"]) if path.exists() else None
