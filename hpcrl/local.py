"""Run the whole loop on this machine: local Ray, the run's actors, reward workers, the loop.

This is what ``hpcrl submit`` does when the cluster is ``local`` (the embedded default), and what
the Slurm job's driver does once the Ray cluster is up (with the job's address instead).
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcrl.plan import Plan
from hpcrl.rundir import new_run_dir, write_resolved_config


def say(msg: str) -> None:
    print(f"[hpcrl {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cache_dir() -> Path:
    return Path(os.environ.get("HPCRL_CACHE", Path.home() / ".cache" / "hpcrl"))


def prepare_model(plan: Plan) -> Path:
    model = plan.cfg.model
    if model.name == "tiny":
        from hpcrl.tiny import ensure_tiny_model

        return ensure_tiny_model(model, cache_dir(), seed=plan.cfg.run.seed, log=say)
    return Path(model.hf_id)


def make_encoder(model_dir: Path, template: str) -> tuple[Callable[[str], list[int]], int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if tok.chat_template and template != "plain":

        def encode(prompt: str) -> list[int]:
            msgs = [{"role": "user", "content": prompt}]
            return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    else:
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []

        def encode(prompt: str) -> list[int]:
            return bos + tok.encode(prompt, add_special_tokens=False)

    return encode, int(pad)


def start_local_ray(plan: Plan, scratch: Path) -> None:
    """Ray reads its auth settings when first imported, so the environment is set before ``import ray``."""
    from hpcrl.workers import ROLLOUT_RESOURCE, TRAIN_RESOURCE

    if "ray" in sys.modules:
        raise RuntimeError("internal: ray was imported before its auth settings were made")
    from hpcrl.launch.ray_cluster import auth_env, make_token

    # Token auth even on a laptop, with the token in a private file (Ray's own default file is 0644).
    os.environ.update(auth_env(make_token(scratch)))
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep every listener on 127.0.0.1
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import ray

    ray.init(
        num_cpus=os.cpu_count() or 1,
        resources={TRAIN_RESOURCE: 1, ROLLOUT_RESOURCE: plan.cfg.rollout.tp},
        include_dashboard=False,
        _temp_dir=str(scratch / "ray"),
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        configure_logging=False,
    )


def run_local(plan: Plan) -> dict[str, float]:
    import torch

    from hpcrl.checkpoint import CheckpointManager, load_state
    from hpcrl.data.loader import PromptStream, load_examples
    from hpcrl.loop import train
    from hpcrl.metrics import MetricsLogger
    from hpcrl.rewards.pool import RewardPool
    from hpcrl.rundir import config_yaml
    from hpcrl.runtime import Runtime
    from hpcrl.trainer.fsdp import free_port

    cfg = plan.cfg
    started = time.perf_counter()
    run_dir = new_run_dir(cfg).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_resolved_config(cfg, run_dir)
    say(f"run directory {run_dir}")
    model_dir = prepare_model(plan)
    encode, pad_id = make_encoder(model_dir, cfg.data.template)
    train_ex, val_ex = load_examples(cfg.data, cfg.run.seed)
    say(f"data: {len(train_ex)} training / {len(val_ex)} validation prompts ({cfg.data.name})")
    scratch = Path(tempfile.mkdtemp(prefix="hpcrl-"))  # short path: Ray's socket names have a length limit
    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    ckpt = CheckpointManager(Path(cfg.checkpoint.dir or run_dir / "checkpoints"), cfg.checkpoint.keep_top_k,
                             cfg.checkpoint.metric, cfg.checkpoint.higher_is_better)  # fmt: skip
    stream = PromptStream(train_ex, cfg.run.seed)
    logger = MetricsLogger(run_dir, cfg.logger, cfg.run.name, {"config": config_yaml(cfg)})
    try:
        start_local_ray(plan, scratch)
        say("starting trainer and rollout workers")
        rt = Runtime.start(plan, model_dir, scratch, on_cpu=True, master=f"127.0.0.1:{free_port()}")
        start_step = 0
        latest = ckpt.latest()
        if latest is not None:
            state = load_state(latest)
            rt.load_state_dict(state["trainer"])
            stream.restore(state["stream"])
            random.setstate(state["rng"]["python"])
            torch.set_rng_state(state["rng"]["torch"])
            rt.sync_weights()
            start_step = int(state["step"])
            say(f"resumed from {latest.path} (step {start_step})")
        with RewardPool(cfg.data.verifier, workers=2, timeout_s=5.0) as pool:
            say(f"ready after {time.perf_counter() - started:.0f}s; training {cfg.algo.max_steps} steps")
            last = train(cfg, rt, pool, encode, pad_id, stream, val_ex, ckpt, logger, say, start_step)
    finally:
        logger.close()
        if "ray" in sys.modules:
            import ray

            ray.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
    summarize(run_dir, ckpt, started)
    return last


def summarize(run_dir: Path, ckpt: Any, started: float) -> None:
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    if vals:
        say(
            f"validation accuracy {vals[0][1]:.3f} (step {vals[0][0]}) -> {vals[-1][1]:.3f} (step {vals[-1][0]})"
        )
    best = ckpt.best()
    say(f"done in {time.perf_counter() - started:.0f}s")
    print(f"  metrics      {run_dir / 'metrics.jsonl'}", file=sys.stdout)
    print(f"  tensorboard  tensorboard --logdir {run_dir / 'tensorboard'}", file=sys.stdout)
    print(f"  checkpoints  {ckpt.root}" + (f" (best: {best.path.name})" if best else ""), file=sys.stdout)
