"""Packed rows through transformers' Nemotron-H Mamba layers: each sequence's conv and scan start
from zeros (``trainer.packing``).

The packed forward passes ``seq_idx`` (each token's sequence, ``trainer/ssd.py``) as a model keyword;
transformers hands a Mamba mixer's keywords on to its conv and scan functions. Where the kernels run
(``trainer/kernels.py``: mamba_ssm and causal_conv1d installed, a GPU, ``trainer.kernels=auto``),
those take ``seq_idx`` themselves (the fused training path too). Where they do not, transformers'
torch stand-ins drop it: here the conv is wrapped to run hpcrl's segmented conv when ``seq_idx``
comes, and the scan to run hpcrl's scan on every forward without a cache (one memory bound whatever
transformers' version); the hf engine's cached prefill keeps transformers' functions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from hpcrl.trainer import kernels as fused
from hpcrl.trainer.ssd import causal_conv, ssd_scan


def use_kernels(mode: str, device: str) -> fused.Kernels:
    """``trainer.kernels`` for transformers' Nemotron-H mixer: where the kernels are installed but not
    chosen (``torch``, or a CPU model), transformers' own torch functions go back in its module."""
    chosen = fused.configure(mode, device)
    if not chosen.mamba and fused.installed().mamba:
        fused.use_torch_in_transformers()
    return chosen


def reset_at_sequence_starts(kernels: fused.Kernels) -> None:
    """Wrap the torch stand-ins of transformers' Nemotron-H (once per process) where the kernels do
    not run."""
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    if kernels.mamba:
        return
    wrappers: dict[str, Callable[..., torch.Tensor]] = {"causal_conv1d_fn": _conv, "mamba2_chunk_scan": _scan}
    for name in wrappers:
        current = getattr(hf, name)
        if not getattr(current, "hpcrl_segments", False):
            wrapped: Any = functools.partial(wrappers[name], current)
            wrapped.hpcrl_segments = True
            setattr(hf, name, wrapped)


def _conv(
    torch_conv: Callable[..., torch.Tensor],
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    seq_idx: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``causal_conv1d_fn`` (x [b, channels, L], weight [channels, k]), per sequence with ``seq_idx``."""
    if seq_idx is None:
        return torch_conv(hidden_states, weight, bias, activation=activation, **kwargs)
    from transformers.activations import ACT2FN

    out = causal_conv(hidden_states.to(weight.dtype), weight[:, None], bias, seq_idx)
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


def _scan(
    torch_scan: Callable[..., torch.Tensor],
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,  # A, B, C, D: transformers' keyword names
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    seq_idx: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``mamba2_chunk_scan`` without a cache (training and log-prob forwards, packed with ``seq_idx``
    or not): the same dt (bias, softplus, limits) and D's skip around hpcrl's scan. Unpacked rows come
    here too because transformers' own torch scan differs in memory by version (5.17 builds C x B over
    the state: 64 GiB for one Super-width Mamba layer at 4 x 2048); with a cache (the hf engine's
    prefill) it runs as before."""
    cached = kwargs.get("initial_states") is not None or bool(kwargs.get("return_final_states"))
    if cached or kwargs.get("z") is not None:
        if seq_idx is not None:
            raise ValueError("packed rows (seq_idx) run without a cache")
        return torch_scan(
            hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
            dt_limit=dt_limit, **kwargs,
        )  # fmt: skip
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])  # in dt's dtype, as transformers clamps
    y = ssd_scan(hidden_states, dt, A, B, C, chunk_size, seq_idx)
    return y if D is None else y + hidden_states.float() * D.float()[:, None]
