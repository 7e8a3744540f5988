"""The norm every family's layer spec fills its norm slots with: ``SPNorm``, torch's RMSNorm that can
run sequence parallel (Megatron's torch-norm wrapper refuses it: only Transformer Engine's or Apex's
norms could), with Megatron's zero-centred weight (Gemma 3) or fp32 products (Gemma 4) when asked.
Family-free."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class SPNorm(torch.nn.RMSNorm):
    """Megatron's norm slot filled with torch's RMSNorm, sequence parallel allowed; with Megatron's
    ``layernorm_zero_centered_gamma`` (Gemma) the weight is an offset from 1. Under sequence
    parallelism each TP rank normalises its own slice of the sequence, so the weight's gradient is
    partial: it is marked ``sequence_parallel`` and summed over TP by the trainer, as Megatron's own
    fused norms do."""

    in_fp32 = False
    """Gemma 4: ``x * w`` computed in fp32, as Hugging Face does (the zero-centred norms always are)."""

    def __init__(self, config: Any, hidden_size: int, eps: float | None = None, **_: Any) -> None:
        # eps: what the caller passes (TransformerLayer, the blocks, 0.19's MambaLayer), else the
        # config's (0.16's MambaLayer passes none)
        super().__init__(hidden_size, eps=config.layernorm_epsilon if eps is None else eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]
        self.zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered or self.in_fp32:  # Gemma 3: x * (1 + w); Gemma 4: x * w; in fp32 as HF does
            normed = F.rms_norm(x.float(), self.normalized_shape, None, self.eps)
            y = (normed * (self.weight.float() + float(self.zero_centered))).type_as(x)
        else:
            y = super().forward(x)
        if torch.is_autocast_enabled(x.device.type):
            # The next matmul casts to this anyway (same numbers). Under sequence parallelism it also
            # must: Megatron's linear reduce-scatters its input gradient into a buffer of the input's
            # dtype, and with fp32 parameters + autocast that gradient is bf16 (NCCL refuses the mix).
            y = y.to(torch.get_autocast_dtype(x.device.type))
        return y
