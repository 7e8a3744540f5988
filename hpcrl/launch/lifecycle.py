"""Job lifecycle: state, logs, cancel and a listing of recent runs. A Kubernetes job (``job.json``'s
``scheduler: kuberay``) is asked about through the API instead (``launch/kube_jobs.py``).

State comes from ``squeue``; a job that left the queue is looked up in accounting (``sacct``, which
remembers it for good) and, on clusters without slurmdbd, with ``scontrol show job`` (which forgets
it after MinJobAge); a job no longer known to Slurm is reported from what its run directory holds, so
nothing here waits on a job that died without a result.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.errors import HpcrlError
from hpcrl.launch.jobrecord import JOBS_INDEX
from hpcrl.launch.sbatch import SUBMITIT_DIR

ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    run_dir: Path
    state: str
    nodes: int
    name: str
    submitted: float


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return ""


def job_state(job_id: str, run_dir: Path | None = None) -> str:
    state = _run(["squeue", "-h", "-j", job_id, "-o", "%T"]).strip()
    if state:
        return state.splitlines()[0]
    accounted = sacct_state(job_id)
    if accounted:
        return accounted
    match = re.search(r"JobState=(\S+)", _run(["scontrol", "show", "job", job_id]))
    if match:
        return match.group(1)
    if run_dir is not None:  # forgotten by Slurm: judge by what submitit left behind
        results = list((run_dir / SUBMITIT_DIR).glob(f"{job_id}_*_result.pkl"))
        return "ENDED (results present)" if results else "ENDED (no result)"
    return "UNKNOWN"


def sacct_state(job_id: str) -> str:
    """The job's state from Slurm accounting, or "" when the cluster has none (sacct fails) or
    has no record of it. "CANCELLED by 0" is reported as CANCELLED."""
    out = _run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "JobID,State"])
    for line in out.splitlines():
        jid, _, state = line.partition("|")
        if jid == job_id and state:
            return state.split()[0]
    return ""


def run_dir_of(job_id: str, root: Path) -> Path:
    entry = root / JOBS_INDEX / job_id
    if not entry.exists():
        raise HpcrlError(
            f"no run of job {job_id} under {root}/; pass --root <run.output_root> if it is elsewhere"
        )
    return Path(entry.read_text().strip())


def _meta(run_dir: Path) -> dict[str, Any]:
    return dict(json.loads((run_dir / "job.json").read_text()))


def _on_kube(meta: dict[str, Any]) -> bool:
    return meta.get("scheduler") == "kuberay"


def info(job_id: str, root: Path) -> JobInfo:
    run_dir = run_dir_of(job_id, root)
    meta = _meta(run_dir)
    return JobInfo(
        job_id, run_dir, any_state(job_id, run_dir), meta["nodes"], meta["name"], meta["submitted"]
    )


def recent(root: Path, limit: int = 20) -> list[JobInfo]:
    index = root / JOBS_INDEX
    if not index.exists():
        return []
    entries = sorted(index.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)[:limit]
    return [info(p.name, root) for p in entries]


def log_texts(job: JobInfo) -> list[tuple[str, str]]:
    """Each log's place and text: a Slurm job's per-node files, a Kubernetes job's driver log."""
    meta = _meta(job.run_dir)
    if _on_kube(meta):
        from hpcrl.launch import kube_jobs

        return kube_jobs.logs(meta, job.run_dir)
    return [(str(p), p.read_text() if p.exists() else "(not written yet)") for p in log_paths(job)]


def log_paths(job: JobInfo) -> list[Path]:
    return [
        job.run_dir / SUBMITIT_DIR / f"{job.job_id}_{i}_log.{ext}"
        for i in range(job.nodes)
        for ext in ("out", "err")
    ]


def here_step(run_dir: Path) -> str | None:
    """``JOB.STEP`` of a ``debug --here`` session's Ray step (None: a job of its own); "" before the head
    checked in."""
    meta = json.loads((run_dir / "job.json").read_text())
    if not meta.get("here"):
        return None
    head = run_dir / "nodes" / "0.json"
    step = json.loads(head.read_text()).get("step", "") if head.exists() else ""
    return f"{meta['job_id']}.{step}" if step else ""


def step_running(step: str) -> bool:
    job_id = step.split(".")[0]
    return step in _run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i"]).split()


def cancel(job: JobInfo) -> str:
    """scancel the job, or only the Ray step of a ``debug --here`` session (the allocation is the
    user's), or delete a Kubernetes job; what was cancelled. A training job whose tasks run gets
    SIGTERM alone (``scancel --signal=TERM``): it saves the step in flight and ends (a plain scancel
    SIGKILLs it ``KillWait`` seconds later, often before the save is done)."""
    meta = _meta(job.run_dir)
    if _on_kube(meta):
        from hpcrl.launch import kube_jobs

        return kube_jobs.cancel(meta)
    step = here_step(job.run_dir)
    if step == "":
        raise HpcrlError(f"debug session {job.job_id} has no Ray step yet; leaving its shell stops it")
    target = step or job.job_id
    saves = step is None and not meta.get("debug") and tasks_running(job.job_id)
    command = ["scancel", "--signal=TERM", target] if saves else ["scancel", target]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise HpcrlError(f"{' '.join(command)} failed: {result.stderr.strip()}")
    if saves:
        return f"{target} with SIGTERM: it saves the step in flight, then ends (`scancel {target}`: unsaved)"
    return target if step is None else f"step {target} (the allocation stays yours)"


def tasks_running(job_id: str) -> bool:
    """Whether the job's node tasks run (a step of its own, e.g. ``123.0`` or ``123+0.0``, not only
    the batch script): a signal sent to the steps reaches them."""
    steps = _run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i"]).split()
    return any(re.fullmatch(rf"{job_id}(\+\d+)?\.\d+", s) for s in steps)


def wait(job_id: str, run_dir: Path | None, timeout_s: float) -> str:
    """Poll until the job leaves the active states (or the deadline passes); returns the last state."""
    deadline = time.monotonic() + timeout_s
    state = any_state(job_id, run_dir)
    while state.split()[0] in ACTIVE and time.monotonic() < deadline:
        time.sleep(5.0 if _kube_meta(run_dir) else 0.5)  # spare the Kubernetes API server
        state = any_state(job_id, run_dir)
    return state


def _kube_meta(run_dir: Path | None) -> dict[str, Any] | None:
    """``job.json`` of a Kubernetes job; None for a Slurm job (or no run directory)."""
    if run_dir is None or not (run_dir / "job.json").exists():
        return None
    meta = _meta(run_dir)
    return meta if _on_kube(meta) else None


def any_state(job_id: str, run_dir: Path | None) -> str:
    """``job_state`` of a Slurm job, the RayJob's state of a Kubernetes one."""
    meta = _kube_meta(run_dir)
    if meta is not None and run_dir is not None:
        from hpcrl.launch import kube_jobs

        return kube_jobs.state(meta, run_dir)
    return job_state(job_id, run_dir)


def print_recent(root: Path) -> None:
    """``hpcrl ls``: one line a recent job, newest first."""
    jobs = recent(root)
    if not jobs:
        print(f"no runs under {root}/")
    for job in jobs:
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(job.submitted))
        print(
            f"{job.job_id:>8}  {job.state:<24} {job.nodes:>3} node(s)  {started}  {job.name}  {job.run_dir}"
        )
