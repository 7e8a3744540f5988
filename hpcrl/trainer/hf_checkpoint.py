"""A Hugging Face model directory's safetensors, opened lazily: names, shapes and dtypes come from
the file headers; a tensor (or a slice of one) is read only when asked for.

Every loader reads through this so that no rank ever reads more than the slices it owns
(``read(name, rows)``), and a 240 GB checkpoint costs a rank only its share of host memory.
"""

from __future__ import annotations

import json
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

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._files.clear()

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
        self._slice(name)  # a missing name raises naming the directory
        return self._files[self._where[name]].get_tensor(name)

    def read(self, name: str, rows: slice | None = None, dim: int = 0) -> torch.Tensor:
        """The tensor, or only ``rows`` of it along ``dim`` (0 or 1): safetensors reads just those bytes
        for dim 0, and just the needed row segments for dim 1."""
        if rows is None:
            return self.get(name)
        sl = self._slice(name)
        return sl[rows] if dim == 0 else sl[:, rows]


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


def index_of(model_dir: Path) -> dict[str, str] | None:
    """``weight_map`` of a sharded directory's index file (name -> file), or None for one file."""
    path = Path(model_dir) / INDEX
    return dict(json.loads(path.read_text())["weight_map"]) if path.exists() else None
