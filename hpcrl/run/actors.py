"""Ray actors: trainer ranks and rollout engines, placed on nodes by role resources.

Every node advertises ``hpcrl_train`` and/or ``hpcrl_rollout`` resources (one unit per GPU of that
role); an actor asks for one unit of its role, so the topology decides where it lands.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

TRAIN_RESOURCE = "hpcrl_train"
ROLLOUT_RESOURCE = "hpcrl_rollout"


def ray_node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())


def _threads() -> None:
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))


class TrainerActor:
    """One training rank. Built in two steps: rank 0 first names the rendezvous address on its
    own node (``endpoint``), then every rank joins it (``setup``)."""

    def __init__(self, model_dir: str, cfg: Any, rank: int, world: int, device: str) -> None:
        _threads()
        self.model_dir, self.cfg, self.rank, self.world, self.device = model_dir, cfg, rank, world, device
        self.trainer: Any = None

    def endpoint(self) -> str:
        from hpcrl.trainer.fsdp import free_port

        if self.world == 1:
            return f"127.0.0.1:{free_port()}"
        ip = ray_node_ip()
        return f"{ip}:{free_port(ip)}"

    def setup(self, master: str) -> bool:
        from hpcrl.trainer import make_trainer

        self.trainer = make_trainer(
            Path(self.model_dir), self.cfg, self.rank, self.world, master, self.device
        )
        return True

    def where(self) -> dict[str, Any]:
        return {"role": "train", "rank": self.rank, "host": socket.gethostname(), "pid": os.getpid()}

    def data_rank(self) -> tuple[int, int]:
        return self.trainer.data_rank()

    def ref_logprobs(self, batch: Any) -> Any:
        return self.trainer.logprobs(batch, reference=True)

    def train_step(self, batch: Any, ref_logp: Any) -> dict[str, float]:
        return self.trainer.train_step(batch, ref_logp)

    def export_weights(self) -> dict[str, Any]:
        return self.trainer.export_weights()

    # -- weight broadcast to the engines (hpcrl.sync.broadcast); rank 0 is the sender ----------------
    def weight_metas(self) -> list[tuple[str, tuple[int, ...]]]:
        """Names and shapes of the exported weights (a collective: every rank calls it; rank 0 answers)."""
        weights = self.trainer.export_weights()
        return [(name, tuple(t.shape)) for name, t in weights.items()] if self.rank == 0 else []

    def weight_endpoint(self) -> str:
        from hpcrl.trainer.fsdp import free_port

        ip = ray_node_ip()
        return f"{ip}:{free_port(ip)}"

    def join_weight_group(
        self, master: str, world: int, metas: list[Any], bucket_numel: int, dtype: str, backend: str
    ) -> None:
        from hpcrl.sync.broadcast import join_as_sender

        self.sender = join_as_sender(backend, master, world, metas, bucket_numel, dtype, self.device)

    def send_weights(self) -> dict[str, float]:
        """Export (every rank) and broadcast (rank 0): seconds of each part and the bytes sent."""
        import time

        start = time.perf_counter()
        weights = self.trainer.export_weights()
        exported = time.perf_counter()
        sent = self.sender.send(weights) if self.rank == 0 else 0
        return {"export_s": exported - start, "broadcast_s": time.perf_counter() - exported, "bytes": sent}

    def save_checkpoint(self, path: str, async_save: bool) -> float:
        return float(self.trainer.save_checkpoint(path, async_save))

    def finish_checkpoint(self) -> float:
        return float(self.trainer.finish_checkpoint())

    def load_checkpoint(self, path: str, weights_only: bool) -> None:
        self.trainer.load_checkpoint(path, weights_only)


class RolloutActor:
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
        from hpcrl.rollout.config import VLLMRolloutConfig

        rollout = cfg.rollout
        self.engine: Any
        if isinstance(rollout, VLLMRolloutConfig):
            from hpcrl.rollout.vllm_engine import VLLMEngine

            self.engine = VLLMEngine(
                Path(model_dir),
                rollout,
                seed=cfg.run.seed,
                max_model_len=max_model_len,
                on_cpu=on_cpu,
                scratch=Path(scratch),
                kv_cache_gb=kv_cache_gb,
            )
        else:
            from hpcrl.rollout.hf_engine import HFEngine

            self.engine = HFEngine(Path(model_dir), rollout, device="cpu" if on_cpu else "cuda")

    def where(self) -> dict[str, Any]:
        return {"role": "rollout", "host": socket.gethostname(), "pid": os.getpid()}

    def generate(self, prompts: list[list[int]], settings: Any) -> Any:
        return self.engine.generate(prompts, settings)

    def load_weights(self, weights: dict[str, Any]) -> bool:
        self.engine.load_weights(weights)
        return True

    def weight_ranks(self) -> tuple[int, str, str]:
        """(ranks this engine takes in the weight group, the dtype it wants, this node's address)."""
        return self.engine.ranks, self.engine.weight_dtype, ray_node_ip()

    def join_weight_group(
        self,
        master: str,
        rank_base: int,
        world: int,
        metas: list[Any],
        bucket_numel: int,
        local_ip: str,
        backend: str,
    ) -> None:
        self.engine.join_weight_group(master, rank_base, world, metas, bucket_numel, local_ip, backend)

    def receive_weights(self) -> bool:
        self.engine.receive_weights()
        return True
