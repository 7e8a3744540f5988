"""Megatron's full activation recompute under mixed precision: megatron-core's
``tensor_parallel.checkpoint`` re-runs each layer inside the backward pass, after the schedule's bf16
autocast has ended, and does not restore it (the GPU's recompute ran in fp32, session 30).
``model.keep_autocast_in_recompute`` has each decoder layer enter the autocast itself: the gradients
are then those of the forward the loss saw. The CPU's bf16 autocast stands in for the GPU's, and plain
linear layers for Megatron's (whose autograd functions keep CUDA's autocast state only); the
checkpoint is megatron-core's own, called as its uniform full recompute calls it."""

from __future__ import annotations

from types import SimpleNamespace

import torch


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(32, 32)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + torch.tanh(self.fc(hidden_states)).float()


def model_of(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList(Layer() for _ in range(layers))
    return model


def grads(model: torch.nn.Module, x: torch.Tensor, recompute: bool) -> list[torch.Tensor]:
    """A forward under bf16 autocast (each layer checkpointed when ``recompute``), the backward outside it."""
    from megatron.core.tensor_parallel import checkpoint

    model.zero_grad(set_to_none=True)
    h = x
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for layer in model.decoder.layers:
            h = checkpoint(layer, False, h) if recompute else layer(h)
    h.square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_recomputed_layers_run_under_the_forwards_autocast():
    from hpcrl.trainer.megatron import compat
    from hpcrl.trainer.megatron.model import keep_autocast_in_recompute

    compat.prepare("cpu")  # megatron-core's checkpoint forks the CUDA RNG: the CPU's here
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    plain = grads(model_of(3), x, recompute=False)
    dropped = grads(model_of(3), x, recompute=True)  # megatron-core as it is: the recompute in fp32
    assert not all(torch.equal(a, b) for a, b in zip(dropped, plain, strict=True))

    model = model_of(3)
    config = SimpleNamespace(
        enable_autocast=True, autocast_dtype=torch.bfloat16, recompute_granularity="full"
    )
    keep_autocast_in_recompute(model, config, device_type="cpu")
    seen: list[bool] = []
    for layer in model.decoder.layers:
        layer.fc.register_forward_pre_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
    kept = grads(model, x, recompute=True)
    assert seen == [True] * 6  # each layer's forward and its recompute
    assert all(torch.equal(a, b) for a, b in zip(kept, plain, strict=True))


def test_without_recompute_or_autocast_the_layers_stay_as_built():
    from hpcrl.trainer.megatron.model import keep_autocast_in_recompute

    for enable_autocast, granularity in ((False, "full"), (True, None)):
        model = model_of(1)
        config = SimpleNamespace(
            enable_autocast=enable_autocast, autocast_dtype=torch.bfloat16, recompute_granularity=granularity
        )
        keep_autocast_in_recompute(model, config, device_type="cpu")
        assert "forward" not in vars(model.decoder.layers[0])
