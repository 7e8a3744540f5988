"""Issue 39 item 3: the RayJob's driver (``hpcrl.launch.kube_entry``) on a real Ray cluster, and a Spot
preemption's save and retry. ``hpcrl submit`` creates the RayJob on the API STAND-IN (no API server runs
here); the test then plays KubeRay with real processes on loopback: ``ray start --block`` for the head and
the worker group with the manifest's own ``rayStartParams`` (and the CPUs of its container limits), the
Ray token from the Secret submit created, the pods' environment, and the manifest's ``entrypoint`` run
as Ray's job server runs a driver (``RAY_ADDRESS`` set to the cluster). Every process it starts it stops
by its process group at the end."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from hpcrl.run.preempt import EXIT_PREEMPTED
from tests.harness.kube_standin import KubeStandIn
from tests.launch.test_kube_jobs import hpcrl, overrides

pytestmark = pytest.mark.slow

STEPS = 30
RECIPE = ["data.max_prompt_tokens=16", "rollout.max_new_tokens=8", "algo.num_prompts_per_step=16"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node_ports() -> list[str]:
    """Ports of one node's Ray processes: free ones, not Ray's fixed defaults (the head and the worker
    share this machine, and other sessions may run Ray on it too)."""
    names = [
        "node-manager-port",
        "object-manager-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "runtime-env-agent-port",
        "metrics-export-port",
    ]
    return [f"--{name}={_free_port()}" for name in names]


def _pod_env(container: dict[str, Any], token_file: Path, scratch: Path) -> dict[str, str]:
    env = {**os.environ}
    for var in container["env"]:
        env[var["name"]] = var["value"]
    env["RAY_AUTH_TOKEN_PATH"] = str(token_file)  # the Secret's mount, here a file of the same token
    env["HPCRL_CACHE"] = str(scratch / "cache")
    return env


@contextmanager
def ray_cluster(job: dict[str, Any], token_file: Path, scratch: Path) -> Iterator[dict[str, str]]:
    """The RayJob's RayCluster as processes here: the head, then every worker group's replicas; yields the
    environment its driver gets. Stopped (process groups, SIGTERM then SIGKILL) on the way out."""
    spec = job["spec"]["rayClusterSpec"]
    head_pod = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="hk-", dir="/tmp")  # short: Ray's socket paths are length-limited
    ray = str(Path(sys.executable).with_name("ray"))
    procs: list[subprocess.Popen[bytes]] = []
    log = (scratch / "ray.log").open("ab")

    def start(args: list[str], container: dict[str, Any]) -> None:
        cmd = [
            ray,
            "start",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--temp-dir={temp}",
            *_node_ports(),
            *args,
        ]
        env = _pod_env(container, token_file, scratch)
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )

    try:
        head = spec["headGroupSpec"]["rayStartParams"]
        # the head's job server (dashboard) is not started: the test runs the entrypoint itself
        start(
            ["--head", f"--port={port}", f"--num-cpus={head['num-cpus']}", "--include-dashboard=false"],
            head_pod,
        )
        workers = 0
        for group in spec["workerGroupSpecs"]:
            container = group["template"]["spec"]["containers"][0]
            params = group["rayStartParams"]
            cpus = container["resources"]["limits"]["cpu"]  # KubeRay's --num-cpus: the container's limit
            for _ in range(group["replicas"]):
                args = [
                    f"--address=127.0.0.1:{port}",
                    f"--num-cpus={cpus}",
                    f"--num-gpus={params['num-gpus']}",
                ]
                start([*args, f"--resources={params['resources']}"], container)
                workers += 1
        env = _pod_env(head_pod, token_file, scratch)
        env["RAY_ADDRESS"] = f"127.0.0.1:{port}"  # what Ray's job server gives the driver it starts
        _wait_for_nodes(env, 1 + workers, procs)
        yield env
    finally:
        _stop_groups(procs)
        log.close()
        subprocess.run(["rm", "-rf", temp], check=False)


def _stop_groups(procs: list[subprocess.Popen[bytes]]) -> None:
    """All nodes at once, as a RayCluster's deletion stops its pods, not one after another."""
    for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        for proc in procs:  # the group: a node's raylet and workers may outlive its `ray start`
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait_s
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
        if all(proc.poll() is not None for proc in procs):
            return


def _wait_for_nodes(env: dict[str, str], count: int, procs: list[subprocess.Popen[bytes]]) -> None:
    probe = "import ray; ray.init(); print(sum(n['Alive'] for n in ray.nodes()))"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a Ray node exited"
        out = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
        )
        if out.stdout.strip() == str(count):
            return
        time.sleep(1)
    raise AssertionError(f"Ray did not reach {count} nodes in 120 s")


def _submitted(
    api: KubeStandIn, tmp_path: Path, tiny: Path, *extra: str
) -> tuple[str, Path, dict[str, Any], Path]:
    """``tiny``: the tiny model without its warm start (minutes of CPU), a directory the pods see."""
    recipe = [*overrides(tmp_path), *RECIPE, f"model.hf_id={tiny}", *extra]
    result = hpcrl(tmp_path / "kubeconfig", "submit", *recipe)
    assert result.returncode == 0, result.stderr
    job = re.search(r"^job\s+(\S+)", result.stdout, re.M).group(1)
    run_dir = Path(re.search(r"^run dir (\S+)$", result.stdout, re.M).group(1))
    [manifest] = api.bodies("POST", "/rayjobs")
    [secret] = api.bodies("POST", "/secrets")
    token = tmp_path / "token"
    token.write_bytes(base64.b64decode(secret["data"]["token"]))
    token.chmod(0o400)
    return job, run_dir, manifest, token


def _entrypoint(job: dict[str, Any]) -> list[str]:
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[0] == "python"
    return [sys.executable, *argv[1:]]


def _prestop(group: dict[str, Any]) -> list[str]:
    """A group's pods' preStop hook, as the kubelet runs it in the container when the pod is deleted."""
    argv = group["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert argv[0] == "python"
    return [sys.executable, *argv[1:]]


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(r)["step"] for r in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def api(tmp_path):
    (tmp_path / "runs").mkdir()
    with KubeStandIn() as standin:
        standin.kubeconfig(tmp_path / "kubeconfig")
        yield standin


def test_the_rayjob_driver_joins_trains_is_preempted_and_kuberays_retry_resumes(api, tmp_path, tiny_dir):
    """Issue 39 items 3-4 in one run (each Ray cluster start and driver start costs CI a minute): the
    entrypoint joins the running cluster and trains; mid-run the worker pod is deleted (a Spot VM's
    reclaim, a drain): the kubelet runs its preStop hook, which asks the driver to save through the run
    directory and holds the pod until the driver has saved the step in flight (no checkpoint is due:
    period 100) and exited 75; KubeRay retries the failed RayJob (backoffLimit) with a new RayCluster and
    the same entrypoint, and that attempt resumes from exactly that step and finishes, as a requeued
    sbatch job does."""
    # 30 steps of ~0.3 s: the hook (a Python start, a 1 s poll) lands mid-run even on a loaded machine
    # (with 5, a loaded CI machine finished the run before the request was read)
    extra = [f"algo.max_steps={STEPS}", "checkpoint.period=100", "algo.val_period=100"]
    job, run_dir, manifest, token = _submitted(api, tmp_path, tiny_dir, *extra)
    assert manifest["spec"]["backoffLimit"] >= 1  # the retry below is KubeRay's to make
    spec = manifest["spec"]["rayClusterSpec"]
    [worker] = spec["workerGroupSpecs"]
    with ray_cluster(manifest, token, tmp_path) as env:
        driver = subprocess.Popen(
            _entrypoint(manifest), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 420
        while not any(step >= 1 for step in _steps(run_dir)):
            assert driver.poll() is None and time.monotonic() < deadline, "no training step"
            time.sleep(0.3)
        pod_env = _pod_env(worker["template"]["spec"]["containers"][0], token, tmp_path)
        hook = subprocess.run(_prestop(worker), env=pod_env, capture_output=True, text=True, timeout=300)
        assert driver.wait(120) == EXIT_PREEMPTED, hook  # the hook returned once the driver had saved
        # the RayJob's failure deletes the head pod too: its hook finds no driver and returns at once
        head = subprocess.run(_prestop(spec["headGroupSpec"]), env=env, capture_output=True, text=True)
    assert head.stdout == f"hpcrl preStop: no driver runs in {run_dir}: nothing to save\n", head
    log = (run_dir / "driver.log").read_text()
    assert "is being deleted (its preStop hook asked): saving after the current step" in log, log[-3000:]
    saved = int(re.search(r"stopped after step (\d+) on SIGTERM", log).group(1))
    assert saved >= 1, log[-3000:]  # after a trained step
    assert saved < STEPS, log[-3000:]  # before the last
    assert (run_dir / "checkpoints" / f"step_{saved:06d}").is_dir(), log[-3000:]
    assert hook.returncode == 0 and f"driver exited {EXIT_PREEMPTED} (saved step {saved})" in hook.stdout
    assert f"exiting {EXIT_PREEMPTED}: KubeRay's retry resumes here" in log
    root = str(tmp_path / "runs")
    api.set_status("default", "rayjobs", job, jobDeploymentStatus="Retrying", failed=1)
    assert f"{job}  REQUEUED" in hpcrl(tmp_path / "kubeconfig", "status", job, "--root", root).stdout
    with ray_cluster(manifest, token, tmp_path) as env:  # the retry: a new cluster, the same entrypoint
        again = subprocess.run(_entrypoint(manifest), env=env, capture_output=True, text=True, timeout=420)
    assert again.returncode == 0, again.stderr[-3000:]
    log = (run_dir / "driver.log").read_text()  # both attempts, appended
    assert re.search(rf"resumed from \S+step_{saved:06d} \(step {saved}\)", log), log[-3000:]
    assert _steps(run_dir) == list(range(STEPS + 1))  # 0: the validation before training; no step twice
    result = json.loads((run_dir / "result.json").read_text())
    assert "train/loss" in result and "val/accuracy" in result  # the last step's metrics, as run_loop returns
    # the actors ran on the worker pod (the head has no CPUs for tasks), by the role's resource
    placement = json.loads((run_dir / "placement.json").read_text())["actors"]
    assert {a["role"] for a in placement} == {"train", "rollout"}
    assert "bootstrapping" not in log.lower() and re.search(rf"step +{STEPS}/{STEPS}", log), log[-2000:]
    api.set_status("default", "rayjobs", job, jobDeploymentStatus="Complete", jobStatus="SUCCEEDED")
    assert f"{job}  COMPLETED" in hpcrl(tmp_path / "kubeconfig", "status", job, "--root", root).stdout
    logs = hpcrl(tmp_path / "kubeconfig", "logs", job, "--root", root).stdout
    assert logs.startswith(f"==> {run_dir / 'driver.log'} <==\n") and re.search(
        rf"step +{STEPS}/{STEPS}", logs
    )
