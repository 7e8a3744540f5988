"""The megatron backend's Mamba-2 mixer (ssm.TorchMambaMixer, inside the Megatron model built from
MODEL_DIR) and transformers' NemotronHMamba2Mixer of the same checkpoint on the same large input
(large, so that the dt floor moves the output well above rounding), with the floor (``time_step_min``)
and without it (Megatron's kernels' (0, inf)): outputs and input gradients, for
tests/megatron/test_megatron_nemotron_h.py to compare.

``mixer_check`` runs as a case of tests/harness/recipe_build.py (the session's one-rank torchrun); on its
own, one rank in plain python (MASTER_PORT set), it saves the comparison to OUT:

    MASTER_PORT=29861 python tests/harness/mamba_mixer_check.py MODEL_DIR OUT
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from hpcrl.config.compose import compose_config

OVERRIDES = ["model=tiny", "trainer=megatron", "trainer.precision=float32"]


def run(mixer: torch.nn.Module, x: torch.Tensor, megatron: bool) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_()
    out = mixer(x.transpose(0, 1))[0].transpose(0, 1) if megatron else mixer(x)  # Megatron: [s, b, h]
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad.clone()}


def mixer_check(trainer: Any, model_dir: Path) -> dict[str, Any]:
    """Layer 0's mixer of a megatron trainer built from ``model_dir`` against transformers' of it."""
    from transformers import AutoModelForCausalLM

    ours = trainer.model.decoder.layers[0].mixer
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).model.layers[0].mixer
    x = torch.randn(2, 19, theirs.hidden_size, generator=torch.Generator().manual_seed(0)) * 30
    result = {
        "module": type(ours).__name__,
        "floor": {"ours": run(ours, x, True), "hf": run(theirs, x, False)},
    }
    ours.dt_min, theirs.time_step_limit = 0.0, (0.0, float("inf"))
    result["no floor"] = {"ours": run(ours, x, True), "hf": run(theirs, x, False)}
    return result


def main() -> None:
    from hpcrl.trainer import make_trainer

    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    master = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', 29500)}"
    trainer = make_trainer(model_dir, compose_config(OVERRIDES), 0, 1, master, "cpu")
    torch.save(mixer_check(trainer, model_dir), out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
