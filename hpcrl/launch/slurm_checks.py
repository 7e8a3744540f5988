"""What Slurm itself says before ``hpcrl submit`` hands it a job (issue 37).

- ``sbatch --test-only`` on the written script: a request Slurm would refuse (an unknown partition, a
  node shape no partition has, more nodes than it holds, a time over its limit) is one ConfigError line
  with Slurm's words and the key to change, before anything is queued; the run directory's files stay.
  ``hpcrl plan`` and ``render`` ask the same of the script's text from a temporary file, before writing
  anything: a script Slurm refuses is never left in a run directory as if it could be submitted.
- ``KillWait`` (``scontrol show config``): a plain ``scancel`` sends SIGTERM, then SIGKILL that many
  seconds later. Shorter than one save of the run (plan/savetime.py), the save is cut off: a warning.

Both skip quietly where Slurm's commands are not on PATH (rendering elsewhere), and the first where
Slurm cannot be asked (no configuration here, controller or munge down: the submission itself says so).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from hpcrl.errors import ConfigError
from hpcrl.launch.hetjob import components
from hpcrl.plan.planner import Plan
from hpcrl.plan.savetime import save_seconds

REFUSALS = (
    ("partition", "cluster.slurm.partition"),
    ("time limit", "cluster.slurm.time"),
    ("account", "cluster.slurm.account"),
    ("qos", "cluster.slurm.qos"),
    ("feature", "cluster.slurm.constraint"),
    ("reservation", "cluster.slurm.reservation"),
)
"""Words of Slurm's refusal -> the key that set what it refused."""


def kill_wait_s() -> int | None:
    """Slurm's ``KillWait`` in seconds; None where ``scontrol`` is missing or does not say."""
    if shutil.which("scontrol") is None:
        return None
    try:
        shown = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"^KillWait\s*=\s*(\d+)", shown.stdout, re.M)
    return int(found.group(1)) if found else None


def kill_wait_warning(plan: Plan, kill_wait: int | None) -> str | None:
    """One line where ``kill_wait`` seconds cannot hold one save of this run; else None."""
    needed = save_seconds(plan)
    if kill_wait is None or kill_wait >= needed:
        return None
    return (
        f"Slurm's KillWait is {kill_wait} s but one save of this run takes ~{needed:.0f} s (hpcrl plan's "
        "checkpoint line): a plain `scancel` kills the job before its save completes; stop it with "
        "`hpcrl cancel JOB` (or `scancel --signal=TERM JOB`), which lets it save"
    )


UNREACHABLE = (
    "fatal:",
    "unable to contact slurm controller",
    "authentication error",
    "munge",
    "socket timed out",
    "communication connection failure",
)
"""Words of sbatch's output when Slurm could not be asked (not a refusal of the job)."""


def require_accepted(plan: Plan, script: Path, *, after: str = "") -> None:
    """``sbatch --test-only script``: Slurm's refusal as one ConfigError line naming the key to change;
    ``after``: what became of the run's files (default: submit's, the script stays)."""
    said = slurm_refusal(script)
    if said is None:
        return
    raise ConfigError(
        f"Slurm would refuse this job (sbatch --test-only: {said}); {fix_for(plan, said)}; "
        + (after or f"nothing was submitted (the script stays: {script})")
    )


def require_accepted_text(plan: Plan, run_dir: Path) -> None:
    """``hpcrl plan`` and ``render``: the script submit would write for ``run_dir``, tested from a
    temporary file, so that a refused one is never written. Nothing is rendered where sbatch is missing."""
    if shutil.which("sbatch") is None:
        return
    from hpcrl.launch.sbatch import render_sbatch  # submitit: only where there is a Slurm to ask

    with tempfile.TemporaryDirectory(prefix="hpcrl-test-only-") as tmp:
        script = Path(tmp) / "sbatch.sh"
        script.write_text(render_sbatch(plan, run_dir.resolve()))
        require_accepted(plan, script, after="nothing was written")


def slurm_refusal(script: Path) -> str | None:
    """Slurm's reason for refusing ``script``; None where it accepts it or cannot be asked."""
    conf = os.environ.get("SLURM_CONF")
    if shutil.which("sbatch") is None or (conf and not Path(conf).is_file()):
        return None  # a SLURM_CONF that is not there: sbatch would retry it for a minute
    try:
        asked = subprocess.run(
            ["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None  # no answer is no refusal: the real submission reports its own failure
    said = asked.stdout + asked.stderr
    if asked.returncode == 0 or any(words in said.lower() for words in UNREACHABLE):
        return None
    return refusal(said)


def refusal(output: str) -> str:
    """Slurm's reason: the last ``allocation failure:``/``error:`` line, without the prefix."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    reasons = [re.sub(r"^(sbatch: )?(error: |allocation failure: )", "", line) for line in lines]
    chosen = [r for r, line in zip(reasons, lines, strict=True) if "allocation failure" in line] or reasons
    return chosen[-1] if chosen else "no reason given"


def fix_for(plan: Plan, said: str) -> str:
    """What to change for Slurm's reason ``said``."""
    cluster = plan.cfg.cluster
    low = said.lower()
    for words, key in REFUSALS:
        if words in low:
            value = getattr(cluster.slurm, key.rsplit(".", 1)[1])
            other = (
                " or its node kind's (cluster.rollout_node, cluster.judge_node)" if components(plan) else ""
            )
            return f"change {key} (now {value!r}){other}"
    if "node configuration" in low or "node count" in low:
        return (
            f"the job asks for {plan.job_nodes} node(s) of {cluster.gpus_per_node} GPU(s) and "
            f"{cluster.cpus_per_node} CPUs each: fewer nodes (layout.*, cluster.max_nodes) or the "
            "partition's node shape (cluster.gpus_per_node, cluster.cpus_per_node, cluster.slurm.*)"
        )
    return "check cluster.slurm.* and the layout against what the partition offers"
