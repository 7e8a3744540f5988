"""The driver's handle on the Ray actors of one run: trainer ranks and rollout engines.

``Fleet`` hides how many actors there are: generation is spread over the engines, training
over the trainer ranks (each takes its shard of the batch; what derives from it, the reference
log-probs and the metrics' reduction, stays with the ranks), weights go trainer -> every engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcrl.core.parallel import RolloutParallel
from hpcrl.plan.planner import Plan
from hpcrl.rollout.backends import inflight_updates, sleeps
from hpcrl.rollout.base import Completion, Prompt, SamplingSettings
from hpcrl.run.actors import RolloutActor, TrainerActor
from hpcrl.run.engine_faults import EngineFailed, EngineFaults, cause_of, dispatch
from hpcrl.run.preempt import REQUEST
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
    spawn: Callable[[int], ActorHandle[RolloutActor]] | None = None
    """A new engine actor in engine ``i``'s slot (its options and arguments); None: none is rebuilt."""
    faults: EngineFaults = field(default_factory=lambda: EngineFaults(0, 1800.0))
    version: int = 0
    """The policy version the trainer ranks hold (optimizer steps): what a rebuilt engine gets."""
    lock: threading.RLock = field(default_factory=threading.RLock)
    """Held by a train step and a refit: a refit into a rebuilt engine (from the producer thread of
    ``algo.max_staleness`` > 0) sends a known version."""

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

        def spawn(i: int) -> Any:
            return rollout_cls.options(**engine_options[i], max_concurrency=concurrency).remote(
                str(model_dir), engine_cfg, cfg.max_seq_len, str(scratch), on_cpu, kv_gb
            )

        for wave in slots.waves:  # engines on one GPU start one after another (slots.py says why)
            for i in wave:
                engines[i] = spawn(i)
            if len(slots.waves) > 1:
                ray.get([engines[i].where.remote() for i in wave])
        ray.get(setups)
        where = ray.get([a.where.remote() for a in trainers + engines])  # surface start-up errors here
        refit = Refit(plan.refit.mode, plan.refit.backend, cfg.rollout.weight_sync_bucket_mb, rollout.per_gpu)
        faults = EngineFaults(cfg.rollout.max_engine_restarts, cfg.rollout.hang_timeout_s)
        return cls(
            trainers, engines, where, refit=refit, sleep=sleeps(cfg.rollout), spawn=spawn, faults=faults
        )

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
        back as the engines finish them, whichever engine is first. An engine that dies or hangs
        leaves its unfinished prompts to the others (run/engine_faults.py)."""

        def start(e: int, idx: list[int], call: int) -> Iterator[Any]:
            import ray

            share = [prompts[i] for i in idx]
            seeded = replace(settings, seed=settings.seed + call)
            for ref in self.engines[e].generate_stream.options(num_returns="streaming").remote(share, seeded):
                yield ray.get(ref)

        live = [e for e in range(len(self.engines)) if e not in self.faults.down]
        yield from dispatch(len(prompts), live, start, self._kill, self._revive, self.faults)

    def _host(self, e: int) -> str:
        engines = [w for w in self.placement if w.get("role") == "rollout"]
        return str(engines[e]["host"]) if e < len(engines) else "?"

    def _kill(self, e: int) -> str:
        """End engine ``e`` (dead, hung or failing: its process goes); its node."""
        import ray

        ray.kill(self.engines[e], no_restart=True)
        return self._host(e)

    def _rebuild(self, down: list[int]) -> None:
        """New actors in the lost engines' slots (their placement-group bundles), started and with the
        trainers' weights: the refit re-forms the weight groups with every engine that is up."""
        import ray

        if self.spawn is None:
            raise RuntimeError("internal: this fleet cannot rebuild an engine")
        for e in down:
            self.engines[e] = self.spawn(e)
        where = ray.get([self.engines[e].where.remote() for e in down])
        rollout = [i for i, w in enumerate(self.placement) if w.get("role") == "rollout"]
        for e, w in zip(down, where, strict=True):
            self.placement[rollout[e]] = w
            self.faults.down.pop(e)
        self.refit.layout = None
        if self.asleep:  # as the others are: the refit wakes them together (one that hangs: lost again)
            self._bounded({e: self.engines[e].sleep.remote() for e in down}, " going to sleep", "its sleep")

    def _find_dead(self, during: str = "") -> None:
        """Engines that died between two generations (no groups lost), or that answer no ping within
        ``rollout.hang_timeout_s`` (hung: a stopped process, a wedged driver): a refit into one would
        fail, or wait for ever."""
        pings = {e: a.where.remote() for e, a in enumerate(self.engines) if e not in self.faults.down}
        self._bounded(pings, during, "a ping")

    def _bounded(self, calls: dict[int, Any], during: str, what: str) -> None:
        """Wait for every engine's call in ``calls`` (engine -> its object ref) at most
        ``rollout.hang_timeout_s``: an engine's call has no timeout of its own, and one that never
        answers would hold the run for ever. One that does not answer is marked lost (hung ``during``)
        and killed, one whose actor died marked lost; past ``rollout.max_engine_restarts``:
        ``EngineFailed``."""
        import ray

        if not calls:
            return
        limit = self.faults.hang_timeout_s
        _, late = ray.wait(list(calls.values()), num_returns=len(calls), timeout=limit)
        for e, ref in calls.items():
            if ref in late:
                self._lose(e, f"hung{during}: no answer to {what} in rollout.hang_timeout_s={limit:g} s")
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self.faults.lost(e, self._kill(e), (f"died{during}: " if during else "") + cause_of(exc), 0)

    def _lose(self, e: int, cause: str) -> None:
        """Engine ``e`` marked lost, then killed (even past the bound): a refit its death wakes finds
        it marked already."""
        if e in self.faults.down:  # the generation's own hang check (a producer thread) was first
            return
        try:
            self.faults.lost(e, self._host(e), cause, 0)
        finally:
            self._kill(e)

    def _refitting(self, refit: Callable[[], dict[str, float]]) -> dict[str, float]:
        """``refit()`` into every engine, the lost ones rebuilt first; an engine that dies in it, or
        hangs in it (``_watched``), is rebuilt and the refit runs again (each time one more restart:
        ``rollout.max_engine_restarts`` bounds it). The refit's broadcast fails fast when a receiver
        dies (its group is closed, sync/broadcast.py) and is formed again with the new engine."""
        while True:
            self._find_dead()
            while self.faults.down:  # a rebuilt engine that hangs going to sleep is lost again
                self._rebuild(sorted(self.faults.down))
            try:
                return self._watched(refit)
            except EngineFailed:
                raise  # a hang past rollout.max_engine_restarts: the run saves and stops
            except Exception as exc:
                # a stop asked (a SIGTERM to the whole process group also reaches Ray's processes: the
                # engines and Ray's GCS may be gone, and a kill or rebuild waits on the GCS) ends here
                if REQUEST.asked or not self._lost_in_refit(exc):
                    raise  # or every engine is up: not theirs (a trainer rank's death, a bug)

    def _watched(self, refit: Callable[[], dict[str, float]]) -> dict[str, float]:
        """``refit()``, its engines pinged each ``rollout.hang_timeout_s`` it runs: one that answers
        no ping within that bound is hung in it, marked lost and killed, which ends the refit's wait
        on it (an engine's call has no timeout of its own). Past the bound: ``EngineFailed``."""
        done, failed = threading.Event(), []

        def watch() -> None:
            while not done.wait(self.faults.hang_timeout_s):
                if REQUEST.asked:  # stopping: no engine is rebuilt (see _refitting)
                    return
                try:
                    self._find_dead(" in a refit")
                except EngineFailed as exc:
                    failed.append(exc)
                    return

        watcher = threading.Thread(target=watch, name="hpcrl-refit-watch", daemon=True)
        watcher.start()
        try:
            return refit()
        finally:
            done.set()
            watcher.join()  # before the refit's failure is looked at: one thread marks engines lost
            if failed:
                raise failed[0]  # past rollout.max_engine_restarts: the run saves and stops

    def _lost_in_refit(self, exc: Exception) -> bool:
        """Whether engines died in a refit that raised ``exc`` (the one it names, those a ping finds);
        they are marked lost (and killed)."""
        for e, engine in enumerate(self.engines):
            if e not in self.faults.down and getattr(exc, "actor_id", None) == engine._actor_id.hex():
                self.faults.lost(e, self._kill(e), f"died in a refit: {cause_of(exc)}", 0)
        self._find_dead(" in a refit")
        return bool(self.faults.down)

    def _revive(self) -> list[int]:
        """No engine is left mid-batch: every one comes back now (a CUDA-IPC refit feeds all of a GPU's
        engines at once) with the weights the trainers hold (with ``algo.max_staleness`` > 0 a train
        step may be running: after it), stamping that version."""
        import ray

        with self.lock:
            down = sorted(self.faults.down)  # every engine (none is left), rebuilt by the refit
            self._refitting(lambda: self.refit.run(self.trainers, self.engines))
            ray.get([self.engines[e].resume_generation.remote(self.version) for e in down])
        return down

    def dead_trainer(self, exc: BaseException) -> str | None:
        """Which trainer rank ``exc`` (a Ray actor error) says is gone, with its node, PID and cause,
        in a few words; None where it is not a trainer's."""
        for rank, trainer in enumerate(self.trainers):
            if getattr(exc, "actor_id", None) == trainer._actor_id.hex():
                where = self.placement[rank] if rank < len(self.placement) else {}
                on = f" on {where['host']} (pid {where['pid']})" if where else ""
                return f"trainer rank {rank}{on} died ({cause_of(exc)})"
        return None

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

        with self.lock:
            results = ray.get(
                [t.train_step.remote(s, lr) for t, s in zip(self.trainers, self._shards(batch), strict=True)]
            )
            self.version += 1
        return dict(results[0])

    def sleep_engines(self) -> None:
        """``rollout.sleep``: the engines release their KV cache and weights while the trainer trains.
        One that does not go to sleep within ``rollout.hang_timeout_s`` is lost ("hung going to
        sleep"), killed, and rebuilt before the next refit (one restart); past the bound
        ``EngineFailed``: the run saves and stops."""
        if self.sleep and not self.asleep:
            going = {i: e.sleep.remote() for i, e in enumerate(self.engines) if i not in self.faults.down}
            self._bounded(going, " going to sleep", "its sleep")
            self.asleep = True

    def sync_weights(self, version: int) -> dict[str, float]:
        """New weights (policy ``version``: optimizer steps taken) from the trainer ranks to every
        engine, streamed (run/refit.py); sleeping engines wake their weights first and their KV cache
        after (the refit's buckets and the KV cache are never resident together). Generation running
        (``rollout.inflight_update``) is held between two steps while the weights change. Engines lost
        since the last refit (in a generation, or while the trainers trained) are rebuilt first, and
        one that dies in it is rebuilt and the refit run again; the engine faults since the last
        refit come back with the phases."""
        with self.lock:
            phases = self._refitting(lambda: self._sync(version))
            self.version = version
        return {**phases, **self.faults.metrics()}

    def _sync(self, version: int) -> dict[str, float]:
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
