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
    # another optimizer's state: refused, unless the run starts its optimizer afresh
    with pytest.raises(HpcrlError) as other:
        check_resumable(info, {**about, "optimizer": "adafactor"})
    assert str(other.value).endswith(
        "holds trainer.optimizer=adamw state; this run is trainer.optimizer=adafactor: set "
        "checkpoint.resume_weights_only=true to start its state afresh, or trainer.optimizer=adamw"
    )
    assert check_resumable(info, {**about, "optimizer": "adafactor"}, weights_only=True) == ""
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
    # torchrun names whichever rank it sees end first: the killed one, or rank 0 failing on the lost peer
    ended = ("Signal 9 (SIGKILL)", "Connection closed by peer")
    assert died.returncode != 0 and any(e in died.stderr for e in ended), died.stderr[-3000:]
    root = tmp_path / "checkpoints"
    # step 2 never committed; its partial directory, where rank 0's failing save left it, blocks nothing
    names = sorted(p.name for p in root.iterdir())
    assert names in (["step_000001"], ["step_000001", "step_000002.tmp"]), names
    assert CheckpointManager(root, 3, "m", True).latest().step == 1
    resumed = torchrun("resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = torch.load(tmp_path / "resumed.pt")
    # rank 0 writes step 2's weights before the save rank 1 dies in (missing where the harness let rank 1
    # fail on step 1: its shard file written under a directory rank 0 had already committed)
    assert (tmp_path / "step2.pt").exists(), died.stderr[-3000:]
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


def three_steps(tmp_path: Path) -> CheckpointManager:
    mgr = CheckpointManager(tmp_path, keep_top_k=5, metric="m", higher_is_better=True)
    for step in (1, 2, 3):
        save(mgr, step, {"m": float(step)})
    return mgr


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda p: (p / "trainer" / "__0_0.distcp").write_bytes(b"sh"), "trainer/__0_0.distcp is 2 bytes, 5"),
        (lambda p: (p / "trainer" / "__0_0.distcp").unlink(), "trainer/__0_0.distcp is missing"),
        (
            lambda p: (p / "loop.pt").write_bytes(bytes(len((p / "loop.pt").read_bytes()))),
            "loop.pt does not match",
        ),
        (lambda p: (p / "manifest.json").write_text("{"), "manifest.json is unreadable"),
    ],
    ids=["truncated-shard", "missing-shard", "zeroed-loop-state", "bad-manifest"],
)
def test_resume_takes_the_newest_checkpoint_that_verifies_and_says_which_it_skipped(tmp_path, damage, why):
    mgr = three_steps(tmp_path)
    damage(tmp_path / "step_000003")
    said: list[str] = []
    found = mgr.resumable(said.append)
    assert found is not None and found.step == 2
    assert len(said) == 1 and said[0].startswith("checkpoint step_000003 skipped: ") and why in said[0]
    assert mgr.resumable(said.append, frozenset({found.path})).step == 1  # step 2 then failed to load


def test_the_manifest_takes_the_ranks_records_and_sums_the_rest(tmp_path):
    """A rank's record (trainer/shards.py writes it as the shard lands) goes into the manifest unread;
    every other file is summed at commit; nothing of the records stays behind."""
    from hpcrl.core.files import crc32_of

    class RecordingShards(FakeShards):
        def save_checkpoint(self, path: str, async_save: bool) -> float:
            super().save_checkpoint(path, async_save)
            shard = Path(path) / "__0_0.distcp"
            record = {shard.name: {"size": 5, "crc32": crc32_of(shard)}}
            (Path(path) / ".crc_0.json").write_text(json.dumps(record))
            return 0.0

    mgr = CheckpointManager(tmp_path, keep_top_k=3, metric="m", higher_is_better=True)
    save(mgr, 1, {"m": 1.0}, RecordingShards())
    ckpt = mgr.latest().path
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert set(manifest) == {"trainer/__0_0.distcp", "loop.pt", "model.json"}
    assert manifest["loop.pt"]["crc32"] == crc32_of(ckpt / "loop.pt")
    assert not list((ckpt / "trainer").glob(".crc_*"))


def test_export_refuses_a_damaged_checkpoint_in_one_line_naming_the_intact_ones(tmp_path):
    from hpcrl.tools.export import resolve

    three_steps(tmp_path)
    shard = tmp_path / "step_000003" / "trainer" / "__0_0.distcp"
    shard.write_bytes(b"SHARD")  # same size: only the shards' own sums (a deep check) see it
    with pytest.raises(HpcrlError) as err:
        resolve(tmp_path / "step_000003")
    message = str(err.value)
    assert "\n" not in message and "does not match its checksum" in message
    assert "intact beside it: step_000001, step_000002" in message
    assert resolve(tmp_path / "step_000002") == tmp_path / "step_000002"


def test_a_run_whose_checkpoints_are_all_damaged_refuses_to_start_afresh(tmp_path):
    from hpcrl.run.driver import resume_point

    mgr = three_steps(tmp_path)
    for step in (1, 2, 3):
        (tmp_path / f"step_{step:06d}" / "loop.pt").unlink()
    with pytest.raises(HpcrlError, match=r"no checkpoint under .* is whole"):
        resume_point(mgr)
    assert resume_point(CheckpointManager(tmp_path / "empty", 1, "m", True)) is None


def test_a_checkpoint_that_fails_to_load_gives_way_to_the_next_older_one_whole(tmp_path):
    """Damage inside a shard's recorded size shows only when the ranks read it: the driver loads the
    next older checkpoint, trainer state and loop state of that one step, never a mix."""
    import random

    from hpcrl.config.schema import LoggerConfig
    from hpcrl.run.driver import _Prepared, _resume
    from hpcrl.run.metrics import MetricsLogger, read_metrics

    mgr = CheckpointManager(tmp_path, keep_top_k=5, metric="m", higher_is_better=True)
    for step in (1, 2, 3):
        state = {
            "step": step,
            "stream": {"at": step},
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
        }
        mgr.save(step, FakeShards(), state, {"m": float(step)}, False)

    class Actors:
        def __init__(self) -> None:
            self.loaded: list[str] = []
            self.synced: list[int] = []

        def load_checkpoint(self, path: str, weights_only: bool) -> None:
            self.loaded.append(Path(path).parent.name)
            if "step_000003" in path:
                raise RuntimeError(
                    "PytorchStreamReader failed reading zip archive: failed finding central directory"
                )

        def sync_weights(self, step: int) -> None:
            self.synced.append(step)

    class Stream:
        def restore(self, state: dict) -> None:
            self.at = state["at"]

    stream, actors = Stream(), Actors()
    (tmp_path / "run").mkdir()
    logger = MetricsLogger(tmp_path / "run", LoggerConfig(tensorboard=False), "t", {})
    for step in (1, 2, 3):  # the first attempt got as far as step 3
        logger.log(step, {})
    prep = _Prepared(tmp_path, str, 0, stream, [], mgr, logger, False, mgr.resumable(print))
    # not damage (the files match their sums): the error is the run's, raised as it is, not a fallback
    with pytest.raises(RuntimeError, match="PytorchStreamReader"):
        _resume(actors, prep, 0)
    # damage the resume's check cannot see (same size; only the shard's own sum): the next older one
    (tmp_path / "step_000003" / "trainer" / "__0_0.distcp").write_bytes(b"SHARD")
    stream, actors = Stream(), Actors()
    prep = _Prepared(tmp_path, str, 0, stream, [], mgr, logger, False, mgr.resumable(print))
    step, kept = _resume(actors, prep, 0)
    assert step == 2 and stream.at == 2 and actors.synced == [2] and kept == []
    assert actors.loaded == ["step_000003", "step_000002"]
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]  # step 3 is trained again
