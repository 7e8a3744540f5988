"""The driver's handle on the Ray actors of one run: trainer ranks and rollout engines.

``Fleet`` hides how many actors there are: generation is spread over the engines, training
over the trainer ranks (each takes its shard of the batch; what derives from it, the reference
log-probs and the metrics' reduction, stays with the ranks), weights go trainer -> every engine.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcrl.core.parallel import RolloutParallel
from hpcrl.plan.planner import Plan
from hpcrl.rollout.backends import inflight_updates, sleeps
from hpcrl.rollout.base import Completion, Prompt, SamplingSettings
from hpcrl.run.actors import RolloutActor, TrainerActor
from hpcrl.run.refit import Refit
from hpcrl.run.slots import place, plan_slots
from hpcrl.trainer.batch import TrainBatch

if TYPE_CHECKING:
    from ray.actor import ActorHandle


@dataclass
class Fleet:
    trainers: list[ActorHandle[TrainerActor]]
    engines: list[ActorHandle[RolloutActor]]
    """Each holds one ``RolloutEngine`` (rollout/base.py), whichever the rollout group chose."""
    placement: list[dict[str, Any]] = field(default_factory=list)
    data_ranks: list[tuple[int, int]] = field(default_factory=list)
    refit: Refit = field(default_factory=lambda: Refit("broadcast", "gloo", 512))
    sleep: bool = False
    """``rollout.sleep`` as the planner resolved it."""
    asleep: bool = False

    @classmethod
    def start(cls, plan: Plan, model_dir: Path, scratch: Path, *, device: str, gpu_resources: bool) -> Fleet:
        """Trainer ranks on the train role's GPUs, engines on the rollout role's.

        ``gpu_resources`` false (a local run on the CPU): one trainer and one engine, no GPU requests.
        True: the topology's ranks and engines, each asking Ray for its GPU (a share of it where they
        are colocated), so Ray sets ``CUDA_VISIBLE_DEVICES`` for each (a Slurm job, a local GPU)."""
        import ray

        cfg = plan.cfg
        topo = plan.topology
        # each rank gets the plan's degrees; a local run on the CPU trains on one rank
        train = topo.train if gpu_resources else replace(topo.train, world=1)
        on_cpu = device == "cpu"
        slots = plan_slots(topo, train, gpu_resources=gpu_resources)
        trainer_options, engine_options = place(slots)
        trainer_cls = ray.remote(TrainerActor)
        rollout_cls = ray.remote(RolloutActor)
        trainers = [
            trainer_cls.options(**options).remote(str(model_dir), cfg, rank, train, device)
            for rank, options in enumerate(trainer_options)
        ]
        # Rank 0 picks the rendezvous address on its own node: the ranks may span several nodes.
        master = ray.get(trainers[0].endpoint.remote())
        setups = [t.setup.remote(master) for t in trainers]
        kv_gb = plan.memory.rollout.cpu_kv_gb() if on_cpu else None  # GPUs: a share of memory instead
        # the engines as the plan placed them (a local run on the CPU: one, alone)
        rollout = topo.rollout if gpu_resources else RolloutParallel(topo.rollout.tp)
        engine_cfg = engine_config(cfg, rollout)
        # in-flight updates: a refit's pause arrives while generate_stream runs (the engine's WeightGate
        # orders them); otherwise one call at a time, as the loop makes them
        concurrency = 2 if inflight_updates(cfg.rollout) else 1
        engines: list[Any] = [None] * len(engine_options)
        for wave in slots.waves:  # engines on one GPU start one after another (slots.py says why)
            for i in wave:
                engines[i] = rollout_cls.options(**engine_options[i], max_concurrency=concurrency).remote(
                    str(model_dir), engine_cfg, cfg.max_seq_len, str(scratch), on_cpu, kv_gb
                )
            if len(slots.waves) > 1:
                ray.get([engines[i].where.remote() for i in wave])
        ray.get(setups)
        where = ray.get([a.where.remote() for a in trainers + engines])  # surface start-up errors here
        refit = Refit(plan.refit.mode, plan.refit.backend, cfg.rollout.weight_sync_bucket_mb, rollout.per_gpu)
        return cls(trainers, engines, where, refit=refit, sleep=sleeps(cfg.rollout))

    def describe(self) -> str:
        """One line: which role runs where, e.g. ``train x1 on node2; rollout x1 on node1``."""
        parts = []
        for role in ("train", "rollout"):
            hosts = sorted({w["host"] for w in self.placement if w["role"] == role})
            n = sum(w["role"] == role for w in self.placement)
            parts.append(f"{role} x{n} on {', '.join(hosts)}")
        return "; ".join(parts)

    def generate(self, prompts: list[Prompt], settings: SamplingSettings) -> list[list[Completion]]:
        out: list[list[Completion]] = [[] for _ in prompts]
        for part in self.generate_stream(prompts, settings):
            for i, group in part:
                out[i] = group
        return out

    def generate_stream(
        self, prompts: list[Prompt], settings: SamplingSettings
    ) -> Iterator[list[tuple[int, list[Completion]]]]:
        """Every engine generates its share (prompts i::k, seed + i); (prompt index, group) pairs come
        back as the engines finish them, whichever engine is first."""
        k = len(self.engines)
        streams = [
            (
                i,
                e.generate_stream.options(num_returns="streaming").remote(
                    prompts[i::k], replace(settings, seed=settings.seed + i)
                ),
            )
            for i, e in enumerate(self.engines)
            if prompts[i::k]
        ]
        yield from merge_streams(streams, k)

    def _data_ranks(self) -> list[tuple[int, int]]:
        """(data-parallel rank, data-parallel size) of every trainer rank: ranks that differ only in
        TP/PP/CP hold the same shard of the batch (fsdp: every CP group its own)."""
        import ray

        if not self.data_ranks:
            self.data_ranks = [
                (int(r), int(n)) for r, n in ray.get([t.data_rank.remote() for t in self.trainers])
            ]
        return self.data_ranks

    def _shards(self, batch: TrainBatch) -> list[TrainBatch]:
        return [batch.select(slice(r, None, n)) for r, n in self._data_ranks()]

    def train_step(self, batch: TrainBatch, lr: float | None = None) -> dict[str, float]:
        """Every trainer rank trains on its shard (scoring it under its reference model first, for
        the KL term); the metrics come back reduced over the ranks, the whole batch's on each."""
        import ray

        results = ray.get(
            [t.train_step.remote(s, lr) for t, s in zip(self.trainers, self._shards(batch), strict=True)]
        )
        return dict(results[0])

    def sleep_engines(self) -> None:
        """``rollout.sleep``: the engines release their KV cache and weights while the trainer trains."""
        import ray

        if self.sleep and not self.asleep:
            ray.get([e.sleep.remote() for e in self.engines])
            self.asleep = True

    def sync_weights(self, version: int) -> dict[str, float]:
        """New weights (policy ``version``: optimizer steps taken) from the trainer ranks to every
        engine, streamed (run/refit.py); sleeping engines wake their weights first and their KV cache
        after (the refit's buckets and the KV cache are never resident together). Generation running
        (``rollout.inflight_update``) is held between two steps while the weights change."""
        import time

        import ray

        start, wake_s = time.perf_counter(), 0.0
        ray.get([e.pause_generation.remote() for e in self.engines])
        if self.asleep:  # the trainers' cached activations go back first: the engines need that memory
            ray.get([t.release_cache.remote() for t in self.trainers])
            ray.get([e.wake_up.remote(["weights"]) for e in self.engines])
            wake_s = time.perf_counter() - start
        self.refit.run(self.trainers, self.engines)
        ray.get([e.resume_generation.remote(version) for e in self.engines])
        if self.asleep:
            kv = time.perf_counter()
            # and the refit's bucket buffers (2.3 GB of an 8B shape stayed cached in the trainer)
            ray.get([t.release_cache.remote() for t in self.trainers])
            ray.get([e.wake_up.remote(["kv_cache"]) for e in self.engines])
            wake_s += time.perf_counter() - kv
            self.asleep = False
        self.refit.last["wake_s"] = wake_s
        return dict(self.refit.last)

    # -- checkpoints: each trainer rank writes and reads its own shards; nothing passes through here
    def save_checkpoint(self, path: str, async_save: bool) -> float:
        """Every rank's shards into ``path`` (async: staged, then written in the background); the
        seconds the slowest rank blocked."""
        import ray

        return max(ray.get([t.save_checkpoint.remote(path, async_save) for t in self.trainers]))

    def finish_checkpoint(self) -> float:
        """Wait until every rank has written its shards; the seconds the slowest waited."""
        import ray

        return max(ray.get([t.finish_checkpoint.remote() for t in self.trainers]))

    def load_checkpoint(self, path: str, weights_only: bool) -> None:
        import ray

        ray.get([t.load_checkpoint.remote(path, weights_only) for t in self.trainers])


def engine_config(cfg: Any, rollout: RolloutParallel) -> Any:
    """``cfg`` as one engine of the plan's ``rollout`` runs it: the plan's tensor-parallel size, and
    where ``per_gpu`` engines share a GPU, its part of ``rollout.gpu_memory_utilization``."""
    share = cfg.rollout.gpu_memory_utilization / rollout.per_gpu
    return replace(cfg, rollout=replace(cfg.rollout, tp=rollout.tp, gpu_memory_utilization=share))


def merge_streams(streams: list[tuple[int, Any]], k: int) -> Iterator[list[tuple[int, list[Completion]]]]:
    """(engine i, its Ray streaming generator over prompts i::k) as one stream of global prompt
    indices; a thread per engine, so a slow engine holds back no other's groups."""
    import ray

    if len(streams) == 1:  # the common case: no threads
        i, stream = streams[0]
        for ref in stream:
            yield [(i + j * k, group) for j, group in ray.get(ref)]
        return
    parts: queue.Queue[tuple[int, Any]] = queue.Queue()

    def pump(i: int, stream: Any) -> None:
        try:
            for ref in stream:
                parts.put((i, ray.get(ref)))
        except BaseException as exc:  # re-raised in the caller's thread
            parts.put((i, exc))
        parts.put((i, None))

    threads = [threading.Thread(target=pump, args=pair, daemon=True) for pair in streams]
    for t in threads:
        t.start()
    open_streams = len(streams)
    while open_streams:
        i, part = parts.get()
        if part is None:
            open_streams -= 1
        elif isinstance(part, BaseException):
            raise part
        else:
            yield [(i + j * k, group) for j, group in part]
