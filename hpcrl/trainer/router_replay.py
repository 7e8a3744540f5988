"""Router replay (R3, ``trainer.router_replay``) on transformers' MoE models: each MoE router's
choice of experts is replaced by the rollout engine's (``TrainBatch.routes``), and its routing
weights are recomputed from the trainer's own router scores at those experts, with the router's own
normalisation, so the loss still differentiates through the router.

A forward hook on each decoder layer's router (``Qwen3MoeTopKRouter``, ``Gemma4TextRouter``,
``NemotronHTopkRouter``: each returns (scores, top-k weights, top-k ids), which its MoE block hands to
the experts, the expert-parallel dispatch included) swaps the last two. The routes of the forward in
progress sit on the ``RouteReplay`` object, not in a context, because a checkpointed layer runs its
forward again in the backward: they stay until the next forward sets its own. A position whose route
is -1 (padding, the last token, a sample the engine sent no routes for) keeps the router's own choice.

MTP layers (Nemotron-H's ``mtp`` block, trainer/mtp.py; megatron's ``mtp_block``) route freely on both
backends while the decoder's routers replay. The engine records the routers of its model's decoder
only (rollout/vllm_routes.py binds to the runner's model, not a drafter); without speculative decoding
no MTP layer runs there at all, and with it the MTP head drafts from accepted positions, not from the
bonus tokens, so its routes could not cover the positions the trainer scores (depth k at position t:
t's hidden state and token t+k+1's embedding). Each MTP router keeps its own choice and weights, as in
NeMo RL's router replay (MTP routers skipped by default), miles (R3 bypassed for the MTP layer) and
verl (no routes for MTP layers). Only the decoder's layers are hooked here (``get_decoder().layers``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _softmax_weights(router: Any, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE: softmax over the logits, the chosen experts' share (renormalised if configured)."""
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def _gemma4_weights(router: Any, probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gemma 4: the probabilities it returns, renormalised over the chosen, times each one's scale."""
    weights = probs.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True) * router.per_expert_scale[ids]


def _sigmoid_weights(router: Any, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Nemotron-H: sigmoid scores (without the correction bias, which only steers the choice)."""
    weights = logits.sigmoid().gather(1, ids)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


WEIGHTS: dict[str, Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "Qwen3MoeTopKRouter": _softmax_weights,
    "Gemma4TextRouter": _gemma4_weights,
    "NemotronHTopkRouter": _sigmoid_weights,
}
"""Each router class's routing weights at given experts, from the scores it returns first."""


class RouteReplay:
    """Hooks on a model's routers; ``routes`` [tokens, layers, k] (the forward's tokens in row-major
    order, -1: free) is what the next forwards replay (None: every router chooses)."""

    def __init__(self, model: Any) -> None:
        self.routes: torch.Tensor | None = None
        found = 0
        for index, layer in enumerate(model.get_decoder().layers):
            for router in (m for m in layer.modules() if type(m).__name__ in WEIGHTS):
                router.register_forward_hook(self._hook(index))
                found += 1
        if not found:
            raise ValueError(
                f"trainer.router_replay=true: {type(model).__name__} has no router hpcrl can replay "
                f"({', '.join(WEIGHTS)}); set trainer.router_replay=false"
            )

    def _hook(self, layer: int) -> Callable[..., Any]:
        def replay(router: Any, _inputs: Any, out: tuple[torch.Tensor, ...]) -> Any:
            if self.routes is None:
                return None
            scores, _, own = out
            given = self.routes[:, layer].to(own.device, torch.long)
            if given.shape != own.shape:
                raise ValueError(
                    f"router replay: routes for {tuple(given.shape)} (tokens, k) at layer {layer}, "
                    f"the forward routes {tuple(own.shape)}"
                )
            ids = torch.where(given >= 0, given, own)
            return scores, WEIGHTS[type(router).__name__](router, scores, ids), ids

        return replay


def install(model: Any) -> RouteReplay:
    """Replay routes on ``model`` (before sharding); the object whose ``routes`` each forward reads."""
    replay = RouteReplay(model)
    model.hpcrl_route_replay = replay
    return replay


def set_routes(model: Any, routes: torch.Tensor | None) -> None:
    """The routes of ``model``'s next forwards: [rows, T, layers, k] as the forward's input_ids
    [rows, T] lay out the tokens (None: the routers choose). No-op on a model without replay."""
    replay = getattr(model, "hpcrl_route_replay", None)
    if replay is not None:
        replay.routes = None if routes is None else routes.reshape(-1, *routes.shape[2:])
