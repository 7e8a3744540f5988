"""What Slurm itself says before ``hpcrl submit`` hands it a job (issue 37).

- ``sbatch --test-only`` on the written script: a request Slurm would refuse (an unknown partition, a
  node shape no partition has, more nodes than it holds, a time over its limit) is one ConfigError line
  with Slurm's words and the key to change, before anything is queued; the run directory's files stay.
- ``KillWait`` (``scontrol show config``): a plain ``scancel`` sends SIGTERM, then SIGKILL that many
  seconds later. Shorter than one save of the run (plan/savetime.py), the save is cut off: a warning.

Both skip quietly where Slurm's commands are not on PATH (rendering elsewhere, tests without a cluster).
"""

from __future__ import annotations

import re
import shutil
import subprocess
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


def require_accepted(plan: Plan, script: Path) -> None:
    """``sbatch --test-only script``: Slurm's refusal as one ConfigError line naming the key to change."""
    if shutil.which("sbatch") is None:
        return
    try:
        asked = subprocess.run(
            ["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return  # no answer is no refusal: the real submission reports its own failure
    if asked.returncode == 0:
        return
    said = refusal(asked.stdout + asked.stderr)
    raise ConfigError(
        f"Slurm would refuse this job (sbatch --test-only: {said}); {fix_for(plan, said)}; nothing was "
        f"submitted (the script stays: {script})"
    )


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
