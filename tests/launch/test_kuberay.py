"""Issue 39 items 1-2: KubeRay manifests from the plan, checked against the real schemas: the pod templates
against Kubernetes' OpenAPI schema (kubernetes-validate, strict: unknown fields fail) and the whole RayJob
and RayCluster against KubeRay's CRD schemas, vendored from ray-project/kuberay at v1.7.0
(``tests/launch/kuberay/``, see its README): the checks in tests/harness/kube_schemas.py."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from hpcrl.config.compose import compose_config
from hpcrl.errors import ConfigError
from hpcrl.launch.golden import KUBE_CASES, KUBE_DIR, kube_files, render_kube
from hpcrl.launch.kuberay import grace_seconds, raycluster, rayjob
from hpcrl.plan.planner import make_plan
from hpcrl.plan.savetime import save_seconds
from hpcrl.run import actors
from tests.harness.kube_schemas import K8S_VERSION, check_against_schemas, crd_schema, unknown_fields


@pytest.mark.parametrize("file", sorted(kube_files()))
def test_golden_manifests_match_and_validate(file):
    """The RayJobs and the ``hpcrl debug`` RayCluster, each against its CRD's schema."""
    name, debug = kube_files()[file]
    text = render_kube(name, debug)
    assert (KUBE_DIR / file).read_text() == text, "refresh: .venv/bin/python -m hpcrl.launch.golden"
    manifest = yaml.safe_load(text)
    assert manifest["kind"] == ("RayCluster" if debug else "RayJob")
    check_against_schemas(manifest, "rayclusters" if debug else "rayjobs")


def test_no_stale_golden_manifests():
    assert sorted(p.name for p in KUBE_DIR.glob("*.yaml")) == sorted(kube_files())


def _plan(*extra: str):
    return make_plan(
        compose_config(
            [
                "+experiment=grpo-gemma3-1b-it-1n8g-fsdp2tp1",
                "cluster=gke_a4",
                "cluster.container.image=IMAGE",
                "run.output_root=/data/runs",
                *extra,
            ]
        )
    )


def test_the_rayjob_is_the_plan():
    plan = _plan("layout.rollout_nodes=1", "layout.train_nodes=2", "cluster.kube.queue=q")
    job = rayjob(plan, Path("/data/runs/r-1"))
    spec = job["spec"]["rayClusterSpec"]
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert {k: (g["replicas"], g["rayStartParams"]["resources"]) for k, g in groups.items()} == {
        "rollout": (1, '{"hpcrl_rollout": 8}'),
        "train": (2, '{"hpcrl_train": 8}'),
    }
    worker = groups["train"]["template"]["spec"]
    assert worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert worker["nodeSelector"] == {"cloud.google.com/compute-class": "gpu-rl-ccc"}
    assert job["spec"]["suspend"] is True and job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "q"
    assert job["spec"]["entrypoint"] == "python -m hpcrl.launch.kube_entry /data/runs/r-1"
    # the head is a CPU pod with the shared bucket but not the GPU nodes' host paths
    head = spec["headGroupSpec"]["template"]["spec"]
    assert [v["name"] for v in head["volumes"]] == ["data", "ray-token"] and "nodeSelector" not in head
    check_against_schemas(job, "rayjobs")
    check_against_schemas(raycluster(plan, "debug-1", Path("/data/runs/debug-1")), "rayclusters")


def _groups(job):
    spec = job["spec"].get("rayClusterSpec", job["spec"])
    return [spec["headGroupSpec"], *spec["workerGroupSpecs"]]


def test_every_ray_pod_asks_the_driver_to_save_when_deleted():
    """Kubernetes SIGTERMs a container's PID 1 (``ray start``), not the driver: each Ray pod's preStop hook
    asks the driver of this run directory to save, within a grace period of a step and one save."""
    plan = _plan("layout.rollout_nodes=1", "cluster.kube.step_margin_s=300")
    assert grace_seconds(plan) == 300 + math.ceil(save_seconds(plan)) and save_seconds(plan) > 15
    job = rayjob(plan, Path("/data/runs/r-1"))
    for manifest in (job, raycluster(plan, "r-1", Path("/data/runs/r-1"))):
        for group in _groups(manifest):
            pod = group["template"]["spec"]
            assert pod["terminationGracePeriodSeconds"] == grace_seconds(plan)
            hook = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
            assert hook == [
                *["python", "-m", "hpcrl.launch.kube_prestop", "/data/runs/r-1", "--wait"],
                str(grace_seconds(plan)),
            ]
    assert "lifecycle" not in job["spec"]["submitterPodTemplate"]["spec"]["containers"][0]  # not a Ray pod
    with pytest.raises(ConfigError, match=r"^cluster.kube.step_margin_s=0 must be > 0$"):
        _plan("cluster.kube.step_margin_s=0")


def test_each_role_is_a_worker_group_with_its_ray_resources():
    """Judge nodes (``rewards.judge.nodes``) are a worker group of their own, as any role of
    ``Plan.node_roles()``, advertising the resources the actors ask for."""
    name = "grpo-gemma3-1b-it-judge-qwen3-8b-gke_a4"
    job = yaml.safe_load(render_kube(name))
    workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    shape = [(g["groupName"], g["replicas"], json.loads(g["rayStartParams"]["resources"])) for g in workers]
    assert shape == [
        ("train-rollout", 1, {"hpcrl_train": 8, "hpcrl_rollout": 8}),
        ("judge", 1, {"hpcrl_judge": 8}),
    ]
    assert {
        g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] for g in workers
    } == {"8"}
    declared = {v for k, v in vars(actors).items() if k.endswith("_RESOURCE")}
    plan = _plan("layout.rollout_nodes=1", "+rewards.judge.model=qwen3_8b", "+rewards.judge.nodes=2")
    groups = rayjob(plan, Path("/data/runs/r"))["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert [(g["groupName"], g["replicas"]) for g in groups] == [("rollout", 1), ("train", 1), ("judge", 2)]
    for role in set(plan.node_roles()):  # a role's resources are ones the actors ask for by name
        assert set(actors.role_resources(role, 1)) <= declared, role


@pytest.mark.parametrize(
    ("key", "role"),
    [
        ("rollout_node", ["layout.rollout_nodes=1"]),
        ("judge_node", ["+rewards.judge.model=qwen3_8b", "+rewards.judge.nodes=1"]),
        ("env_node", ["+env.name=calculator", "+env.nodes=1"]),
    ],
)
def test_node_kinds_of_their_own_are_slurms_and_refused_on_kuberay(key, role):
    """A role's nodes of another kind (partition, GPUs ...) make a Slurm heterogeneous job; on KubeRay a
    role is its worker group of the cluster's nodes, so those keys mean nothing there: one line each."""
    with pytest.raises(ConfigError) as err:
        _plan(*role, f"+cluster.{key}.partition=other")
    assert str(err.value) == (
        f"cluster.{key} describes a Slurm heterogeneous job; cluster 'gke_a4' is kuberay: remove cluster.{key}"
    )
    groups = rayjob(_plan(*role), Path("/data/runs/r"))["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert groups[-1]["rayStartParams"]["num-gpus"] == ("0" if key == "env_node" else "8")


def test_environment_nodes_are_a_worker_group_without_gpus():
    """``env.nodes`` (issue 38 item 4) on KubeRay: a worker group advertising ``hpcrl_env`` (what the
    environment actor asks for) whose pods ask for no GPU and give Ray none."""
    plan = _plan("+env.name=calculator", "+env.nodes=2")
    groups = rayjob(plan, Path("/data/runs/r"))["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    env = groups[-1]
    assert (env["groupName"], env["replicas"]) == ("env", 2)
    assert json.loads(env["rayStartParams"]["resources"]) == {actors.ENV_RESOURCE: 1}
    assert env["rayStartParams"]["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in env["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert groups[0]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_the_ray_token_is_a_secret_reference_never_a_value():
    text = render_kube(sorted(KUBE_CASES)[0])
    job = yaml.safe_load(text)
    for group in [
        job["spec"]["rayClusterSpec"]["headGroupSpec"],
        *job["spec"]["rayClusterSpec"]["workerGroupSpecs"],
    ]:
        pod = group["template"]["spec"]
        assert {
            "name": "ray-token",
            "secret": {"secretName": "hpcrl-ray-token", "defaultMode": 0o400},
        } in pod["volumes"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["RAY_AUTH_TOKEN_PATH"] == "/etc/hpcrl/ray/token" and "RAY_AUTH_TOKEN" not in env


def test_a_schema_mistake_is_caught():
    """The checks bite: an unknown field and a wrong type each fail."""
    job = rayjob(_plan(), Path("/data/runs/r"))
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replica"] = 1
    assert unknown_fields(job, crd_schema("rayjobs")) == [".spec.rayClusterSpec.workerGroupSpecs[0].replica"]
    job = rayjob(_plan(), Path("/data/runs/r"))
    job["spec"]["backoffLimit"] = "three"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(job, crd_schema("rayjobs"))
    pod = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]
    pod["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": pod},
            K8S_VERSION,
            strict=True,
        )


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (
            ["run.output_root=/scratch/runs"],
            "run.output_root: the run directory /scratch/runs/r is on none of the pods",
        ),
        (["cluster.container.image=null"], "cluster 'gke_a4' runs pods: set cluster.container.image"),
        (["cluster.kube.namespace=My_NS"], "cluster.kube.namespace='My_NS' is not a Kubernetes name"),
        (
            ["cluster.kube.volumes=[{name: d, mount: /d, pvc: a, gcs_bucket: b}]"],
            "cluster.kube.volumes[0]: set exactly one",
        ),
    ],
)
def test_kube_mistakes_are_one_line(extra, says):
    with pytest.raises(ConfigError, match=re.escape(says)) as err:
        plan = _plan(*extra)
        rayjob(plan, Path(plan.cfg.run.output_root) / "r")
    assert "\n" not in str(err.value)


def test_an_unknown_field_inside_a_list_entry_is_named():
    """A typo inside a list of records (a toleration) names that field, not the whole key."""
    with pytest.raises(ConfigError) as err:
        _plan("cluster.kube.tolerations=[{key: x, effct: NoSchedule}]")
    assert str(err.value) == (
        "cluster.kube.tolerations: unknown key 'effct' (Toleration has no such field); check the spelling"
    )
