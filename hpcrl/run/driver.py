"""The run's driver: everything between "a Ray cluster is reachable" and "the run is summarised".

``hpcrl submit`` with no cluster calls it after starting a local Ray (``local.py``); inside a Slurm
job node 0 calls it once the job's Ray cluster is up (``launch/job.py``). Same code either way.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcrl.config.compose import cache_dir
from hpcrl.errors import HpcrlError
from hpcrl.plan.planner import Plan
from hpcrl.trainer.backends import trainer_spec

if TYPE_CHECKING:
    from hpcrl.config.schema import RunConfig
    from hpcrl.data.config import DataConfig
    from hpcrl.data.loader import Example
    from hpcrl.run.loop import Actors, Run, Scorer
    from hpcrl.run.vision import Encoded


def say(msg: str) -> None:
    print(f"[hpcrl {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prepare_model(plan: Plan) -> Path:
    """The model's directory: built (tiny models), the snapshot in the Hugging Face cache (a hub id:
    resolved offline, as fetched; ``model.fetch=job`` downloads it first) or a local directory."""
    model = plan.cfg.model
    from hpcrl.hub.cache import hub_dir, is_hub_id
    from hpcrl.hub.resolve import model_snapshot
    from hpcrl.run.tiny_model import ensure_tiny_model, is_tiny

    if is_tiny(model):
        return ensure_tiny_model(model, cache_dir(), seed=plan.cfg.run.seed, log=say)
    if not is_hub_id(model.hf_id):
        return Path(model.hf_id).expanduser()
    hub = hub_dir(plan.cfg.cluster)
    if model.fetch == "job":
        from hpcrl.hub.fetch import fetch_model

        fetch_model(hub, model.hf_id, model.revision, say, gguf=model.gguf)
    path = model_snapshot(hub, model.hf_id, model.revision)
    say(f"model {model.hf_id} (revision {model.revision or 'main'}): {path}")
    return path


def prepare_data(plan: Plan) -> tuple[list[Any], list[Any]]:
    """Training and validation examples; ``hf:`` splits from the cache (``model.fetch=job``: fetched first)."""
    from hpcrl.data.loader import load_examples
    from hpcrl.hub.cache import hub_dir

    cfg = plan.cfg
    hub = hub_dir(cfg.cluster)
    if cfg.model.fetch == "job":
        from hpcrl.hub.fetch import fetch_split, wanted_sources

        for key, source, split in wanted_sources(cfg):
            fetch_split(hub, source, split, key, say)
    return load_examples(cfg.data, cfg.run.seed, hub)


def make_encoder(model_dir: Path, data: DataConfig) -> tuple[Callable[[str], list[int]], int]:
    """Prompt text -> token ids, and the pad id. Through the model's chat template unless
    ``data.template`` is ``plain`` (or the tokenizer has none), with ``data.chat_template_kwargs``:
    ``data.system_prompt`` as a system turn first, then ``data.fewshot``'s solved problems as earlier
    turns of the same chat (each problem through ``data.template``, as the prompts)."""
    from transformers import AutoTokenizer

    from hpcrl.data.templates import earlier_turns

    tok = AutoTokenizer.from_pretrained(model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if tok.chat_template and data.template != "plain":
        earlier = earlier_turns(data)
        extra = dict(data.chat_template_kwargs)

        def encode(prompt: str) -> list[int]:
            msgs = [*earlier, {"role": "user", "content": prompt}]
            # text first: with tokenize=True transformers 5 returns a BatchEncoding (list() of it gives
            # its keys), 4.x a list of ids; the template writes every special token itself
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **extra)
            return list(tok.encode(text, add_special_tokens=False))
    else:
        chat_only = {"data.fewshot": data.fewshot, "data.system_prompt": data.system_prompt}
        chat_only["data.chat_template_kwargs"] = data.chat_template_kwargs
        for key, value in chat_only.items():  # with data.template=plain DataConfig.check refused them
            if value:
                raise HpcrlError(
                    f"{key} goes through the chat template, and the tokenizer of {model_dir} has none: "
                    f"drop {key}"
                )
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []

        def encode(prompt: str) -> list[int]:
            return bos + tok.encode(prompt, add_special_tokens=False)

    return encode, int(pad)


def run_loop(plan: Plan, run_dir: Path, connect: Callable[[Path], None], *, slurm: bool) -> dict[str, float]:
    """Connect to Ray (``connect(scratch)``), start the actors, train, summarise.

    ``slurm``: actors ask for the job's GPUs (real or the test cluster's fake ones) and are spread
    over the topology's nodes; locally there is one trainer and one engine, which share the machine's
    GPU where the plan found one (``cluster.gpu=auto``) and ask for none on a CPU."""
    from hpcrl.envs.episodes import multi_turn, private_paths
    from hpcrl.rewards.pool import RewardPool
    from hpcrl.run.engine_faults import EngineFailed, save_and_stop
    from hpcrl.run.judges import judged
    from hpcrl.run.loop import train
    from hpcrl.run.overlap import train_overlapped
    from hpcrl.run.preempt import REQUEST, rearm

    REQUEST.reset()  # a request belongs to one run (tests and `debug` run several in one process)
    cfg = plan.cfg
    started = time.perf_counter()
    say(f"run directory {run_dir}")
    prep = _prepare(plan, run_dir)
    scratch = Path(tempfile.mkdtemp(prefix="hpcrl-"))  # short path: Ray's socket names have a length limit
    try:
        connect(scratch)
        rearm()  # ray.init put its own SIGTERM handler in (a stack dump, then abort)
        actors = _start_actors(plan, prep.model_dir, scratch, run_dir, slurm=slurm)
        start_step, restored = _resume(actors, prep, cfg.algo.max_staleness)
        private = private_paths(run_dir, cfg.checkpoint.dir)
        with (
            RewardPool(cfg.data.verifier, cfg.rewards, cfg.data.percent) as pool,
            multi_turn(cfg, actors, prep, private, run_dir, say) as actors,
            judged(plan, pool, run_dir, scratch, say, prepare_model) as scorer,
        ):
            say(
                f"ready after {time.perf_counter() - started:.0f}s ({len(pool.slots)} reward processes); "
                f"training {cfg.algo.max_steps} steps"
            )
            run = prep.loop_run(cfg, actors, scorer)
            try:
                if cfg.algo.max_staleness:  # generation overlaps training (run/overlap.py)
                    last = train_overlapped(run, start_step=start_step, restored=restored)
                else:
                    last = train(run, start_step=start_step)
            except EngineFailed as failed:  # engines failed past rollout.max_engine_restarts
                raise save_and_stop(run, actors.version, failed) from None
            except Exception as exc:  # a trainer rank that died: the job ends, its requeue resumes
                if (stop := trainer_lost(exc, actors, prep.ckpt)) is None:
                    raise
                raise stop from None
    finally:
        prep.logger.close()
        if "ray" in sys.modules:
            from hpcrl.run.rayprocs import shutdown

            shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
    summarize(run_dir, prep.ckpt, started)
    return last


def trainer_lost(exc: Exception, actors: Any, ckpt: Any) -> HpcrlError | None:
    """One line for a trainer rank that died (killed, out of memory, a node lost): which rank, where,
    why, and where the next attempt resumes (the last committed checkpoint, with the generated batches
    it kept where ``algo.max_staleness`` > 0). None: ``exc`` is not a trainer rank's death. The ranks
    hold one model between them: the survivors cannot go on without it, so the run stops at once."""
    dead = getattr(actors, "dead_trainer", lambda _exc: None)(exc)
    if dead is None:
        return None
    latest = ckpt.latest()
    resume = f"resumes from {latest.path.name}" if latest is not None else "starts afresh (no checkpoint yet)"
    return HpcrlError(f"{dead}: the run stops; submitting it again {resume}")


@dataclass
class _Prepared:
    """What the driver holds for one run before the actors start: model, tokenizer, data, checkpoints,
    logs. With the actors and the reward pool, most of it becomes the loop's ``loop.Run``."""

    model_dir: Path
    encode: Callable[[Example], Encoded]
    pad_id: int
    stream: Any
    """The training prompts (``PromptStream``), in the order the checkpoint restores."""
    val: list[Any]
    ckpt: Any
    logger: Any
    weights_only: bool
    """``checkpoint.resume_weights_only``."""
    resume_from: Any = None
    """The newest checkpoint that verifies (``CheckpointManager.resumable``); None: a fresh start."""

    def loop_run(self, cfg: RunConfig, actors: Actors, pool: Scorer) -> Run:
        """What the loop works with, once the actors and the reward pool are up."""
        from hpcrl.run.loop import Run

        return Run(
            cfg, actors, pool, self.encode, self.pad_id, self.stream, self.val, self.ckpt, self.logger, say
        )


def _prepare(plan: Plan, run_dir: Path) -> _Prepared:
    """Model, tokenizer, data, the seeded RNGs, checkpoints and the metrics log, before Ray starts."""
    import torch

    from hpcrl.data.loader import PromptStream
    from hpcrl.run.checkpoint import CheckpointManager, check_resumable
    from hpcrl.run.metrics import MetricsLogger
    from hpcrl.run.rundir import config_yaml
    from hpcrl.run.vision import prompt_encoder

    cfg = plan.cfg
    model_dir = prepare_model(plan)
    encode, pad_id = prompt_encoder(model_dir, cfg.data, make_encoder)
    train_ex, val_ex = prepare_data(plan)
    say(f"data: {len(train_ex)} training / {len(val_ex)} validation prompts ({cfg.data.name})")
    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    ckpt = CheckpointManager(
        Path(cfg.checkpoint.dir or run_dir / "checkpoints"),
        cfg.checkpoint.keep_top_k,
        cfg.checkpoint.metric,
        cfg.checkpoint.higher_is_better,
        about=checkpoint_about(plan, model_dir),
        model_dir=model_dir,
        say=say,
    )
    stream = PromptStream(train_ex, cfg.run.seed)
    logger = MetricsLogger(run_dir, cfg.logger, cfg.run.name, {"config": config_yaml(cfg)})
    latest = resume_point(ckpt)  # checked before any actor starts: a mismatch costs no GPU time
    weights_only = cfg.checkpoint.resume_weights_only
    if latest is not None and (note := check_resumable(latest, ckpt.about, weights_only)):
        say(note)
    return _Prepared(model_dir, encode, pad_id, stream, val_ex, ckpt, logger, weights_only, latest)


def resume_point(ckpt: Any, failed: frozenset[Path] = frozenset()) -> Any:
    """The newest checkpoint that verifies and has not ``failed`` to load; None where there is none
    at all. Raises where every one is damaged: starting afresh would write over a run's history."""
    found = ckpt.resumable(say, failed)
    if found is None and ckpt.list():
        raise HpcrlError(
            f"no checkpoint under {ckpt.root} is whole (each is named above with what is wrong): move them "
            "away, or set checkpoint.dir elsewhere, to start afresh"
        )
    return found


def _start_actors(plan: Plan, model_dir: Path, scratch: Path, run_dir: Path, *, slurm: bool) -> Any:
    """The trainer ranks and rollout engines (``Fleet``), placed; where each landed goes to placement.json."""
    import torch

    from hpcrl.plan.topology import on_gpus
    from hpcrl.run.fleet import Fleet
    from hpcrl.run.rundir import atomic_write_text

    say("starting trainer and rollout actors")
    # the plan's devices: the namespace test cluster's fake GPUs run on the CPU (gpu: cpu)
    device = "cuda" if on_gpus(plan.cfg.cluster) else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise HpcrlError(
            f"cluster.gpu={plan.cfg.cluster.gpu} but torch {torch.__version__} sees no CUDA GPU here; "
            "install a CUDA build of torch, or plan for the CPU (cluster.gpu=cpu)"
        )
    # a local run on a GPU asks Ray for it as a Slurm job does, so each actor sees that GPU
    actors = Fleet.start(plan, model_dir, scratch, device=device, gpu_resources=slurm or device == "cuda")
    say(f"placed: {actors.describe()}")
    atomic_write_text(run_dir / "placement.json", json.dumps({"actors": actors.placement}, indent=1))
    return actors


def checkpoint_about(plan: Plan, model_dir: Path) -> dict[str, Any]:
    """model.json of this run's checkpoints: what resume compares and export reads."""
    cfg, par = plan.cfg, plan.topology.train
    layout = {
        k: v
        for k, v in asdict(par).items()
        if k == "world" or k in trainer_spec(cfg.trainer).checkpoint_layout
    }
    return {
        "model": cfg.model.name,
        "family": cfg.model.family,
        "backend": cfg.trainer.backend,
        "optimizer": cfg.trainer.optimizer.value,
        "layout": layout,
        "source": str(model_dir),
    }


def _resume(actors: Any, prep: _Prepared, lag: int) -> tuple[int, list[Any]]:
    """Restore the latest checkpoint, if any (weights to the engines too); the step it was taken after
    and the generated batches it kept (``algo.max_staleness`` > 0: ``run/overlap.py``). The trainer
    ranks read their shards themselves (resharded when this layout is another)."""
    import torch

    from hpcrl.run.checkpoint import check_resumable, load_loop_state, verify
    from hpcrl.run.overlap import resumable

    latest, failed = prep.resume_from, frozenset[Path]()
    while latest is not None:
        try:  # the trainer state and the loop state of one step, or of the next older one that loads
            state = load_loop_state(latest)
            actors.load_checkpoint(str(latest.path / "trainer"), prep.weights_only)
            break
        except Exception as exc:
            # damage within a file's recorded size (the resume's check sums no shard): the shards'
            # sums say so; anything else (out of memory, a dead rank) would fail on every checkpoint
            damage = verify(latest.path, deep=True)
            if not damage:
                raise
            first = (str(exc).splitlines() or [""])[0][:200]
            say(f"checkpoint {latest.path.name} failed to load ({type(exc).__name__}: {first}): {damage}")
            failed |= {latest.path}
            latest = resume_point(prep.ckpt, failed)
            if latest is not None and (note := check_resumable(latest, prep.ckpt.about)):
                say(note)
    prep.logger.resume(int(state["step"]) if latest is not None else 0)
    if latest is None:
        return 0, []
    prep.stream.restore(state["stream"])
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    actors.sync_weights(int(state["step"]))
    step = int(state["step"])
    kept = resumable(state.get("rollouts", []), step, lag)
    if len(kept) < len(state.get("rollouts", [])):
        # their prompts were taken from the stream: those steps train on the next prompts instead
        say(f"algo.max_staleness={lag}: {len(state['rollouts']) - len(kept)} generated batches dropped")
    say(f"resumed from {latest.path} (step {step})" + (f", {len(kept)} generated batches" if kept else ""))
    return step, kept


def summarize(run_dir: Path, ckpt: Any, started: float) -> None:
    from hpcrl.run.metrics import read_metrics

    rows = read_metrics(run_dir)
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
    print(f"  curves       hpcrl plot {run_dir}", file=sys.stdout)
    if best is not None:
        print(f"  export       hpcrl export {best.path} --out {run_dir / 'hf'}", file=sys.stdout)
        print(f"  evaluate     hpcrl eval {run_dir} --compare base", file=sys.stdout)
