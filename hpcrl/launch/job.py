"""What runs inside the Slurm job: one submitit task per node.

Every node checks in (``<run dir>/nodes/<id>.json``: role, host, GPUs), proves it sees the shared
filesystem, and starts Ray: node 0 the head, the others join. Node 0 waits for the whole cluster,
runs the driver, then tells the others to stop. Any node whose Ray dies ends its task non-zero with a
message that names it, and srun's --kill-on-bad-exit ends the job: no allocation idles on a hang.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from hpcrl.config.cluster import BootstrapConfig
from hpcrl.launch.doctor import Expect, report
from hpcrl.launch.ports import listening_ports
from hpcrl.launch.ray_cluster import (
    GCS_PORT,
    BootstrapError,
    auth_env,
    cluster_gpus,
    start_node,
    this_node,
    wait_for_cluster,
)
from hpcrl.plan.planner import Plan
from hpcrl.run.preempt import EXIT_PREEMPTED, Preempted


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _wait_for(path: Path, deadline_s: float, what: str) -> None:
    start = time.monotonic()
    while not path.exists():
        if time.monotonic() - start > deadline_s:
            raise BootstrapError(what)
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the Ray processes this node started: their reaper stops the whole group (reaper.py; it
    holds SIGTERM, which scancel sends to every process, so it is asked with SIGINT)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=6)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _terminated(signum: int, _frame: Any) -> None:
    raise SystemExit(f"hpcrl: node task got signal {signum} (job cancelled or out of time); stopping Ray")


class _Where:
    def where(self, role: str) -> dict[str, Any]:
        import ray

        return {
            "role": role,
            "host": socket.gethostname(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "listening": listening_ports(),
        }


def probe_placement(roles: list[str]) -> list[dict[str, Any]]:
    """Driver of this increment: one actor per node, placed by its role resource; where did each run?

    Actors (not tasks) hold their GPU while alive, so each lands on its own node."""
    import ray

    from hpcrl.run.actors import ENV_RESOURCE, JUDGE_RESOURCE, ROLLOUT_RESOURCE, TRAIN_RESOURCE

    actor_cls = ray.remote(num_cpus=0)(_Where)
    resource = {"rollout": ROLLOUT_RESOURCE, "judge": JUDGE_RESOURCE, "env": ENV_RESOURCE}
    actors = [
        actor_cls.options(
            num_gpus=0 if role == "env" else 1, resources={resource.get(role, TRAIN_RESOURCE): 1}
        ).remote()
        for role in roles
    ]
    placement = list(ray.get([a.where.remote(role) for a, role in zip(actors, roles, strict=True)]))
    for actor in actors:
        ray.kill(actor)
    return sorted(placement, key=lambda p: (p["role"] != "rollout", p["host"]))


def attempt_key() -> str:
    """The job id, plus the restart count once Slurm has requeued it: each attempt gets its own
    check-in, head and ready files (a requeued job may land on other nodes)."""
    job_id = os.environ.get("SLURM_JOB_ID", "local")
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    return job_id if restart == 0 else f"{job_id}.r{restart}"


class NodeTask:
    """Picklable callable: submitit runs it once on every node of the allocation."""

    def __init__(
        self,
        run_dir: str,
        roles: list[str],
        plan: Plan | None,
        hold_s: float = 0.0,
        *,
        bootstrap: BootstrapConfig,
        expect: Expect | None = None,
    ) -> None:
        self._driver: Any = None
        self._head_node = False
        """The thread running the training loop on the head node (only while it runs)."""
        self.run_dir = run_dir
        self.roles = roles
        self.plan = plan
        """What the driver trains; None: a smoke run that only places one actor per node by role."""
        self.hold_s = hold_s
        """Keep the Ray cluster up this long after the driver (debugging; the seed of `hpcrl debug`)."""
        self.bootstrap = bootstrap
        """The start-up deadlines (``cluster.bootstrap``): smoke and debug jobs have no plan, but wait too."""
        self.expect = expect
        """What ``hpcrl doctor`` checks on every node before Ray starts (None: no check)."""

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_driver": None}  # a thread does not pickle (submitit pickles tasks)

    def __call__(self) -> dict[str, Any]:
        # scancel / the time limit end a job with SIGTERM (submitit would ignore it): unwind, so the
        # ``finally`` blocks stop this node's Ray at once instead of waiting for Slurm's SIGKILL.
        signal.signal(signal.SIGTERM, _terminated if self.plan is None else self._on_term)
        run_dir, job_id = Path(self.run_dir), attempt_key()
        spec = this_node(self.roles, self.expect.node_gpus if self.expect is not None else [])
        self._head_node = spec.node_id == 0
        self._doctor(spec)
        record = {
            "node_id": spec.node_id,
            "role": spec.role,
            "host": spec.host,
            "ip": spec.ip,
            "job_id": job_id,
            "step": os.environ.get("SLURM_STEP_ID", ""),  # `hpcrl cancel` of a --here session stops it
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            "time": time.time(),
        }
        _write(run_dir / "nodes" / f"{spec.node_id}.json", record)
        print(f"hpcrl: node {spec.node_id} ({spec.host}) checked in as {spec.role}", flush=True)
        canary = run_dir / f".canary-{job_id}"
        if spec.node_id == 0:
            _write(canary, {"host": spec.host})
        _wait_for(
            canary,
            self.bootstrap.shared_dir_s,
            f"node {spec.node_id} ({spec.host}) cannot see the shared run directory {run_dir} "
            f"after {self.bootstrap.shared_dir_s:g}s (cluster.bootstrap.shared_dir_s)",
        )
        head_file = run_dir / "ray" / f"head-{job_id}.json"
        done_file = run_dir / "ray" / f"done-{job_id}"
        if spec.node_id == 0:
            return self._head(spec, run_dir, job_id, head_file, done_file)
        _wait_for(
            head_file,
            self.bootstrap.ray_head_s,
            f"node {spec.node_id} ({spec.host}): the Ray head did not come up within "
            f"{self.bootstrap.ray_head_s:g}s (cluster.bootstrap.ray_head_s)",
        )
        head_ip = json.loads(head_file.read_text())["ip"]
        proc = start_node(spec, run_dir, head_ip, job_id)
        while not done_file.exists():
            if proc.poll() is not None and not done_file.exists():
                raise BootstrapError(
                    f"Ray on node {spec.node_id} ({spec.host}) exited with code {proc.returncode}"
                )
            time.sleep(0.2)
        _stop(proc)
        return record

    def _doctor(self, spec: Any) -> None:
        """The job's first step: this node against the plan (``hpcrl doctor``); a failure ends the task
        (and, through srun's --kill-on-bad-exit, the job) before Ray starts."""
        if self.expect is None:
            return
        expect = self.expect.for_node(spec.node_id, spec.role)  # its own GPUs; none on an environment node
        failed: list[str] = []

        def say(line: str) -> None:
            print(f"hpcrl doctor: {line}", flush=True)
            if line.startswith("FAIL"):
                failed.append(line)

        if not report(expect, say):
            raise BootstrapError(
                f"node {spec.node_id} ({spec.host}) failed hpcrl doctor: {' | '.join(failed)}"
            )

    def _on_term(self, signum: int, frame: Any) -> None:
        """SIGTERM (``scancel``; Slurm sends it to every process of the job, more than once) in a
        training job. The head: the driver saves the step it is in and stops (``Preempted``, exit 143);
        before or after the driver, the task ends at once. Other nodes keep their Ray up (the reaper
        holds SIGTERM from it, ``reaper.py``) until the head is done or Slurm's SIGKILL comes."""
        from hpcrl.run.preempt import REQUEST, WHY

        driving = self._driver is not None and self._driver.is_alive()
        if self._head_node and not driving:
            _terminated(signum, frame)
        if not REQUEST.asked:
            what = (
                "saving after the current step, then stopping" if driving else "keeping Ray up for the save"
            )
            print(f"hpcrl: {WHY[signal.SIGTERM]}: {what}", flush=True)
        REQUEST.ask(signal.SIGTERM)

    def checkpoint(self) -> Any:
        """submitit calls this on the time-limit/preemption signal (USR2), on the head node's main
        thread: ask the driver (its own thread) to checkpoint the step it is in and stop, wait for that
        within the warning time, then requeue the same task. The next attempt resumes from that
        checkpoint (same run directory); if the step could not finish in time, from the last periodic
        one. Debug sessions and smoke jobs are not requeued."""
        if self.plan is None:
            return None
        from submitit.helpers import DelayedSubmission

        from hpcrl.run.preempt import REQUEST

        if self._driver is not None and self._driver.is_alive():
            budget = max(10.0, self.plan.cfg.cluster.slurm.signal_delay_s - 30.0)  # leave time to requeue
            print(  # before asking: the log then orders this line before the step that saves
                f"hpcrl: warning signal: saving after the current step (waiting up to {budget:.0f}s)",
                flush=True,
            )
            REQUEST.ask()
            saved = REQUEST.wait(budget)
            print(
                f"hpcrl: {'saved step ' + str(REQUEST.step) if saved else 'no save in time'}; requeueing",
                flush=True,
            )

        return DelayedSubmission(
            NodeTask(
                self.run_dir, self.roles, self.plan, self.hold_s, bootstrap=self.bootstrap, expect=self.expect
            )
        )

    def _drive(self, run_dir: Path, address: str) -> dict[str, float]:
        import ray

        from hpcrl.run.driver import run_loop

        assert self.plan is not None

        def connect(_scratch: Path) -> None:
            ray.shutdown()  # the readiness poll's quiet connection; the driver wants its actors' output
            ray.init(address=address, log_to_driver=True, configure_logging=False)

        return run_loop(self.plan, run_dir, connect, slurm=True)

    def _drive_in_thread(self, run_dir: Path, address: str, proc: Any) -> dict[str, float]:
        """The driver in a thread, so that this (main) thread stays free for Slurm's signals: USR2
        must be able to wait for the loop's save (``checkpoint``). Ends like the driver ends."""
        import threading

        outcome: dict[str, Any] = {}

        def drive() -> None:
            try:
                outcome["metrics"] = self._drive(run_dir, address)
            except BaseException as exc:  # handed to the main thread
                outcome["error"] = exc

        self._driver = threading.Thread(target=drive, name="hpcrl-driver", daemon=True)
        self._driver.start()
        try:
            while self._driver.is_alive():
                self._driver.join(timeout=0.5)
                # ray.init (in the driver thread) puts Ray's own SIGTERM handler in, under Python's: a
                # stack dump, then death, unsaved. Put ours back (only this thread may).
                signal.signal(signal.SIGTERM, self._on_term)
                if proc.poll() is not None:  # the head's Ray died under the driver
                    raise BootstrapError(f"Ray on node 0 exited with code {proc.returncode}")
        finally:
            self._driver = None
        error = outcome.get("error")
        if isinstance(error, Preempted) and error.exit_code != EXIT_PREEMPTED:  # SIGTERM: not requeued
            print(f"hpcrl: {error}", flush=True)
            raise SystemExit(error.exit_code)
        if error is not None:
            raise error
        return outcome["metrics"]

    def _head(
        self, spec: Any, run_dir: Path, job_id: str, head_file: Path, done_file: Path
    ) -> dict[str, Any]:
        started = time.monotonic()
        proc = start_node(spec, run_dir, spec.ip, job_id)
        try:
            _write(head_file, {"ip": spec.ip, "port": GCS_PORT})
            os.environ.update(auth_env(run_dir / "ray" / "token"))
            # each node's own GPUs: a heterogeneous job's components may differ
            gpus = cluster_gpus(self.roles, self.expect.node_gpus if self.expect else [], spec.gpus)
            waited = wait_for_cluster(
                f"{spec.ip}:{GCS_PORT}", len(self.roles), gpus, self.bootstrap.ray_nodes_s, proc
            )
            ready_s = time.monotonic() - started
            job_start = float(os.environ.get("HPCRL_JOB_START", "nan"))
            _write(
                run_dir / "ray" / f"ready-{job_id}.json",
                {"seconds": ready_s, "polled_s": waited, "since_job_start_s": time.time() - job_start},
            )
            print(f"hpcrl: Ray ready with {len(self.roles)} nodes after {ready_s:.1f}s", flush=True)
            if self.plan is None:
                placement = probe_placement(self.roles)
                _write(run_dir / "placement.json", {"actors": placement})
                result: dict[str, Any] = {"ready_s": ready_s, "placement": placement}
            else:
                result = {
                    "ready_s": ready_s,
                    "metrics": self._drive_in_thread(run_dir, f"{spec.ip}:{GCS_PORT}", proc),
                }
            held = time.monotonic()
            while time.monotonic() - held < self.hold_s:
                if proc.poll() is not None:
                    raise BootstrapError(f"Ray on node 0 ({spec.host}) exited with code {proc.returncode}")
                time.sleep(0.2)
            return result
        finally:
            done_file.touch()
            _stop(proc)
