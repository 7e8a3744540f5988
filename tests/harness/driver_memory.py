"""The driver's memory across a checkpoint save and resume of a model many times its growth.

    python tests/harness/driver_memory.py MODEL_DIR OUT_DIR

Starts a local Ray as ``hpcrl submit`` does, two fsdp trainer ranks as Ray actors (the run's own
TrainerActor and Fleet), one training step, then, measured in this (the driver's) process: a
checkpoint save (async, then settled) and a load of it. Prints one JSON line: the checkpoint's bytes
on disk and the driver's resident-memory high-water mark before and during those calls.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path


def high_water_kb() -> int:
    """VmHWM of this process after resetting it to the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss_kb("VmHWM")


def rss_kb(field: str = "VmRSS") -> int:
    m = re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text())
    assert m is not None
    return int(m.group(1))


def main() -> None:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    scratch = Path(tempfile.mkdtemp(prefix="hpcrl-mem-"))
    from hpcrl.launch.ray_cluster import auth_env, make_token

    os.environ.update(auth_env(make_token(scratch)))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import ray

    from hpcrl.config.compose import compose_config
    from hpcrl.run.actors import TRAIN_RESOURCE, TrainerActor
    from hpcrl.run.checkpoint import CheckpointManager
    from hpcrl.run.fleet import Fleet

    sys.path.insert(0, str(Path(__file__).parent))
    from megatron_parity import parity_batch

    ray.init(
        num_cpus=2,
        resources={TRAIN_RESOURCE: 2},
        include_dashboard=False,
        _temp_dir=str(scratch / "ray"),
        _node_ip_address="127.0.0.1",
        configure_logging=False,
    )
    cfg = compose_config(["model=tiny", "algo.kl_coef=0"])
    actor = ray.remote(TrainerActor)
    trainers = [
        actor.options(num_cpus=0, resources={TRAIN_RESOURCE: 1}).remote(
            str(model_dir), cfg, r, cfg.trainer.parallel(2), "cpu"
        )
        for r in range(2)
    ]
    master = ray.get(trainers[0].endpoint.remote())
    ray.get([t.setup.remote(master) for t in trainers])
    fleet = Fleet(trainers, [])
    ray.get([t.train_step.remote(parity_batch()) for t in trainers])
    ckpt = CheckpointManager(
        out / "checkpoints", 2, "m", True, about={"backend": "fsdp"}, model_dir=model_dir
    )
    before = high_water_kb()
    ckpt.save(1, fleet, {"step": 1}, {"m": 1.0}, async_save=True)
    ckpt.settle(fleet)
    latest = ckpt.latest()
    assert latest is not None
    fleet.load_checkpoint(str(latest.path / "trainer"), weights_only=False)
    peak = rss_kb("VmHWM")
    on_disk = sum(f.stat().st_size for f in (latest.path / "trainer").iterdir())
    print(json.dumps({"checkpoint_bytes": on_disk, "before_kb": before, "peak_kb": peak}))
    ray.shutdown()


if __name__ == "__main__":
    main()
