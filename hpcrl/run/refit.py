"""New weights from the trainer ranks to the rollout engines after a step: the driver's side.

Three ways, one stream: each sending trainer rank runs ``Trainer.stream_weights`` into a bucket
packer (sync/packer.py) whose full buckets go

- ``broadcast``: over a process group of its own with every engine worker (sync/broadcast.py; NCCL
  between GPUs of different actors, gloo on CPUs);
- ``ipc``: colocated GPUs — to the engine on the same GPU as CUDA IPC handles of the bucket (no host
  copy, no serialisation); each trainer rank feeds the engines that share its GPU;
- ``object_store``: through Ray's object store (host copies; works wherever Ray does).

The layout (who sends which tensors, in which buckets) is agreed once, from parameter metadata; each
refit then reports its phases: export (gather and pack on the senders), send (waiting on the wire),
receive and load (the engines'), cache reset.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from hpcrl.sync.broadcast import WeightLayout, dtype_of

MODES = ("broadcast", "ipc", "object_store")


@dataclass
class Refit:
    mode: str
    backend: str
    bucket_mb: int
    per_gpu: int = 1
    """``ipc``: engines on each trainer rank's GPU (rank r feeds engines r * per_gpu ...)."""
    layout: WeightLayout | None = None
    last: dict[str, float] = field(default_factory=dict)
    """The last refit's phases (seconds) and bytes."""

    def run(self, trainers: list[Any], engines: list[Any]) -> dict[str, float]:
        """One refit; one that fails (an engine died in it) leaves no call of it running and the
        groups to be formed again by the next."""
        try:
            return self._run(trainers, engines)
        except Exception:
            self.layout = None
            raise

    def _run(self, trainers: list[Any], engines: list[Any]) -> dict[str, float]:
        import ray

        start, phases = time.perf_counter(), {}
        if self.layout is None:
            self.layout = self._agree(trainers, engines)
        wire = self.layout.wire()
        if self.mode == "broadcast":
            sends = [t.send_weights.remote() for t in trainers]
            receives = [e.receive_weights.remote() for e in engines]
            got = settle([*sends, *receives])
            senders, engines_got = got[: len(sends)], got[len(sends) :]
            for key in ("receive_s", "load_s"):
                phases[key] = max(e[key] for e in engines_got)
        elif self.mode == "ipc":
            k = self.per_gpu
            if len(engines) != k * len(trainers):
                raise RuntimeError(f"internal: ipc refit of {len(trainers)} ranks to {len(engines)} engines")
            senders = ray.get(
                [
                    t.send_weights_via.remote(engines[r * k : (r + 1) * k], "ipc", wire)
                    for r, t in enumerate(trainers)
                ]
            )
        else:
            senders = ray.get([t.send_weights_via.remote(engines, "object_store", wire) for t in trainers])
        sent = time.perf_counter()
        ray.get([e.finish_refit.remote() for e in engines])
        done = time.perf_counter()
        self.last = {
            "export_s": max(s["pack_s"] for s in senders),
            "send_s": max(s["wait_s"] for s in senders),
            "reset_s": done - sent,
            "total_s": done - start,
            "bytes": float(sum(s["bytes"] for s in senders)),
            "peak_bucket_fraction": max(s["peak_numel"] for s in senders) / max(1, self.layout.bucket_numel),
            **phases,
        }
        return self.last

    def _agree(self, trainers: list[Any], engines: list[Any]) -> WeightLayout:
        """Every rank's metas -> the layout; for a broadcast, each source's group formed with every
        engine worker."""
        import ray

        engine_info = ray.get([e.weight_ranks.remote() for e in engines])
        dtypes = {dtype for _, dtype, _ in engine_info}
        if len(dtypes) != 1:
            raise RuntimeError(f"rollout engines hold weights in different dtypes: {sorted(dtypes)}")
        (dtype,) = dtypes
        # Buckets in elements of the wire dtype; every end derives the same plan from the same numbers.
        bucket_numel = self.bucket_mb * 2**20 // dtype_of(dtype).itemsize
        layout = WeightLayout.of(ray.get([t.weight_metas.remote() for t in trainers]), dtype, bucket_numel)
        if self.mode != "broadcast":
            ray.get([t.join_weight_group.remote(layout.wire()) for t in trainers])  # the wire dtype
            return layout
        masters = tuple(ray.get([trainers[r].weight_endpoint.remote() for r, _ in layout.sources]))
        ranks = sum(n for n, _, _ in engine_info)
        layout = WeightLayout(layout.sources, dtype, bucket_numel, self.backend, masters, ranks)
        wire = layout.wire()
        joins = [t.join_weight_group.remote(wire) for t in trainers]
        base = 1
        for engine, (n, _, ip) in zip(engines, engine_info, strict=True):
            joins.append(engine.join_weight_group.remote(wire, base, ip))
            base += n
        try:
            ray.get(joins)
        except Exception as exc:  # a rendezvous that fails says why, and what to do about it
            raise RuntimeError(
                f"weight sync: the trainer's {len(masters)} sending rank(s) ({', '.join(masters)}) and the "
                f"{len(engines)} rollout engine(s) could not form their {self.backend} groups: "
                f"{str(exc).splitlines()[-1]}. If the rollout nodes cannot reach the train nodes "
                "directly, set rollout.weight_sync=object_store"
            ) from exc
        return layout


def settle(refs: list[Any]) -> list[Any]:
    """``ray.get`` of every call, waiting for each even after one failed (a receiver still in the
    broadcast would take the next refit's calls after it), then the first error: an actor's death
    first, as it names the one gone."""
    import ray

    results, errors = [], []
    for ref in refs:
        try:
            results.append(ray.get(ref))
        except Exception as exc:
            errors.append(exc)
    if errors:
        died = [e for e in errors if isinstance(e, ray.exceptions.RayActorError)]
        raise (died or errors)[0]
    return results
