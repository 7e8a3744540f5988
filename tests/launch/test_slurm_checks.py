"""Before a job is queued (issue 37): Slurm's own answer to the written script (``sbatch --test-only``),
asked by ``hpcrl plan`` and ``render`` too, and of every point of a sweep (``submit -m``, ``render -m``),
and its ``KillWait`` against one save of the run. On the test cluster (KillWait 5 s; any save takes
longer: plan/savetime.py's fixed overhead alone is 15 s) the submissions take seconds; the tests are
marked slow for the cluster's start (a session fixture), as the other Slurm tests are."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

import pytest

from hpcrl.config.compose import compose_config
from hpcrl.launch.slurm_checks import fix_for, kill_wait_s, kill_wait_warning, refusal, slurm_refusal
from hpcrl.plan.planner import make_plan
from hpcrl.plan.savetime import save_seconds
from tests.conftest import run_cli

TINY = [
    "cluster=slurmtest",
    "model=tiny",
    "data.max_prompt_tokens=56",  # with 8 new tokens, within the tiny model's 64 positions
    "rollout.max_new_tokens=8",
]


def test_slurms_refusal_names_the_key_to_change():
    plan = make_plan(compose_config(TINY))
    said = refusal(
        "sbatch: error: invalid partition specified: nope\nallocation failure: Invalid partition name specified\n"
    )
    assert said == "Invalid partition name specified"
    assert fix_for(plan, said) == "change cluster.slurm.partition (now 'debug')"
    time = "Requested time limit is invalid (missing or exceeds some limit)"
    assert fix_for(plan, time) == "change cluster.slurm.time (now '00:30:00')"
    nodes = fix_for(plan, "Requested node configuration is not available")
    assert nodes.startswith("the job asks for 1 node(s) of 1 GPU(s) and 2 CPUs each") and "layout." in nodes
    # KillWait shorter than a save warns; as long as one, or unknown (no scontrol), does not
    needed = save_seconds(plan)
    line = kill_wait_warning(plan, 5)
    assert line is not None and line.startswith(
        f"Slurm's KillWait is 5 s but one save of this run takes ~{needed:.0f} s"
    )
    assert "`hpcrl cancel JOB` (or `scancel --signal=TERM JOB`)" in line
    assert kill_wait_warning(plan, int(needed) + 1) is None and kill_wait_warning(plan, None) is None


def test_a_slurm_that_cannot_be_asked_refuses_nothing(tmp_path, monkeypatch):
    """The real sbatch with no configuration here (this test has no cluster) fails; that is no refusal:
    plan and render go on (the real submission says what is wrong), at once."""
    assert shutil.which("sbatch"), "the Slurm client comes with the test cluster's tools"
    script = tmp_path / "sbatch.sh"
    script.write_text("#!/bin/bash\n#SBATCH --partition=nope\nhostname\n")
    monkeypatch.delenv("SLURM_CONF", raising=False)
    asked = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True)
    assert asked.returncode != 0 and "fatal: Could not establish a configuration source" in asked.stderr
    assert slurm_refusal(script) is None
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "gone.conf"))
    start = time.monotonic()
    assert slurm_refusal(script) is None
    assert time.monotonic() - start < 1  # not asked: sbatch would retry a missing file for a minute


def _submit(tmp_path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return run_cli("submit", *TINY, f"run.output_root={tmp_path}", "run.name=gate", *overrides)


def _queued(name: str) -> list[str]:
    return subprocess.run(
        ["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True
    ).stdout.split()


@pytest.mark.slow
def test_a_job_slurm_would_refuse_is_one_line_and_never_queued(slurm_cluster, tmp_path, monkeypatch):
    assert kill_wait_s() == 5
    # plan and render ask Slurm first: the same line, and render writes no file
    said = (
        "hpcrl: error: Slurm would refuse this job (sbatch --test-only: Invalid partition name specified); "
        "change cluster.slurm.partition (now 'nope'); nothing was written"
    )
    rendered = tmp_path / "rendered"
    for command, *extra in (["plan"], ["render", "--out", str(rendered)]):
        asked = run_cli(command, *extra, *TINY, f"run.output_root={tmp_path}", "cluster.slurm.partition=nope")
        assert asked.returncode == 2, asked.stderr
        assert [x for x in asked.stderr.splitlines() if x.startswith("hpcrl: error:")] == [said], asked.stderr
    assert not rendered.exists()
    refused = _submit(tmp_path, "cluster.slurm.partition=nope")
    assert refused.returncode == 2, refused.stderr
    (line,) = [x for x in refused.stderr.splitlines() if x.startswith("hpcrl: error:")]
    assert line.startswith(
        "hpcrl: error: Slurm would refuse this job (sbatch --test-only: Invalid partition name specified); "
        "change cluster.slurm.partition (now 'nope'); nothing was submitted (the script stays: "
    ), line
    (script,) = tmp_path.glob("**/sbatch.sh")  # the run directory's files stay
    assert line.endswith(f"{script})") and "#SBATCH --partition=nope" in script.read_text()
    assert "hpcrl: warning: Slurm's KillWait is 5 s but one save" in refused.stderr  # said before the refusal
    # a node shape no partition has
    big = _submit(tmp_path, "cluster.cpus_per_node=64")
    assert big.returncode == 2, big.stderr
    assert (
        "(sbatch --test-only: Requested node configuration is not available); the job asks for 1 node(s)"
        in (big.stderr)
    )
    assert "cluster.cpus_per_node" in big.stderr
    planned = run_cli("plan", *TINY, "cluster.cpus_per_node=64")
    assert planned.returncode == 2 and "(sbatch --test-only: Requested node configuration" in planned.stderr
    _sweeps_ask_every_point(tmp_path, monkeypatch)
    assert _queued("gate") == []


def _sweeps_ask_every_point(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``submit -m`` and ``render -m`` ask Slurm of every point, once each, before any is submitted: a
    refused point is named, and submit -m writes nothing (render -m writes the points that pass). sbatch
    is the real one behind a wrapper that notes each call."""
    calls, bin_dir = tmp_path / "sbatch-calls", tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "sbatch"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {shutil.which("sbatch")} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    root = tmp_path / "sweep"
    sweep = ["-m", *TINY, f"run.output_root={root}", "run.name=gate", "cluster.slurm.partition=debug,nope"]
    refused = run_cli("submit", *sweep)
    assert refused.returncode == 2, refused.stderr
    (line,) = [x for x in refused.stderr.splitlines() if x.startswith("hpcrl: error:")]
    assert line == (
        "hpcrl: error: sweep point 1 (cluster.slurm.partition=nope): Slurm would refuse this job (sbatch "
        "--test-only: Invalid partition name specified); change cluster.slurm.partition (now 'nope'); "
        "nothing was written; nothing was submitted"
    )
    asked = calls.read_text().splitlines()
    assert len(asked) == 2, asked
    assert all(a.startswith("--test-only ") for a in asked), asked  # one a point
    assert not root.exists()
    shown = run_cli("render", *sweep)
    assert shown.returncode == 1, shown.stderr
    rows = shown.stdout.splitlines()
    assert " fits (" in rows[1]
    assert "refused: Slurm would refuse this job (sbatch --test-only: Invalid" in rows[2]
    assert "1 of 2 point(s) would be refused" in rows[-1]
    (preview,) = (root / "sweeps").iterdir()
    assert [p.name for p in preview.iterdir()] == ["p0"]
    assert len(calls.read_text().splitlines()) == 4


@pytest.mark.slow
def test_an_accepted_job_is_queued_with_the_kill_wait_warning(slurm_cluster, tmp_path):
    done = _submit(tmp_path)
    assert done.returncode == 0, done.stderr
    job_id = re.search(r"^job\s+(\d+)", done.stdout, re.M).group(1)
    subprocess.run(["scancel", job_id], check=True)  # what it runs is not this test's
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("hpcrl: warning: Slurm's KillWait")]
    assert "a plain `scancel` kills the job before its save completes" in line
