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
