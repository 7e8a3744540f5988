"""Full and unwritable disks: a checkpoint save that fails for space or permission keeps the previous
checkpoint, leaves no partial directory in resume's way, and says so in one line (async: the run goes
on; sync: it stops). Real files on a real small filesystem (a tmpfs of a few MB, mounted per test)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcrl.errors import HpcrlError
from hpcrl.run.checkpoint import CheckpointManager, tree_bytes, verify

MB = 1 << 20


def mount_tmpfs(where: Path, size: int) -> None:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MB filesystem of its own, unmounted after the test."""
    where = tmp_path / "disk"
    mount_tmpfs(where, 2 * MB)
    yield where
    subprocess.run(["umount", "-l", str(where)], check=True)


class WritingShards:
    """The trainer ranks' side, writing ``size`` real bytes: now (sync) or when waited for (async, as
    a rank's background writer does)."""

    def __init__(self, size: int) -> None:
        self.size, self.path = size, ""

    def save_checkpoint(self, path: str, async_save: bool) -> float:
        Path(path).mkdir()
        self.path = path
        if not async_save:
            self.finish_checkpoint()
        return 0.0

    def finish_checkpoint(self) -> float:
        if self.path:
            path, self.path = Path(self.path), ""
            (path / "__0_0.distcp").write_bytes(b"x" * self.size)
        return 0.0


def save(mgr: CheckpointManager, step: int, size: int, async_save: bool) -> WritingShards:
    shards = WritingShards(size)
    mgr.save(step, shards, {"step": step}, {"m": float(step)}, async_save)
    return shards


def test_an_async_save_on_a_full_disk_keeps_the_previous_checkpoint_and_the_run_goes_on(small_disk):
    said: list[str] = []
    mgr = CheckpointManager(small_disk / "ckpt", 3, "m", True, say=said.append)
    save(mgr, 1, MB // 2, async_save=False)
    shards = save(mgr, 2, 3 * MB, async_save=True)  # more than the disk holds
    assert mgr.settle(shards) == 0.0
    assert [c.step for c in mgr.list()] == [1] and verify(mgr.list()[0].path) == ""
    assert not list((small_disk / "ckpt").glob("*.tmp"))  # its partial directory is gone
    assert mgr.failures == 1 and len(said) == 1 and "\n" not in said[0]
    assert said[0].startswith("checkpoint step_000002 not saved: No space left on device at ")
    assert "step_000002.tmp" in said[0] and "bytes needed" in said[0] and " free" in said[0]
    assert "saves again at the next period" in said[0] and "checkpoint.dir" in said[0]
    save(mgr, 3, MB // 2, async_save=True)  # the next period's save, with room again
    mgr.settle(shards)
    assert [c.step for c in mgr.list()] == [1, 3] and mgr.failures == 1


def test_a_sync_save_on_a_full_disk_stops_in_one_line(small_disk):
    said: list[str] = []
    mgr = CheckpointManager(small_disk / "ckpt", 3, "m", True, say=said.append)
    save(mgr, 1, MB // 2, async_save=False)
    with pytest.raises(HpcrlError) as stop:
        save(mgr, 2, 3 * MB, async_save=False)
    line = str(stop.value)
    assert said == [line]  # the driver log has it as a line of its own, not only in a traceback
    assert "\n" not in line and "step_000002 not saved: No space left on device" in line
    assert "the run stops here" in line
    # the last committed checkpoint's size is the figure: a checkpoint of step 2 takes about as much
    assert f"({tree_bytes(mgr.latest().path):,} bytes needed, " in line
    assert [c.step for c in mgr.list()] == [1] and not list((small_disk / "ckpt").glob("*.tmp"))


def test_a_read_only_filesystem_stops_a_sync_save_in_one_line(small_disk):
    mgr = CheckpointManager(small_disk / "ckpt", 3, "m", True)
    save(mgr, 1, 1000, async_save=False)
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    with pytest.raises(
        HpcrlError, match=r"step_000002 not saved: Read-only file system at .*step_000002\.tmp"
    ):
        save(mgr, 2, 1000, async_save=False)
    assert [c.step for c in mgr.list()] == [1] and verify(mgr.list()[0].path) == ""


def test_partial_directories_never_block_a_resume_or_the_next_save(tmp_path):
    mgr = CheckpointManager(tmp_path, 3, "m", True)
    save(mgr, 1, 100, async_save=False)
    # what a full disk or a kill leaves: a half-written .tmp of the step a resume saves again, and a
    # directory whose meta.json was cut short
    (tmp_path / "step_000002.tmp" / "trainer").mkdir(parents=True)
    (tmp_path / "step_000002.tmp" / "trainer" / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / "step_000003").mkdir()
    (tmp_path / "step_000003" / "meta.json").write_text('{"step": 3, "met')
    assert mgr.resumable(print).step == 1
    save(mgr, 2, 100, async_save=False)
    assert [c.step for c in mgr.list()] == [1, 2] and verify(mgr.latest().path) == ""
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.slow
def test_a_real_trainers_save_on_a_full_disk(tiny_dir, tmp_path):
    """The trainer's own shard writer (torch.distributed.checkpoint, async in a background thread):
    its ENOSPC, wrapped by DCP, is the same one line; the sync save after it stops the run."""
    from hpcrl.trainer.fsdp import FSDPTrainer
    from hpcrl.trainer.process_group import free_port
    from tests.conftest import compose

    trainer = FSDPTrainer(tiny_dir, compose("algo.kl_coef=0"), master=f"127.0.0.1:{free_port()}")
    trainer.save_checkpoint(str(tmp_path / "probe"), async_save=False)
    size = tree_bytes(tmp_path / "probe")
    disk = tmp_path / "disk"
    mount_tmpfs(disk, size * 3 // 2 + 64 * 1024)  # room for one checkpoint, not two
    try:
        said: list[str] = []
        mgr = CheckpointManager(disk / "ckpt", 3, "m", True, say=said.append)
        mgr.save(1, trainer, {"step": 1}, {"m": 1.0}, async_save=False)
        mgr.save(2, trainer, {"step": 2}, {"m": 2.0}, async_save=True)
        mgr.settle(trainer)
        assert len(said) == 1 and "step_000002 not saved: No space left on device" in said[0], said
        assert [c.step for c in mgr.list()] == [1] and verify(mgr.latest().path, deep=True) == ""
        with pytest.raises(HpcrlError, match="step_000003 not saved: No space left on device"):
            mgr.save(3, trainer, {"step": 3}, {"m": 3.0}, async_save=False)
        assert not list((disk / "ckpt").glob("*.tmp")) and mgr.failures == 1
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)
