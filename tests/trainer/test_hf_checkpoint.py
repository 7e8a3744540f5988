"""HFCheckpoint (hpcrl/trainer/hf_checkpoint.py): row slices and whole tensors as safetensors saved
them, across files and dtypes."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from hpcrl.trainer.hf_checkpoint import HFCheckpoint


def test_rows_and_whole_tensors_read_back_as_saved(tmp_path):
    saved = {
        "a": torch.randn(7, 3),
        "b": torch.randn(5, 2, 4).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64),
        "s": torch.tensor(2.5),
    }
    save_file({"a": saved["a"], "s": saved["s"]}, tmp_path / "one.safetensors")
    save_file({"b": saved["b"], "c": saved["c"]}, tmp_path / "two.safetensors")
    with HFCheckpoint(tmp_path) as ckpt:
        assert sorted(ckpt.names()) == ["a", "b", "c", "s"] and ckpt.shape("b") == (5, 2, 4)
        for name, t in saved.items():
            assert torch.equal(ckpt.get(name), t) and ckpt.get(name).dtype == t.dtype, name
        for rows in (slice(0, 4), slice(4, 7), slice(7, 7), slice(2, 3)):
            assert torch.equal(ckpt.read("a", rows), saved["a"][rows]), rows
        assert torch.equal(ckpt.read("b", slice(1, 3)), saved["b"][1:3])
        assert torch.equal(ckpt.read("c", slice(3, 6)), saved["c"][3:])
        assert torch.equal(ckpt.read("a", slice(1, 2), dim=1), saved["a"][:, 1:2])
