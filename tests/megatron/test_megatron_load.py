"""Loading a Hugging Face checkpoint into the Megatron backend without reading it whole: the lazy
reader's slices equal the tensors' (any dtype, either dim, blocks of rows), and under torchrun (gloo,
CPU, TP=2 x PP=2) a rank's host memory grows by about the part of a 16-layer model it holds, far less
than the checkpoint. Parity of the loaded weights is tests/test_megatron*.py's (every step there
starts from this loader)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hpcrl.trainer import hf_checkpoint
from hpcrl.trainer.hf_checkpoint import HFCheckpoint
from tests.conftest import ROOT
from tests.harness.tiny_checkpoints import DENSE

MB = 1 << 20


def test_reads_equal_the_saved_tensors_sliced_on_either_dim(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    saved = {
        "a": torch.randn(37, 11),
        "b": torch.randn(5, 6, 7).bfloat16(),
        "scalar": torch.tensor(3.0),
        "ids": torch.arange(10),
        "empty": torch.randn(0, 4),
    }
    names = list(saved)
    save_file({n: saved[n] for n in names[:3]}, tmp_path / "model-00001.safetensors")
    save_file({n: saved[n] for n in names[3:]}, tmp_path / "model-00002.safetensors")
    monkeypatch.setattr(hf_checkpoint, "BLOCK_BYTES", 100)  # a dim-1 slice over several blocks of rows
    with HFCheckpoint(tmp_path) as ckpt:
        assert sorted(ckpt.names()) == sorted(names)
        for name, t in saved.items():
            assert torch.equal(ckpt.get(name), t), name
            meta = ckpt.meta(name)
            assert (meta.shape, meta.dtype, meta.device.type) == (t.shape, t.dtype, "meta"), name
            assert ckpt.nbytes(name) == t.numel() * t.element_size(), name
        assert torch.equal(ckpt.read("a", slice(3, 9)), saved["a"][3:9])
        assert torch.equal(ckpt.read("a", slice(3, 9), dim=1), saved["a"][:, 3:9])
        assert torch.equal(ckpt.read("b", slice(2, 5), dim=1), saved["b"][:, 2:5])
        assert torch.equal(ckpt.read("b", slice(1, 3)), saved["b"][1:3])
        with pytest.raises(KeyError, match="no tensor 'c'"):
            ckpt.get("c")


LAYERS = 16


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """A Qwen2 of 16 wide layers (hidden 768, MLP 2048; 104M parameters, 415 MB in fp32), so one
    layer is a sixteenth of the checkpoint and a TP=2 x PP=2 rank's part a quarter."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        **{
            **DENSE,
            "hidden_size": 768,
            "intermediate_size": 2048,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
        },
        tie_word_embeddings=False,
    )
    out = tmp_path_factory.mktemp("wide")
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


@pytest.mark.slow
def test_a_rank_holds_about_its_part_of_the_model_never_the_checkpoint(wide_dir, tmp_path):
    out = tmp_path / "memory.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=4",
        "--master_port=29771",
        str(ROOT / "tests" / "harness" / "megatron_load_memory.py"),
        str(wide_dir),
        str(out),
        "2",
        "2",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    with HFCheckpoint(wide_dir) as ckpt:
        whole = sum(ckpt.nbytes(n) for n in ckpt.names()) / MB
    layer = whole / LAYERS
    for r in json.loads(out.read_text()):
        print(
            f"rank {r['rank']}: grew {r['grown_mb']:.0f} MB holding {r['held_mb']:.0f} MB; "
            f"checkpoint {whole:.0f} MB, a layer {layer:.0f} MB"
        )
        bound = r["held_mb"] + 2 * layer + 96  # the slack: the process group, Megatron's groups
        assert r["grown_mb"] < bound, (
            f"rank {r['rank']} grew {r['grown_mb']:.0f} MB loading its {r['held_mb']:.0f} MB part: over "
            f"{bound:.0f} MB (its part + 2 layers of {layer:.0f} MB + 96 MB); the checkpoint is {whole:.0f} MB"
        )
        assert r["grown_mb"] < 0.6 * whole, (r, whole)  # reading it all grew each rank by ~2x
