"""Before submit: room for the run's checkpoints on their filesystem, as the plan estimates them
(the job's doctor checks it again on each node, where the path may only be visible there)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from hpcrl.config.cluster import Scheduler
from hpcrl.errors import ConfigError
from hpcrl.launch.doctor import GB, ROOM_FIX, size_text
from hpcrl.plan.planner import Plan
from hpcrl.plan.savetime import checkpoint_gb


def check_room(plan: Plan, run_dir: Path | None, warn: Callable[[str], None]) -> None:
    """Before submit, where this machine sees the checkpoints' filesystem (a path of which only ``/``
    exists here is the nodes' to check: the job's doctor): room for ``keep_top_k + 1`` checkpoints (the
    kept ones and the latest), else one ConfigError line for a local run, a warning for a cluster's (its
    nodes may mount another filesystem at that path; their doctor refuses it there); a warning below the
    doctor's figure (one more, the save being written). ``run_dir``: the run's directory (checkpoints under it unless
    ``checkpoint.dir``); None: somewhere under ``run.output_root``."""
    cfg = plan.cfg
    if not cfg.checkpoint.enabled:
        return
    where = Path(cfg.checkpoint.dir or run_dir or cfg.run.output_root).expanduser().absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    if where == where.parent:
        return
    one, k = checkpoint_gb(plan), cfg.checkpoint.keep_top_k
    free = shutil.disk_usage(where).free / GB
    said = f"{size_text(free)} free at {where}; one checkpoint of this model takes {size_text(one)}"
    key = "checkpoint.keep_top_k"
    if free < one * (k + 1):
        line = f"{key}={k} keeps {k + 1} checkpoints, {size_text(one * (k + 1))}: {said}; {ROOM_FIX}"
        if cfg.cluster.scheduler is not Scheduler.local:  # the nodes may mount another filesystem there
            return warn(f"{line} (if the job's nodes see this filesystem there: their doctor refuses it)")
        raise ConfigError(line)
    if free < one * (k + 2):
        warn(f"{key}={k}: room for {k + 1} checkpoints but not the next one being written ({said})")
