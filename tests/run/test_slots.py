"""Which GPU each trainer rank and engine gets: the slots' arithmetic, then real Ray placing probe actors
with those options on a node that declares four GPUs (Ray assigns GPU ids without a device)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from hpcrl.core.parallel import TrainParallel
from hpcrl.errors import ConfigError
from hpcrl.plan.topology import build_topology
from hpcrl.run.slots import fraction, plan_slots


def topo(*, gpus: int = 4, rollout_nodes: int = 0, per_gpu: int = 1, rollout_tp: int = 1):  # type: ignore[no-untyped-def]
    return build_topology(
        gpus_per_node=gpus,
        train=TrainParallel(world=gpus),
        rollout_nodes=rollout_nodes,
        rollout_tp=rollout_tp,
        engines_per_gpu=per_gpu,
    )


def test_colocated_engines_share_their_ranks_bundle() -> None:
    t = topo(per_gpu=2)
    slots = plan_slots(t, t.train, gpu_resources=True)
    assert [s["bundle"] for s in slots.trainers] == [0, 1, 2, 3]
    assert [s["bundle"] for s in slots.engines] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert slots.waves == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert {s["num_gpus"] for s in slots.engines} == {0.25}
    assert len(slots.bundles) == 4 and all(b["GPU"] == 1.0 for b in slots.bundles)


def test_split_and_whole_gpu_engines() -> None:
    t = topo(rollout_nodes=1, per_gpu=3)
    slots = plan_slots(t, t.train, gpu_resources=True)
    assert len(slots.engines) == 12 and slots.engines[5]["bundle"] == 1
    assert slots.engines[0]["num_gpus"] == fraction(1.0, 3) == 0.3333
    assert all("bundle" not in s and s["num_gpus"] == 1.0 for s in slots.trainers)
    whole = plan_slots(topo(rollout_nodes=1), t.train, gpu_resources=True)
    assert not whole.bundles and len(whole.engines) == 4 and whole.waves == [[0, 1, 2, 3]]
    cpu = plan_slots(t, TrainParallel(world=1), gpu_resources=False)
    assert len(cpu.trainers) == len(cpu.engines) == 1 and cpu.engines[0]["num_gpus"] == 0


def test_engines_share_a_gpu_only_at_tp1() -> None:
    with pytest.raises(ConfigError, match=r"rollout.engines_per_gpu=2 needs rollout.tp=1"):
        topo(per_gpu=2, rollout_tp=2)


PROBE = textwrap.dedent(
    """
    import json, sys, ray
    from hpcrl.core.parallel import TrainParallel
    from hpcrl.plan.topology import build_topology
    from hpcrl.run.actors import ROLLOUT_RESOURCE, TRAIN_RESOURCE
    from hpcrl.run.slots import place, plan_slots

    ray.init(num_cpus=2, num_gpus=4, resources={TRAIN_RESOURCE: 4, ROLLOUT_RESOURCE: 4},
             include_dashboard=False, logging_level="ERROR", log_to_driver=False, _node_ip_address="127.0.0.1")

    @ray.remote
    class Probe:
        def gpu(self):
            return [str(g) for g in ray.get_gpu_ids()]

    t = build_topology(gpus_per_node=4, train=TrainParallel(world=4), rollout_nodes=0, rollout_tp=1,
                       engines_per_gpu=2)
    trainers, engines = place(plan_slots(t, t.train, gpu_resources=True))
    t_actors = [Probe.options(**o).remote() for o in trainers]
    e_actors = [Probe.options(**o).remote() for o in engines]
    print(json.dumps({"trainers": ray.get([a.gpu.remote() for a in t_actors]),
                      "engines": ray.get([a.gpu.remote() for a in e_actors])}))
    """
)


def test_ray_gives_each_rank_its_own_gpu_and_its_engines_the_same() -> None:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    trainers, engines = got["trainers"], got["engines"]
    assert all(len(ids) == 1 for ids in trainers + engines)
    assert len({ids[0] for ids in trainers}) == 4  # four ranks, four GPUs
    for rank, ids in enumerate(trainers):
        assert engines[2 * rank] == engines[2 * rank + 1] == ids  # the IPC refit's pairing
