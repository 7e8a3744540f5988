"""``hpcrl render -m`` and ``hpcrl submit -m --dry-run``: every point planned and its files written,
one line a point with its verdict, nothing submitted."""

from __future__ import annotations

import re

from tests.conftest import run_cli

SWEEP = ["+experiment=grpo-tiny-2n1g-fsdp-split", "algo.lr=1e-4,3e-4"]


def test_render_m_writes_every_points_files_and_submits_nothing(tmp_path):
    done = run_cli("render", "-m", *SWEEP, f"run.output_root={tmp_path}")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert re.match(r"\s+0\s+algo.lr=0.0001\s+fits \(2 node\(s\), peak \d+ of \d+ GB per GPU\)", lines[1])
    assert lines[-1].startswith("every point fits; nothing was submitted")
    (preview,) = (tmp_path / "sweeps").iterdir()
    for n, lr in ((0, "0.0001"), (1, "0.0003")):
        assert (preview / f"p{n}" / "sbatch.sh").read_text().startswith("#!")
        assert f"lr: {lr}" in (preview / f"p{n}" / "config.yaml").read_text()
    assert not list(tmp_path.glob("grpo-*"))  # no run directory: nothing was submitted


def test_submit_m_dry_run_names_the_refused_point_and_fails(tmp_path):
    done = run_cli(
        "submit", "-m", "--dry-run", *SWEEP[:1], "algo.num_generations=1,4", f"run.output_root={tmp_path}"
    )
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert "refused: algo.num_generations=1" in lines[1] and " fits (" in lines[2]
    assert lines[-1].startswith("1 of 2 point(s) would be refused; nothing was submitted")


def test_a_sweep_stopped_half_way_says_how_to_resume_and_into_submits_only_the_rest(tmp_path, monkeypatch):
    """The bookkeeping around ``submit``; sbatch itself is the Slurm tests' (tests/launch). Here a
    stand-in for ``submit`` refuses the second job once, as a transient sbatch failure would."""
    from pathlib import Path

    import pytest

    from hpcrl.errors import HpcrlError
    from hpcrl.launch import submit as submit_module
    from hpcrl.tools.sweep import plan_points, submit_sweep

    sent: list[str] = []

    def stand_in(plan, *, suffix, asked):  # type: ignore[no-untyped-def]
        assert asked  # plan_points asked Slurm of every point
        if suffix == "p1" and "p1" not in sent and len(sent) == 1:
            sent.append("refused")
            raise HpcrlError("sbatch: error: Socket timed out on send/recv operation")
        sent.append(suffix)
        return submit_module.Submitted(f"10{suffix[1:]}", tmp_path / suffix)

    monkeypatch.setattr(submit_module, "submit", stand_in)
    points = plan_points([*SWEEP, "algo.kl_coef=0,0.01", f"run.output_root={tmp_path}"])
    with pytest.raises(HpcrlError) as err:
        submit_sweep(points)
    line = str(err.value)
    assert line.startswith(
        "sweep stopped at point 1 (algo.lr=0.0001 algo.kl_coef=0.01): sbatch: error: Socket"
    )
    sweep_dir = Path(re.search(r"--into (\S+) submits the rest", line).group(1))
    _dir, rows = submit_sweep(points, into=sweep_dir)
    assert [r["point"] for r in rows] == [0, 1, 2, 3] and sent == ["p0", "refused", "p1", "p2", "p3"]


def test_render_m_refuses_a_point_as_submit_would_and_writes_only_the_others(tmp_path):
    """The sweep's points pass the same gate as one run (launch/gate.py): a point whose sequences
    outgrow the tiny model's 64 positions gets submit's line, and no files."""
    done = run_cli("render", "-m", *SWEEP[:1], "rollout.max_new_tokens=8,60", f"run.output_root={tmp_path}")
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert (
        " fits (" in lines[1] and "refused: data.max_prompt_tokens=16 + rollout.max_new_tokens=60" in lines[2]
    )
    (preview,) = (tmp_path / "sweeps").iterdir()
    assert [p.name for p in preview.iterdir()] == ["p0"]
