"""The driver's handle on the Ray actors of one run: trainer ranks and rollout engines.

``Runtime`` hides how many actors there are: generation is spread over the engines, training
over the trainer ranks (each takes its shard of the batch), weights go trainer -> every engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.plan import Plan
from hpcrl.rollout.base import Completion, SamplingSettings
from hpcrl.trainer.batch import TrainBatch
from hpcrl.workers import ROLLOUT_RESOURCE, TRAIN_RESOURCE, RolloutWorker, TrainerWorker


@dataclass
class Runtime:
    trainers: list[Any]
    engines: list[Any]

    @classmethod
    def start(cls, plan: Plan, model_dir: Path, scratch: Path, *, on_cpu: bool, master: str) -> Runtime:
        import ray

        cfg = plan.cfg
        world = plan.topology.train.world if not on_cpu else 1
        device = "cpu" if on_cpu else "cuda"
        trainer_cls = ray.remote(TrainerWorker)
        rollout_cls = ray.remote(RolloutWorker)
        trainers = [
            trainer_cls.options(
                num_cpus=0, num_gpus=0 if on_cpu else 1, resources={TRAIN_RESOURCE: 1}
            ).remote(str(model_dir), cfg, rank, world, master, device)
            for rank in range(world)
        ]
        engines_n = plan.topology.rollout.engines if not on_cpu else 1
        # On CPU the KV cache is sized from the plan (a step's sequences, twice over) instead of a memory share.
        r = plan.memory.rollout
        kv_gb = max(0.05, 2 * r.wanted_sequences * r.kv_per_sequence) if on_cpu else None
        tp = cfg.rollout.tp
        engines = [
            rollout_cls.options(
                num_cpus=0, num_gpus=0 if on_cpu else tp, resources={ROLLOUT_RESOURCE: tp}
            ).remote(str(model_dir), cfg, cfg.max_seq_len, str(scratch), on_cpu, kv_gb)
            for _ in range(engines_n)
        ]
        ray.get([a.where.remote() for a in trainers + engines])  # surface start-up errors here
        return cls(trainers, engines)

    def generate(self, prompts: list[list[int]], settings: SamplingSettings) -> list[list[Completion]]:
        import ray

        k = len(self.engines)
        chunks = [prompts[i::k] for i in range(k)]
        futures = [e.generate.remote(c, SamplingSettings(settings.n, settings.temperature, settings.top_p,
                                                         settings.max_tokens, settings.seed + i))
                   for i, (e, c) in enumerate(zip(self.engines, chunks, strict=True)) if c]  # fmt: skip
        parts = ray.get(futures)
        out: list[list[Completion]] = [[] for _ in prompts]
        for i, part in enumerate(parts):
            for j, group in enumerate(part):
                out[i + j * k] = group
        return out

    def _shards(self, batch: TrainBatch) -> list[TrainBatch]:
        n = len(self.trainers)
        return [batch.select(slice(r, None, n)) for r in range(n)]

    def ref_logprobs(self, batch: TrainBatch) -> Any:
        import ray
        import torch

        parts = ray.get(
            [t.ref_logprobs.remote(s) for t, s in zip(self.trainers, self._shards(batch), strict=True)]
        )
        return _interleave(parts) if len(parts) > 1 else parts[0] if parts else torch.empty(0)

    def train_step(self, batch: TrainBatch, ref_logp: Any) -> dict[str, float]:
        import ray

        n = len(self.trainers)
        refs = [None] * n if ref_logp is None else [ref_logp[r::n] for r in range(n)]
        results = ray.get([t.train_step.remote(s, r)
                           for t, s, r in zip(self.trainers, self._shards(batch), refs, strict=True)])  # fmt: skip
        return dict(results[0])

    def sync_weights(self) -> None:
        import ray

        weights = [t.export_weights.remote() for t in self.trainers]  # collective: every rank takes part
        ray.get([e.load_weights.remote(weights[0]) for e in self.engines])

    def state_dict(self) -> dict[str, Any]:
        import ray

        return dict(ray.get([t.state_dict.remote() for t in self.trainers])[0])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import ray

        ray.get([t.load_state_dict.remote(state) for t in self.trainers])


def _interleave(parts: list[Any]) -> Any:
    import torch

    n = len(parts)
    width = max(p.shape[1] for p in parts)
    total = sum(p.shape[0] for p in parts)
    out = torch.zeros((total, width), dtype=parts[0].dtype)
    for r, p in enumerate(parts):
        out[r::n, : p.shape[1]] = p
    return out
