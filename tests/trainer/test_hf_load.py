"""Sharded loading (hpcrl/trainer/hf_load.py) for every family the fsdp backend trains: the loaded
policy and reference equal ``from_pretrained``'s model exactly (every parameter and buffer, tied
embeddings still tied, the same log-probs) on one rank and on two; and a rank loading a model much
larger than its shard grows by about its shard, not by the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.trainer.process_group import free_port, init_process_group
from tests.conftest import ROOT
from tests.harness.hf_load_check import parity
from tests.harness.tiny_checkpoints import Kinds, save_tiny

MASTER = f"127.0.0.1:{free_port()}"
KINDS = [
    Kinds("qwen2", tied=True),
    Kinds("qwen3"),
    Kinds("llama"),
    Kinds("qwen3_moe", moe=True),
    Kinds("gemma3"),
    Kinds("gemma3", vlm=True),
    Kinds("gemma4", vlm=True),
    Kinds("gemma4", vlm=True, moe=True, keys_as_values=True),
    Kinds("gemma4", per_layer=True, wide_mlp=True),
    Kinds("nemotron_h", layers="M*E", latent=True),
]
LEGACY_GEMMA3 = "gemma3-vlm-legacy"


def legacy_gemma3_vlm(src: Path, out: Path) -> Path:
    """The VLM checkpoint in Gemma 3's released names (``language_model.model.*``, ``vision_tower.*``),
    which transformers 5 renames on load."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    old = {"model.language_model.": "language_model.model.", "model.": ""}
    tensors = {}
    for k, v in load_file(src / "model.safetensors").items():
        new = next(((k.replace(a, b, 1)) for a, b in old.items() if k.startswith(a)), k)
        tensors[new] = v
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_load")
    dirs = {k.label(): save_tiny(k, root / k.label()) for k in KINDS}
    dirs[LEGACY_GEMMA3] = legacy_gemma3_vlm(dirs["gemma3-vlm"], root / LEGACY_GEMMA3)
    return dirs


def torchrun(*args: str, port: int, timeout: float = 300) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
    done = subprocess.run(
        [*cmd, str(ROOT / "tests" / "harness" / "hf_load_check.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.parametrize("label", [k.label() for k in KINDS] + [LEGACY_GEMMA3])
def test_one_rank_loads_what_from_pretrained_loads(checkpoints, label):
    init_process_group(0, 1, MASTER, "gloo")
    assert parity(checkpoints[label]) == []


@pytest.mark.slow
def test_two_ranks_load_what_from_pretrained_loads(checkpoints, tmp_path):
    out = tmp_path / "parity.json"
    torchrun("parity", str(out), *map(str, checkpoints.values()), port=free_port())
    assert json.loads(out.read_text()) == []


WIDE = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=24, num_attention_heads=8)


def wide_qwen2(out: Path) -> tuple[Path, float, float]:
    """A Qwen2 of ~370 MB in fp32 (24 layers of ~15 MB): (its directory, whole MiB, one layer's MiB)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=2048, num_key_value_heads=2, tie_word_embeddings=False, **WIDE)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    mib = lambda params: sum(p.numel() * 4 for p in params) / 2**20  # noqa: E731
    return out, mib(model.parameters()), mib(model.model.layers[0].parameters())


@pytest.mark.slow
def test_a_rank_grows_by_its_shard_not_by_the_model(tmp_path):
    model_dir, whole, layer = wide_qwen2(tmp_path / "wide")
    torchrun("memory", str(tmp_path / "mem"), str(model_dir), port=free_port())
    for rank in (0, 1):
        got = json.loads((tmp_path / f"mem.{rank}").read_text())
        bound = got["shard"] + 2 * layer + 64  # two layers' full tensors being read, 64 MiB of slack
        numbers = (
            f"rank {rank}: peak RSS growth {got['growth']:.0f} MiB (after: {got['after']:.0f}), shard "
            f"{got['shard']:.0f} MiB, one layer {layer:.0f} MiB, whole model {whole:.0f} MiB"
        )
        print(numbers)
        assert got["growth"] < bound and got["growth"] < 0.8 * whole, numbers
        assert got["after"] > 0.9 * got["shard"], f"the measurement misses the shard itself: {numbers}"
