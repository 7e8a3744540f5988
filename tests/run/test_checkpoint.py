"""Checkpoints (the driver's side): commit only once every rank has written, keep-top-k by metric,
the latest kept for resume, model.json checked before a resume. The ranks' own shards are tested
with real trainers (tests/test_megatron.py, tests/trainer/test_trainer.py, tests/test_shards.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpcrl.errors import HpcrlError
from hpcrl.run.checkpoint import CheckpointManager, check_resumable, load_loop_state


class FakeShards:
    """Stands in for the trainer ranks: 'writes' a shard file; ``finish`` can fail like a dead rank."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.calls = fail, []

    def save_checkpoint(self, path: str, async_save: bool) -> float:
        self.calls.append(("save", async_save))
        Path(path).mkdir()
        (Path(path) / "__0_0.distcp").write_bytes(b"shard")
        return 0.0

    def finish_checkpoint(self) -> float:
        self.calls.append(("finish",))
        if self.fail:
            raise RuntimeError("trainer rank 1 died")
        return 0.0


def save(mgr, step, metrics, shards=None, async_save=False):
    return mgr.save(step, shards or FakeShards(), {"step": step}, metrics, async_save)


def test_keep_top_k_plus_latest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_top_k=2, metric="val/accuracy", higher_is_better=True)
    for step, acc in [(10, 0.5), (20, 0.9), (30, 0.7), (40, 0.2)]:
        save(mgr, step, {"val/accuracy": acc})
    steps = sorted(c.step for c in mgr.list())
    assert steps == [20, 30, 40]  # the two best (20, 30) and the latest (40)
    assert mgr.best().step == 20
    assert mgr.latest().step == 40
    assert load_loop_state(mgr.latest())["step"] == 40


def test_lower_is_better(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_top_k=1, metric="loss", higher_is_better=False)
    for step, loss in [(1, 0.3), (2, 0.1), (3, 0.2)]:
        save(mgr, step, {"loss": loss})
    assert sorted(c.step for c in mgr.list()) == [2, 3]


def test_an_async_save_counts_only_once_every_rank_has_written(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_top_k=3, metric="m", higher_is_better=True)
    save(mgr, 1, {"m": 1.0})
    shards = FakeShards()
    save(mgr, 2, {"m": 2.0}, shards, async_save=True)
    assert shards.calls == [("save", True)]
    assert mgr.latest().step == 1  # step 2 is still being written: a resume now takes step 1
    assert (tmp_path / "step_000002.tmp" / "loop.pt").exists()
    mgr.settle(shards)
    assert shards.calls[-1] == ("finish",) and mgr.latest().step == 2
    assert not (tmp_path / "step_000002.tmp").exists()
    meta = json.loads((mgr.latest().path / "meta.json").read_text())
    assert meta["step"] == 2 and meta["metric"] == 2.0


def test_a_rank_that_fails_its_write_leaves_nothing_resume_would_take(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_top_k=3, metric="m", higher_is_better=True)
    save(mgr, 1, {"m": 1.0})
    dead = FakeShards(fail=True)
    save(mgr, 2, {"m": 2.0}, dead, async_save=True)
    with pytest.raises(RuntimeError, match="rank 1 died"):
        mgr.settle(dead)
    assert mgr.latest().step == 1 and [c.step for c in mgr.list()] == [1]
    save(mgr, 3, {"m": 0.5})  # the next save clears the leftover
    assert not (tmp_path / "step_000002.tmp").exists() and mgr.latest().step == 3


def test_model_json_and_the_model_files_travel_with_each_checkpoint(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights stay where they are")
    about = {"model": "tiny", "backend": "fsdp", "layout": {"world": 2}}
    mgr = CheckpointManager(tmp_path / "ckpt", 3, "m", True, about=about, model_dir=model)
    save(mgr, 5, {"m": 1.0})
    info = mgr.latest()
    assert info.about() == about
    assert sorted(p.name for p in (info.path / "hf").iterdir()) == ["config.json", "tokenizer.json"]
    assert check_resumable(info, about) == ""
    note = check_resumable(info, {**about, "layout": {"world": 1}})
    assert note == "resharding step_000005: written by {'world': 2}, loaded as {'world': 1}"
    with pytest.raises(HpcrlError) as other:
        check_resumable(info, {**about, "backend": "megatron"})
    assert "model=tiny trainer=fsdp; this run is model=tiny trainer=megatron" in str(other.value)
    (info.path / "model.json").unlink()  # as an older hpcrl wrote them
    with pytest.raises(HpcrlError, match="older hpcrl"):
        check_resumable(info, about)
    assert torch.load(info.path / "loop.pt")["step"] == 5


@pytest.mark.slow
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_to_resume(tiny_dir, tmp_path):
    """Real processes: rank 1 of two is SIGKILLed while writing its shard of step 2 (async save);
    torchrun tears the run down; a new run resumes step 1's weights, on both ranks."""
    import subprocess
    import sys

    from hpcrl.trainer.process_group import free_port
    from tests.conftest import ROOT

    def torchrun(mode: str) -> subprocess.CompletedProcess[str]:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={free_port()}",
        ]
        cmd += [str(ROOT / "tests" / "harness" / "checkpoint_kill.py"), str(tiny_dir), str(tmp_path), mode]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)

    died = torchrun("die")
    assert died.returncode != 0 and "Signal 9 (SIGKILL)" in died.stderr, died.stderr[-3000:]
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000001", "step_000002.tmp"]
    assert (root / "step_000002.tmp" / "trainer" / "__1_0.distcp").read_bytes() == b"half a shard"
    assert CheckpointManager(root, 3, "m", True).latest().step == 1
    resumed = torchrun("resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = torch.load(tmp_path / "resumed.pt")
    step1, step2 = torch.load(tmp_path / "step1.pt"), torch.load(tmp_path / "step2.pt")
    assert got["step"] == 1
    assert any(not torch.equal(step1[k], step2[k]) for k in step1)  # step 2 moved the weights
    for name, value in step1.items():
        assert torch.equal(got["weights"][name], value), name


@pytest.mark.slow
def test_the_drivers_memory_does_not_grow_with_the_model(tmp_path):
    """Two fsdp ranks as Ray actors save (async) and load a ~140 MiB checkpoint (a 12M-parameter
    model and its Adam state); the driver process, where the old format gathered all of it, stays
    flat (measured 0.2 MiB of growth at twice this size)."""
    import subprocess
    import sys

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.conftest import ROOT

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=128,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "model")
    cmd = [
        sys.executable,
        str(ROOT / "tests" / "harness" / "driver_memory.py"),
        str(tmp_path / "model"),
        str(tmp_path),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    growth = (got["peak_kb"] - got["before_kb"]) * 1024
    print(f"checkpoint {got['checkpoint_bytes'] / 2**20:.0f} MiB, driver grew {growth / 2**20:.1f} MiB")
    assert got["checkpoint_bytes"] > 120 * 2**20
    assert growth < got["checkpoint_bytes"] / 20, got
