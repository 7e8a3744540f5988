"""Router replay (``trainer.router_replay``) in megatron-core's routers: each ``TopKRouter`` takes the
rollout engine's experts (``TrainBatch.routes``) through its ``router_replay`` slot, which
``topk_routing_with_score_function`` asks for the top-k instead of computing it. The slot gets hpcrl's
``LayerReplay``, not megatron-core's ``RouterReplay``: that one keeps a process-wide list of every
router built (the reference model's too) and cannot leave a position to the router (-1 here: padding,
a row's last token). The probabilities are the router's scores gathered at the replayed experts, then
normalised and scaled as megatron-core does for its own choice, so the router keeps its gradient.

Token order: a router sees its rank's tokens sequence-first ([s, b] flattened), the sequence split
over context parallel (``Pipeline.cp_split``) and, under sequence parallel (every MoE layout with
TP > 1), over the TP ranks; ``local_routes`` cuts the batch's routes the same way. The routes of the
micro-batch in flight sit on ``RouteReplay``, set by the pipeline before each forward. A layer
recomputed in the backward (``trainer.activation_checkpointing``: megatron-core's checkpoint runs the
first forward without grad, the recompute with it) must replay the routes of its own micro-batch,
while a pipeline schedule runs later micro-batches' forwards first: each router queues what its
checkpointed forwards replayed and its recomputes take them back in order (backwards run in the
forwards' order, as megatron-core's own ``RouterReplay`` relies on).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch


class RouteReplay:
    """The routes the next forwards replay: [tokens, layers, k] in the routers' token order (None:
    the routers choose)."""

    def __init__(self) -> None:
        self.routes: torch.Tensor | None = None


class LayerReplay:
    """One router's ``router_replay``: decoder layer ``layer``'s column of the routes; ``recomputes``:
    the layer is recomputed in the backward (its forward and recompute pair up through ``queued``)."""

    def __init__(self, replay: RouteReplay, layer: int, router: Any, recomputes: bool) -> None:
        self.replay, self.layer, self.router, self.recomputes = replay, layer, router, recomputes
        self.queued: deque[torch.Tensor | None] = deque()

    def _given(self) -> torch.Tensor | None:
        routes = self.replay.routes
        given = None if routes is None else routes[:, self.layer]
        if not (self.recomputes and self.router.training):
            return given
        if torch.is_grad_enabled():  # the backward's recompute of a checkpointed forward
            return self.queued.popleft() if self.queued else given  # (empty: a layer not checkpointed)
        self.queued.append(given)
        return given

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None,
        group_topk: int | None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        given = self._given()
        if given is None:
            return values, own
        given = given.to(own.device, torch.long)
        if given.shape != own.shape:
            raise ValueError(
                f"router replay: routes for {tuple(given.shape)} (tokens, k) at layer {self.layer}, "
                f"the router sees {tuple(own.shape)}"
            )
        ids = torch.where(given >= 0, given, own)
        return scores.gather(1, ids), ids


def install(model: Any, replay: RouteReplay, recomputes: bool) -> int:
    """Every top-k router of ``model``'s decoder replays from ``replay``; how many there are. The MTP
    layers' routers (``mtp_block``, trainer/megatron/mtp.py) route freely, as fsdp's do: the engine
    records the decoder's routes only (module docstring of trainer/router_replay.py)."""
    from megatron.core.transformer.moe.router import TopKRouter

    mtp = getattr(model, "mtp_block", None)
    free = {id(m) for m in mtp.modules()} if mtp is not None else set()
    routers = [m for m in model.modules() if isinstance(m, TopKRouter) and id(m) not in free]
    for router in routers:  # layer_number: 1-based over the whole model (every pipeline stage)
        router.router_replay = LayerReplay(replay, router.layer_number - 1, router, recomputes)
    return len(routers)


def local_routes(
    routes: torch.Tensor, tp: int, cp_split: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """[b, s, layers, k] -> this rank's router tokens [s_local * b, layers, k] (module docstring)."""
    from megatron.core import parallel_state as ps

    seq_first = cp_split(routes).transpose(0, 1)
    if tp > 1:
        seq_first = seq_first.chunk(tp, dim=0)[ps.get_tensor_model_parallel_rank()]
    return seq_first.reshape(-1, *routes.shape[2:])
