"""Issue 39 items 3-4: `hpcrl submit`, `status`, `logs`, `cancel`, `ls` on Kubernetes, through the real
Kubernetes Python client and the console entry point's ``main`` (in this process: one start for the module,
not one a command), against a STAND-IN API server on loopback
(tests/harness/kube_standin.py: no API server runs here). The stand-in checks every body it gets against
Kubernetes' and KubeRay's schemas and plays KubeRay only by the statuses a test sets."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from hpcrl.cli import main
from hpcrl.launch import kube_jobs, lifecycle
from tests.conftest import ROOT
from tests.harness.kube_standin import KubeStandIn


def overrides(root: Path, name: str = "kube") -> list[str]:
    """The tiny recipe on a Kubernetes cluster whose pods mount ``root`` (the run directory's volume)."""
    return [
        "+experiment=grpo-tiny-1n1g-fsdp",
        "cluster=slurmtest",
        "cluster.scheduler=kuberay",
        "cluster.container.image=img",
        f"cluster.kube.volumes=[{{name: runs, mount: {root}, host_path: {root}}}]",
        f"run.output_root={root / 'runs'}",
        f"run.name={name}",
    ]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def hpcrl(kubeconfig: Path, *args: str) -> Result:
    """The console entry point's ``main`` in this process, as the shell would run it (its own KUBECONFIG,
    200 columns, the repository as the working directory): a process start per call cost CI ~2 s each."""
    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in ("KUBECONFIG", "COLUMNS")}
    os.environ.update(KUBECONFIG=str(kubeconfig), COLUMNS="200")
    kube_jobs._kube.cache_clear()  # a client is made per process: this call's kubeconfig, not a former one's
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(cwd)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        kube_jobs._kube.cache_clear()
    return Result(code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def standin():
    with KubeStandIn() as served:  # one server for the module; each test starts from an empty one
        yield served


@pytest.fixture
def api(standin, tmp_path, monkeypatch):
    (tmp_path / "runs").mkdir()
    standin.reset()
    monkeypatch.setenv("KUBECONFIG", str(standin.kubeconfig(tmp_path / "kubeconfig")))
    kube_jobs._kube.cache_clear()  # a client of an earlier test's kubeconfig
    yield standin
    kube_jobs._kube.cache_clear()


def submitted(api: KubeStandIn, tmp_path: Path, name: str = "kube") -> tuple[str, Path]:
    result = hpcrl(tmp_path / "kubeconfig", "submit", *overrides(tmp_path, name))
    assert result.returncode == 0, result.stderr
    job = re.search(r"^job\s+(\S+)\s+\(1 node\(s\) on slurmtest\)$", result.stdout, re.M).group(1)
    run_dir = Path(re.search(r"^run dir (\S+)$", result.stdout, re.M).group(1))
    assert f"log     {run_dir / 'driver.log'}" in result.stdout
    return job, run_dir


def test_submit_creates_the_secret_and_the_rendered_rayjob(api, tmp_path):
    job, run_dir = submitted(api, tmp_path)
    assert job == run_dir.name and lifecycle.run_dir_of(job, tmp_path / "runs") == run_dir
    [secret] = api.bodies("POST", "/secrets")
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert secret["metadata"]["name"] == "hpcrl-ray-token" and len(token) == 64
    # the RayJob the API got is the manifest in the run directory, byte-equal to `hpcrl render`'s
    [body] = api.bodies("POST", "/rayjobs")
    text = (run_dir / "rayjob.yaml").read_text()
    assert body == yaml.safe_load(text)
    assert body["spec"]["entrypoint"] == f"python -m hpcrl.launch.kube_entry {run_dir}"
    rendered = tmp_path / "render" / run_dir.name
    assert (
        hpcrl(tmp_path / "kubeconfig", "render", *overrides(tmp_path), "--out", str(rendered)).returncode == 0
    )
    assert (rendered / "rayjob.yaml").read_text() == text
    # the token is in no file of the run and in no output; the driver reads its plan from the run directory
    assert all(token not in p.read_text(errors="replace") for p in run_dir.rglob("*") if p.is_file())
    assert (run_dir / "plan.pkl").exists() and json.loads((run_dir / "job.json").read_text())[
        "namespace"
    ] == "default"
    # a second run reuses the Secret (the pods of both mount it)
    submitted(api, tmp_path, "kube2")
    assert len(api.bodies("POST", "/secrets")) == 1 and len(api.bodies("POST", "/rayjobs")) == 2
    assert [r.method for r in api.requests if "/secrets" in r.path] == ["GET", "POST", "GET"]


STATES = [
    ({}, "PENDING"),
    ({"jobDeploymentStatus": "New"}, "PENDING"),
    ({"jobDeploymentStatus": "Suspended"}, "PENDING"),  # Kueue has not admitted it
    ({"jobDeploymentStatus": "Waiting"}, "PENDING"),
    ({"jobDeploymentStatus": "Initializing"}, "CONFIGURING"),
    ({"jobDeploymentStatus": "Running", "jobStatus": "PENDING"}, "CONFIGURING"),
    ({"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}, "RUNNING"),
    ({"jobDeploymentStatus": "Retrying", "failed": 1}, "REQUEUED"),
    ({"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}, "COMPLETED"),
    ({"jobDeploymentStatus": "Complete", "jobStatus": "STOPPED"}, "CANCELLED"),
    ({"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "reason": "AppFailed"}, "FAILED"),
    ({"jobDeploymentStatus": "Failed", "reason": "DeadlineExceeded"}, "TIMEOUT"),
    ({"jobDeploymentStatus": "ValidationFailed", "reason": "ValidationFailed"}, "FAILED"),
]


def test_status_maps_each_kuberay_state_to_slurms_words(api, tmp_path):
    job, run_dir = submitted(api, tmp_path)
    root = tmp_path / "runs"
    for fields, word in STATES:
        api.set_status("default", "rayjobs", job, **fields)
        assert lifecycle.info(job, root).state == word, fields
    active = [w for _, w in STATES if w in lifecycle.ACTIVE]
    assert set(active) == {"PENDING", "CONFIGURING", "RUNNING", "REQUEUED"}  # what `logs -f` waits through
    api.set_status("default", "rayjobs", job, jobDeploymentStatus="Running", jobStatus="RUNNING")
    status = hpcrl(tmp_path / "kubeconfig", "status", job, "--root", str(root))
    assert status.stdout.strip() == f"{job}  RUNNING  kube  1 node(s)  {run_dir}", status.stderr
    listing = hpcrl(tmp_path / "kubeconfig", "ls", "--root", str(root))
    assert re.search(rf"{job}\s+RUNNING\s+1 node\(s\) .* kube  {run_dir}", listing.stdout), listing.stdout


def test_logs_read_the_run_directory_else_the_submitter_pod(api, tmp_path):
    job, run_dir = submitted(api, tmp_path)
    root = str(tmp_path / "runs")
    logs = hpcrl(tmp_path / "kubeconfig", "logs", job, "--root", root)
    assert logs.stdout == f"==> RayJob {job} submitter pod (namespace default) <==\n(not written yet)\n"
    api.add_pod("default", f"{job}-abcde", {"job-name": job}, "step 1/2 | reward 0.5\n")
    api.add_pod("default", "other-xyz", {"job-name": "other"}, "not this one\n")
    logs = hpcrl(tmp_path / "kubeconfig", "logs", job, "--root", root)
    assert logs.stdout == f"==> RayJob {job} submitter pod (namespace default) <==\nstep 1/2 | reward 0.5\n\n"
    [listed] = [r for r in api.requests if r.path.endswith("/pods")][-1:]
    assert listed.query["labelSelector"] == [f"job-name={job}"]
    (run_dir / "driver.log").write_text("from the shared volume\n")
    logs = hpcrl(tmp_path / "kubeconfig", "logs", job, "--root", root)
    assert logs.stdout == f"==> {run_dir / 'driver.log'} <==\nfrom the shared volume\n\n"


def test_cancel_deletes_the_rayjob(api, tmp_path):
    job, run_dir = submitted(api, tmp_path)
    root = str(tmp_path / "runs")
    cancel = hpcrl(tmp_path / "kubeconfig", "cancel", job, "--root", root)
    assert cancel.stdout.strip() == f"cancelled RayJob {job} (deleted with its pods) ({run_dir})"
    [deleted] = [r for r in api.requests if r.method == "DELETE"]
    assert deleted.path == f"/apis/ray.io/v1/namespaces/default/rayjobs/{job}"
    assert deleted.query["propagationPolicy"] == ["Background"], deleted
    status = hpcrl(tmp_path / "kubeconfig", "status", job, "--root", root)
    assert f"{job}  ENDED (no result)  kube" in status.stdout
    again = hpcrl(tmp_path / "kubeconfig", "cancel", job, "--root", root)
    assert again.returncode == 2 and again.stderr.startswith(
        f"hpcrl: error: Kubernetes refused deleting RayJob {job} in namespace default (404 "
    )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("fault", "says"),
    [
        (
            ("POST", "/rayjobs", 403, "Forbidden"),
            "Kubernetes refused creating RayJob {job} in namespace default (403 stand-in refuses POST "
            "/apis/ray.io/v1/namespaces/default/rayjobs); your account lacks the RBAC right",
        ),
        (
            ("POST", "/rayjobs", 404, "NotFound"),
            "(404 stand-in refuses POST /apis/ray.io/v1/namespaces/default/rayjobs); is KubeRay installed",
        ),
        (("POST", "/rayjobs", 409, "AlreadyExists"), "(409 stand-in refuses POST"),
        (
            ("GET", "/secrets", 403, "Forbidden"),
            "Kubernetes refused reading Secret hpcrl-ray-token in namespace",
        ),
    ],
)
def test_api_refusals_are_one_line(api, tmp_path, fault, says):
    api.fail(*fault)
    result = hpcrl(tmp_path / "kubeconfig", "submit", *overrides(tmp_path))
    assert result.returncode == 2 and result.stdout.count("\n") <= 2, result.stdout  # header lines only
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, line
    job = next((tmp_path / "runs").glob("kube-*")).name
    assert line.startswith("hpcrl: error: ") and says.format(job=job) in line, line
    assert not (tmp_path / "runs" / ".jobs").exists()  # nothing recorded for a job that was not created


def test_no_credentials_or_no_server_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "runs").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path))
    kube_jobs._kube.cache_clear()
    missing = hpcrl(tmp_path / "nowhere", "submit", *overrides(tmp_path))
    assert missing.returncode == 2 and missing.stderr.strip() == (
        f"hpcrl: error: no Kubernetes credentials: no kubeconfig at {tmp_path / 'nowhere'} and not inside a "
        "pod; get one (`gcloud container clusters get-credentials CLUSTER --location LOCATION`) or set KUBECONFIG"
    )
    assert list((tmp_path / "runs").iterdir()) == []  # checked before any file of the run is written
    standin = KubeStandIn()
    standin.url = f"http://127.0.0.1:{_closed_port()}"  # never served: connection refused
    refused = hpcrl(standin.kubeconfig(tmp_path / "kubeconfig"), "submit", *overrides(tmp_path))
    standin.server.server_close()
    line = refused.stderr.strip()
    assert refused.returncode == 2 and "\n" not in line, line
    assert line.startswith(
        f"hpcrl: error: cannot reach the Kubernetes API at {standin.url} for reading Secret"
    )
    assert "Connection refused" in line and line.endswith(
        "check the kubeconfig's cluster (`kubectl cluster-info`) and the network"
    )
    wrong = hpcrl(
        tmp_path / "kubeconfig",
        "submit",
        *overrides(tmp_path),
        "run.output_root=/nonexistent/runs",
        "cluster.kube.volumes=[{name: runs, mount: /nonexistent, host_path: /nonexistent}]",
    )
    assert wrong.stderr.strip() == (
        "hpcrl: error: run.output_root=/nonexistent/runs does not exist here: hpcrl writes the run directory "
        "there for the pods; mount their shared volume at the same path here, or submit from a pod that mounts it"
    )


def test_debug_creates_a_raycluster_of_the_plan_and_cancel_deletes_it(api, tmp_path):
    result = hpcrl(tmp_path / "kubeconfig", "debug", *overrides(tmp_path))
    assert result.returncode == 0, result.stderr
    job = re.search(
        r"^job\s+(\S+)\s+\(debug RayCluster, 1 worker pod\(s\) on slurmtest\)$", result.stdout, re.M
    )[1]
    [body] = api.bodies("POST", "/rayclusters")  # validated against KubeRay's RayCluster schema on arrival
    assert body["metadata"]["name"] == job and not api.bodies("POST", "/rayjobs")
    assert f"-l ray.io/cluster={job},ray.io/node-type=head" in result.stdout
    root = tmp_path / "runs"
    assert lifecycle.info(job, root).state == "CONFIGURING"
    api.set_status("default", "rayclusters", job, state="ready")
    assert lifecycle.info(job, root).state == "RUNNING"
    cancel = hpcrl(tmp_path / "kubeconfig", "cancel", job, "--root", str(root))
    assert cancel.stdout.startswith(f"cancelled RayCluster {job} (deleted with its pods)"), cancel.stderr
    assert [r.path for r in api.requests if r.method == "DELETE"] == [
        f"/apis/ray.io/v1/namespaces/default/rayclusters/{job}"
    ]


def test_wandb_online_is_refused_before_anything_is_created(api, tmp_path):
    """sbatch hands the shell's WANDB_API_KEY to the job; nothing hands it to a RayJob's pods."""
    result = hpcrl(
        tmp_path / "kubeconfig",
        "submit",
        *overrides(tmp_path),
        "logger.wandb=true",
        "logger.wandb_mode=online",
    )
    assert result.returncode == 2 and result.stderr.strip() == (
        "hpcrl: error: logger.wandb_mode=online: the pods of a RayJob get no wandb key from this shell (not "
        "supported yet); set logger.wandb_mode=offline and `wandb sync` the run directory later"
    )
    assert api.requests == [] and list((tmp_path / "runs").iterdir()) == []


def test_a_sweep_submits_one_rayjob_per_point_each_with_its_run_directory(api, tmp_path):
    """``hpcrl submit -m`` on Kubernetes: every point through the same gate first (one refused point
    submits nothing), then one RayJob a point, each its own run directory and job record; ``hpcrl ls``
    and ``ls --sweep`` follow them through the API."""
    kube = overrides(tmp_path, "sweep")
    refused = hpcrl(tmp_path / "kubeconfig", "submit", "-m", *kube, "algo.num_generations=1,4")
    assert refused.returncode == 2 and "sweep point 0 (algo.num_generations=1): " in refused.stderr
    assert api.requests == [] and list((tmp_path / "runs").iterdir()) == []
    result = hpcrl(tmp_path / "kubeconfig", "submit", "-m", *kube, "algo.lr=1e-4,3e-4")
    assert result.returncode == 0, result.stderr
    sweep_dir = Path(re.search(r"^sweep\s+(\S+)\s+\(2 jobs\)$", result.stdout, re.M)[1])
    rows = json.loads((sweep_dir / "sweep.json").read_text())["points"]
    bodies = api.bodies("POST", "/rayjobs")  # each checked against KubeRay's schema on arrival
    assert [r["overrides"] for r in rows] == [["algo.lr=0.0001"], ["algo.lr=0.0003"]]
    for n, (row, body) in enumerate(zip(rows, bodies, strict=True)):
        run_dir = Path(row["run_dir"])
        assert run_dir.name.endswith(f"-p{n}") and body["metadata"]["name"] == row["job_id"] == run_dir.name
        assert body["spec"]["entrypoint"] == f"python -m hpcrl.launch.kube_entry {run_dir}"
        assert f"lr: {('0.0001', '0.0003')[n]}" in (run_dir / "config.yaml").read_text()
        assert lifecycle.run_dir_of(row["job_id"], tmp_path / "runs") == run_dir
    first, second = (r["job_id"] for r in rows)
    api.set_status("default", "rayjobs", first, jobDeploymentStatus="Running", jobStatus="RUNNING")
    api.set_status("default", "rayjobs", second, jobDeploymentStatus="Retrying", failed=1)
    listing = hpcrl(tmp_path / "kubeconfig", "ls", "--root", str(tmp_path / "runs")).stdout
    assert re.search(rf"{first}\s+RUNNING\s", listing) and re.search(rf"{second}\s+REQUEUED\s", listing)
    swept = hpcrl(tmp_path / "kubeconfig", "ls", "--sweep", str(sweep_dir)).stdout.splitlines()
    assert re.match(rf"\s+0\s+{first}\s+RUNNING\s+algo.lr=0.0001\s+-$", swept[1]), swept
    assert re.match(rf"\s+1\s+{second}\s+REQUEUED\s+algo.lr=0.0003\s+-$", swept[2]), swept


def test_render_m_writes_each_points_rayjob(tmp_path):
    """A sweep's preview on Kubernetes: each point's RayJob, its run directory under the pods' volume."""
    (tmp_path / "runs").mkdir()
    done = hpcrl(tmp_path / "kubeconfig", "render", "-m", *overrides(tmp_path, "sweep"), "algo.lr=1e-4,3e-4")
    assert done.returncode == 0 and done.stdout.splitlines()[-1].startswith("every point fits"), done.stderr
    (preview,) = (tmp_path / "runs" / "sweeps").iterdir()
    for n in (0, 1):
        job = yaml.safe_load((preview / f"p{n}" / "rayjob.yaml").read_text())
        assert job["spec"]["entrypoint"] == f"python -m hpcrl.launch.kube_entry {preview / f'p{n}'}"
    assert not (tmp_path / "kubeconfig").exists()  # nothing asked of an API server
