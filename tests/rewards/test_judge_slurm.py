"""Issue 38 items 3-4, judges and environment nodes: the judge recipe with multi-turn episodes as one
heterogeneous job of three components on the Slurm test cluster (the training-and-rollout node from
`debug`, the judge node and a zero-GPU environment node from `urgent`): srun starts a task on each, Ray
spans them, the judge engine is placed on the judge node by its role resource and scores every step's
samples there, and the episodes' environments run in an actor on the environment node (`hpcrl_env`).
The same run checks the judge's plumbing (it was a local run of its own, 675 s loaded; one run now):
every step's samples go to the judge engine in one batch, the replies the tiny judge cannot read as a
number are counted, the step's time split is logged, and the judge's weights are those it started with
after the policy's refits. The tiny judge's scores mean nothing: asserted is the plumbing, not the
judgement. (The split rollout node as a component of its own: tests/launch/test_slurm.py.)"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from hpcrl.launch import lifecycle
from tests.conftest import run_cli

pytestmark = pytest.mark.slow


def test_judge_and_environment_nodes_are_components_of_the_job_and_hold_their_work(slurm_cluster, tmp_path):
    result = run_cli(
        "submit",
        "+experiment=grpo-tiny-3n1g-fsdp-judge-env-hetjob",
        f"run.output_root={tmp_path}",
        "algo.max_steps=2",
        "algo.val_period=2",
        "algo.num_prompts_per_step=8",
        "algo.num_generations=4",
        "data.max_val_samples=8",  # every sample an episode: environment processes cost time
        "checkpoint.enabled=false",
    )
    assert result.returncode == 0, result.stderr
    job_id = re.search(r"^job\s+(\d+)", result.stdout, re.M).group(1)
    run_dir = lifecycle.run_dir_of(job_id, tmp_path)
    state = lifecycle.wait(job_id, run_dir, timeout_s=900)
    logs = run_cli("logs", job_id, "--root", str(tmp_path)).stdout
    assert state == "COMPLETED", (state, logs[-3000:])
    parts = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "JobID,Partition,NodeList"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    partitions = sorted(p.rsplit("|", 1)[0] for p in parts)
    assert partitions == [f"{job_id}+0|debug", f"{job_id}+1|urgent", f"{job_id}+2|urgent"], parts
    judge_host = next(p.rsplit("|", 1)[1] for p in parts if p.startswith(f"{job_id}+1|"))
    env_host = next(p.rsplit("|", 1)[1] for p in parts if p.startswith(f"{job_id}+2|"))
    assert env_host != judge_host
    env = json.loads((run_dir / "env.json").read_text())
    assert [(a["role"], a["host"]) for a in env["actors"]] == [("env", env_host)]  # the env component's node
    assert f"environments (calculator) on {env_host}" in logs
    judge = json.loads((run_dir / "judge.json").read_text())
    assert [e["host"] for e in judge["engines"]] == [judge_host]  # on the judge component's node
    assert judge["model"] == "tiny" and [e["role"] for e in judge["engines"]] == ["judge"]
    assert judge["weights_unchanged"] is True  # two refits of the policy's engine, none of the judge's
    placed = json.loads((run_dir / "placement.json").read_text())["actors"]
    assert {a["host"] for a in placed}.isdisjoint({judge_host, env_host})  # the trainer and the engine
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["judge/batches"] == 1  # the whole step in one batch
        assert r["judge/samples"] == 8 * 4  # prompts x generations (validation's are not the step's)
        assert 0 <= r["judge/parse_failures"] <= r["judge/samples"]
        assert 0 <= r["judge/mean_score"] <= 1
        assert r["time/judge"] > 0 and r["time/generate"] > 0 and r["time/train"] > 0
        assert r["time/environment"] > 0  # the episodes' environment steps, on the environment node
        assert 0 <= r["rollout/prefix_cache_hit_rate"] <= 1  # read from the engine (CPU blocks: 128 tokens)
        parts_of_the_batch = r["time/generate"] + r["time/judge"] + r["time/environment"]
        assert parts_of_the_batch == pytest.approx(r["time/rollout"], abs=1e-6)
    # parsed or not, every reply was read: over the steps the tiny judge both answers and babbles
    assert sum(r["judge/parse_failures"] for r in steps) < sum(r["judge/samples"] for r in steps)
    assert f"judges on {judge_host}" in logs
