"""Whether a plan may be submitted, decided in one place: ``hpcrl plan``, ``render``, ``submit`` (one
run, or every point of a sweep) and ``hpcrl run`` ask this, so that what plan and render accept submit
takes, and what submit refuses they refuse with the same line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hpcrl.config.cluster import Scheduler
from hpcrl.config.schema import LoggerConfig, RunConfig
from hpcrl.errors import ConfigError
from hpcrl.hub.check import check_inputs
from hpcrl.launch.mounts import check_mounts
from hpcrl.launch.room import check_room
from hpcrl.launch.slurm_checks import require_accepted_text
from hpcrl.plan.planner import Plan
from hpcrl.run.rundir import new_run_dir


def require_submittable(plan: Plan, run_dir: Path | None = None, *, ask_slurm: bool = False) -> None:
    """Raise the first refusal, one ConfigError line naming the key and the fix: the backend cannot
    build the model (first: refused whatever else it needs), the memory does not fit, the sequences
    outgrow the model's positions, wandb online has no login, the cache lacks an input or holds a data
    set without the fields the run reads, the checkpoints' filesystem (where visible here) lacks room
    for keep_top_k + 1 of them, on Slurm a path the job opens is outside its container's mounts, on
    Kubernetes the pods lack an image or the run directory is on none of their volumes. ``run_dir``:
    where the run's files go; None: where submit would put them (only its place matters, nothing is
    written). ``ask_slurm`` (plan, render): Slurm's ``sbatch --test-only`` on the script too, where
    sbatch is on PATH; submit asks it of the script it writes (launch/slurm_checks.py)."""
    plan.require_buildable()
    plan.require_fit()
    check_context(plan.cfg)
    logger = plan.cfg.logger
    if plan.cfg.cluster.scheduler is Scheduler.kuberay and logger.wandb and logger.wandb_mode == "online":
        raise ConfigError(  # sbatch passes the shell's key on; a RayJob's pods get nothing from this shell
            "logger.wandb_mode=online: the pods of a RayJob get no wandb key from this shell (not supported "
            "yet); set logger.wandb_mode=offline and `wandb sync` the run directory later"
        )
    check_wandb_login(logger)
    check_inputs(plan.cfg)
    where = run_dir or new_run_dir(plan.cfg)  # once: the name is the time, which may tick between two asks
    if plan.cfg.cluster.scheduler is Scheduler.slurm:
        check_mounts(plan, where.resolve())
        if ask_slurm:
            require_accepted_text(plan, where)
    if plan.cfg.cluster.scheduler is Scheduler.kuberay:
        from hpcrl.launch.kuberay import check_kube, pods_run_dir

        check_kube(plan, pods_run_dir(plan, where))  # image, run dir on a volume
    # last: a cluster's run is only warned of, after every refusal
    check_room(plan, run_dir, warn=lambda line: print(f"hpcrl: warning: {line}", file=sys.stderr))


def check_context(cfg: RunConfig) -> None:
    """The longest sequence fits the model's positions: vLLM refuses a longer ``max_model_len`` (every
    engine would fail at start), and positions past them give NaN under RoPE. Asked before submit,
    not at composition: tests and tools compose the tiny models freely."""
    model, longest = cfg.model, cfg.max_seq_len
    if longest <= model.max_position_embeddings:
        return
    prompt, new, most = cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens, model.max_position_embeddings
    if cfg.trainer.max_seq_len:
        keys, fix = f"trainer.max_seq_len={longest}", f"trainer.max_seq_len={most}"
    else:
        keys = f"data.max_prompt_tokens={prompt} + rollout.max_new_tokens={new} = {longest} tokens"
        fix = (
            f"rollout.max_new_tokens={most - prompt}"
            if prompt < most
            else f"data.max_prompt_tokens={most // 2} rollout.max_new_tokens={most - most // 2}"
        )
    raise ConfigError(
        f"{keys} exceed the {most} positions of {model.name} (model.max_position_embeddings): its "
        f"engines refuse a longer context; lower it, e.g. {fix}"
    )


def check_wandb_login(logger: LoggerConfig) -> None:
    """wandb online needs a key where the job starts: the submitting shell's ``WANDB_API_KEY`` (Slurm
    passes the environment on; never written into the run's files) or a ``wandb login`` (~/.netrc, on
    the shared home). Without one ``wandb.init`` stops the job at start, after the queue's wait."""
    if not logger.wandb or logger.wandb_mode != "online" or os.environ.get("WANDB_API_KEY"):
        return
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="replace"):
        return
    raise ConfigError(
        "logger.wandb_mode=online needs a wandb key: export WANDB_API_KEY in this shell (the job inherits "
        "it) or run `wandb login`; or set logger.wandb_mode=offline (`wandb sync` later)"
    )
