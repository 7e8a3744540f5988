"""Ray actors: trainer ranks and rollout engines, placed on nodes by role resources.

Every node advertises ``hpcrl_train`` and/or ``hpcrl_rollout`` (or ``hpcrl_judge``) resources (one unit per GPU of that
role); an actor asks for one unit of its role, so the topology decides where it lands. Environment
nodes advertise ``hpcrl_env`` (``ENV_RESOURCE``, one unit a node) and no GPU.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcrl.envs.config import ENV_RESOURCE as ENV_RESOURCE  # beside the other roles' resources

if TYPE_CHECKING:
    from hpcrl.core.parallel import TrainParallel
    from hpcrl.rollout.base import Completion, Prompt, RolloutEngine, SamplingSettings

TRAIN_RESOURCE = "hpcrl_train"
ROLLOUT_RESOURCE = "hpcrl_rollout"
JUDGE_RESOURCE = "hpcrl_judge"
"""Advertised by the judge nodes (``rewards.judge.nodes``), one unit a GPU: judge engines ask for it."""


CPU_ROLES = ("env",)
"""Roles whose nodes hold no GPU for Ray (environment nodes), whatever the node has."""


def role_gpus(role: str, node_gpus: int) -> int:
    """The GPUs a node of ``role`` gives Ray: none on a CPU role's node."""
    return 0 if role in CPU_ROLES else node_gpus


def role_resources(role: str, gpus: int) -> dict[str, int]:
    """A node's Ray resources by its role (``Plan.node_roles()``): ``hpcrl_<role>``, one unit a GPU
    (one on a node of none); a node of two roles (``train+rollout``) advertises both. A new role's resource
    follows by name. Slurm (``ray_cluster.start_node``) and KubeRay (``kuberay``) both take it from here."""
    return {f"hpcrl_{part}": gpus or 1 for part in role.split("+")}


def ray_node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())


def _threads() -> None:
    """As many threads as CPUs this process may run on (a Slurm job's cpuset, not the whole node)."""
    import torch

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))


class TrainerActor:
    """One training rank. Built in two steps: rank 0 first names the rendezvous address on its
    own node (``endpoint``), then every rank joins it (``setup``)."""

    def __init__(self, model_dir: str, cfg: Any, rank: int, par: TrainParallel, device: str) -> None:
        """``par``: the plan's training degrees (``Fleet`` hands each rank ``plan.topology.train``)."""
        _threads()
        self.model_dir, self.cfg, self.rank, self.par, self.device = model_dir, cfg, rank, par, device
        self.world = par.world
        self.trainer: Any = None
        self.sender: Any = None
        """This rank's end of its broadcast group with the engines, where it is a source."""

    def endpoint(self) -> str:
        from hpcrl.trainer.process_group import free_port

        if self.world == 1:
            return f"127.0.0.1:{free_port()}"
        ip = ray_node_ip()
        return f"{ip}:{free_port(ip)}"

    def setup(self, master: str) -> bool:
        from hpcrl.trainer import make_trainer

        self.trainer = make_trainer(
            Path(self.model_dir), self.cfg, self.rank, self.world, master, self.device, self.par
        )
        return True

    def where(self) -> dict[str, Any]:
        return {"role": "train", "rank": self.rank, "host": socket.gethostname(), "pid": os.getpid()}

    def data_rank(self) -> tuple[int, int]:
        return self.trainer.data_rank()

    def release_cache(self) -> None:
        """Hand the CUDA caching allocator's free blocks back to the driver (a no-op off GPUs): after
        the step (its activations) and after the refit (its bucket buffers). Without it that memory
        stays reserved by torch, and colocated engines waking up find it taken (the planner's
        colocated refit and generate phases count only the trainer's weights and optimizer state;
        one H200, 8B shape: 13-15 GB over the plan without, 2.3 GB of buckets after the refit)."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def train_step(self, batch: Any, lr: float | None = None) -> dict[str, float]:
        return self.trainer.train_step(batch, lr)

    # -- weights to the engines (hpcrl/run/refit.py): streamed, bucket by bucket -------------------
    def weight_metas(self) -> list[tuple[str, tuple[int, ...]]]:
        """The tensors this rank sends (names and shapes from parameter metadata)."""
        return self.trainer.weight_metas()

    def weight_endpoint(self) -> str:
        from hpcrl.trainer.process_group import free_port

        ip = ray_node_ip()
        return f"{ip}:{free_port(ip)}"

    def join_weight_group(self, wire: dict[str, Any]) -> None:
        """Every rank: the sources open their group with the engines; all keep the wire dtype (the
        gathers run in it on every rank)."""
        from hpcrl.sync.broadcast import WeightLayout, dtype_of, join_as_sender

        layout = WeightLayout.from_wire(wire)
        self.wire_dtype = dtype_of(layout.dtype)
        if layout.masters and layout.source_index(self.rank) is not None:  # a broadcast's source
            self.sender = join_as_sender(layout, self.rank, self.device)

    def send_weights(self) -> dict[str, float]:
        """Stream into the broadcast (a source) or only help gather (the other ranks)."""
        return self._stream(self.sender.packer() if self.sender else None, self.wire_dtype)

    def send_weights_via(self, engines: list[Any], via: str, wire: dict[str, Any]) -> dict[str, float]:
        """Stream into CUDA IPC handles for the engines on this GPU (``ipc``: every rank feeds its
        own) or into Ray's object store for every engine (``object_store``: the sources)."""
        from hpcrl.sync.broadcast import WeightLayout, dtype_of
        from hpcrl.sync.packer import BucketPacker, ipc_emit, store_emit

        layout = WeightLayout.from_wire(wire)
        index = 0 if via == "ipc" else layout.source_index(self.rank)
        dtype = dtype_of(layout.dtype)
        if index is None or not engines:
            return self._stream(None, dtype)
        emit = ipc_emit(engines) if via == "ipc" else store_emit(engines)
        return self._stream(BucketPacker(layout.buckets(index), dtype, self._device(), emit), dtype)

    def _stream(self, packer: Any, dtype: Any) -> dict[str, float]:
        """``packer`` None: this rank sends nothing but takes part in the gathers (in ``dtype``)."""
        from dataclasses import asdict

        import torch

        from hpcrl.sync.packer import PackStats

        self.trainer.stream_weights(packer, dtype)
        stats = packer.finish() if packer is not None else PackStats()
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # buffers shared by IPC go back to the allocator
        if packer is not None and packer.failed:  # a receiver died: the next refit forms a new group
            self.sender = None
            raise RuntimeError(f"weight sync: sending to the rollout engines failed ({packer.failed})")
        return {k: float(v) for k, v in asdict(stats).items()}

    def _device(self) -> Any:
        import torch

        return next(self.trainer.model.parameters()).device if self.trainer else torch.device("cpu")

    def save_checkpoint(self, path: str, async_save: bool) -> float:
        return float(self.trainer.save_checkpoint(path, async_save))

    def finish_checkpoint(self) -> float:
        return float(self.trainer.finish_checkpoint())

    def load_checkpoint(self, path: str, weights_only: bool) -> None:
        self.trainer.load_checkpoint(path, weights_only)


class RolloutActor:
    """One rollout engine (any ``RolloutEngine``), on its node's GPUs; the driver's ``Fleet`` calls it."""

    def __init__(
        self,
        model_dir: str,
        cfg: Any,
        max_model_len: int,
        scratch: str,
        on_cpu: bool,
        kv_cache_gb: float | None,
    ) -> None:
        _threads()
        import torch

        from hpcrl.rollout.build import build_engine

        self.engine: RolloutEngine = build_engine(
            Path(model_dir),
            cfg.rollout,
            seed=cfg.run.seed,
            max_model_len=max_model_len,
            on_cpu=on_cpu,
            scratch=Path(scratch),
            kv_cache_gb=kv_cache_gb,
            routes=cfg.trainer.router_replay,
        )
        self.threads = torch.get_num_threads()  # as the engine left it (vLLM on CPU sets its own)

    def _engine_threads(self) -> None:
        """torch's (OpenMP's) thread count is per calling thread, and vLLM's CPU attention checks that
        every call runs with the count the engine was built with: with in-flight updates calls come
        on a pool thread. vLLM's CPU worker replaces ``torch.set_num_threads`` by a no-op after it
        binds its threads, hence torch's own setter."""
        import torch

        if torch.get_num_threads() != self.threads:
            torch._C._set_num_threads(self.threads)  # type: ignore[attr-defined]

    def where(self) -> dict[str, Any]:
        return {"role": "rollout", "host": socket.gethostname(), "pid": os.getpid()}

    def generate(self, prompts: list[Prompt], settings: SamplingSettings) -> list[list[Completion]]:
        self._engine_threads()
        return self.engine.generate(prompts, settings)

    def prefix_cache_counts(self) -> tuple[int, int] | None:
        """(tokens looked up, found) in the engine's prefix cache so far; None: the engine keeps none."""
        return self.engine.prefix_cache_counts()

    def generate_stream(
        self, prompts: list[Prompt], settings: SamplingSettings
    ) -> Iterator[list[tuple[int, list[Completion]]]]:
        """A Ray streaming generator: lists of (prompt index, group) as groups finish."""
        self._engine_threads()
        yield from self.engine.generate_stream(prompts, settings)

    def load_weights(self, weights: dict[str, Any]) -> bool:
        self._engine_threads()
        self.engine.load_weights(weights)
        return True

    def pause_generation(self) -> bool:
        """Hold generation between steps for a refit (``rollout.inflight_update``: the actor runs
        calls concurrently, so this can arrive while ``generate_stream`` runs)."""
        self.engine.gate.pause()
        return True

    def resume_generation(self, version: int) -> bool:
        """Generation goes on under the new weights, which are policy ``version``."""
        self.engine.gate.resume(version)
        return True

    def load_ipc(self, args: Any, entries: list[Any]) -> bool:
        self._engine_threads()
        self.engine.load_ipc(args, entries)
        return True

    def sleep(self) -> bool:
        self._engine_threads()
        self.engine.sleep()
        return True

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self._engine_threads()
        self.engine.wake_up(tags)
        return True

    def finish_refit(self) -> bool:
        """After the last bucket: caches computed with the old weights are dropped."""
        self._engine_threads()
        self.engine.finish_refit()
        return True

    def weight_ranks(self) -> tuple[int, str, str]:
        """(ranks this engine takes in the weight group, the dtype it wants, this node's address)."""
        return self.engine.ranks, self.engine.weight_dtype, ray_node_ip()

    def join_weight_group(self, wire: dict[str, Any], rank_base: int, local_ip: str) -> None:
        self._engine_threads()
        self.engine.join_weight_group(wire, rank_base, local_ip)

    def receive_weights(self) -> dict[str, float]:
        self._engine_threads()
        return dict(self.engine.receive_weights())
