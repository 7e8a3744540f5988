"""Which fused kernels the trainer runs, in one place for both backends (``trainer.kernels``).

Nemotron-H's Mamba-2 mixer has two implementations of its sequence mixing: mamba_ssm's Triton SSD
scan (``mamba_chunk_scan_combined``) and gated RMSNorm (``rmsnorm_fn``) with causal_conv1d's CUDA conv
(``causal_conv1d_fn``), where those packages install (NGC images; ``bench/device_runs/s24_kernels.sh``
builds them for sm_90), and hpcrl's torch paths (``trainer/ssd.py``) everywhere else. Both take a
packed row's ``seq_idx``, so packing holds either way. ``trainer.kernels``:

- ``auto`` (default): the kernels when all three import and the model is on a GPU, else torch;
- ``torch``: the torch paths even where the kernels are installed (parity checks, debugging).

The megatron mixer (``megatron/ssm.py``) asks ``active()`` at each forward; the fsdp backend runs
transformers' Nemotron-H mixer, which binds the kernels itself when they import, so ``torch`` puts
transformers' own torch functions back in its module (``use_torch_in_transformers``). Transformer
Engine is reported here too; whether a layer spec uses it is spec.py's choice (``trainer.kernels``
does not change it). ``configure`` logs the path once per process.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kernels:
    """The fused functions in use (None: the torch path)."""

    scan: Any = None  # mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined
    norm: Any = None  # mamba_ssm.ops.triton.layernorm_gated.rmsnorm_fn
    conv: Any = None  # causal_conv1d.causal_conv1d_fn
    transformer_engine: bool = False

    @property
    def mamba(self) -> bool:
        """The Mamba mixer runs fused: scan, norm and conv all there."""
        return self.scan is not None and self.norm is not None and self.conv is not None

    def describe(self) -> str:
        mamba = (
            "mamba_ssm scan + gated norm, causal_conv1d conv"
            if self.mamba
            else "torch SSD scan, gated norm and conv (trainer/ssd.py)"
        )
        return f"Mamba-2 mixer: {mamba}; Transformer Engine: {'installed' if self.transformer_engine else 'absent'}"


TORCH = Kernels()


@functools.cache
def installed() -> Kernels:
    """What imports in this process (once): the Mamba kernels only all together."""
    te = _imports("transformer_engine")
    try:
        from causal_conv1d import causal_conv1d_fn
        from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError:  # either package absent, or built against another torch
        return Kernels(transformer_engine=te)
    return Kernels(mamba_chunk_scan_combined, rmsnorm_fn, causal_conv1d_fn, te)


def _imports(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def select(mode: str, device: str) -> Kernels:
    """The kernels ``trainer.kernels=mode`` runs on ``device``: Triton and the conv are CUDA only."""
    if mode not in ("auto", "torch"):
        raise ValueError(f"trainer.kernels={mode!r}: use auto or torch")
    have = installed()
    if mode == "torch" or not device.startswith("cuda") or not have.mamba:
        return Kernels(transformer_engine=have.transformer_engine)
    return have


_ACTIVE: list[Kernels] = [TORCH]


def configure(mode: str, device: str) -> Kernels:
    """Set this process's kernels (each trainer build; the policy and reference agree) and log the
    path the first time or when it changes."""
    chosen = select(mode, device)
    if chosen != _ACTIVE[0] or not getattr(configure, "logged", False):
        log.warning("[hpcrl] trainer.kernels=%s on %s: %s", mode, device, chosen.describe())
        configure.logged = True  # type: ignore[attr-defined]
    _ACTIVE[0] = chosen
    return chosen


def active() -> Kernels:
    """This process's kernels (the torch paths until ``configure``)."""
    return _ACTIVE[0]


def active_for(t: Any) -> Kernels:
    """The active kernels for a tensor they can run on (CUDA), else the torch paths."""
    k = _ACTIVE[0]
    return k if k.mamba and t.is_cuda else TORCH


TRANSFORMERS_FUNCTIONS = (
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "mamba2_chunk_scan",
    "mamba2_selective_state_update",
    "mamba2_split_conv1d_scan_combined",
)
"""transformers' Nemotron-H module functions that bind mamba_ssm / causal_conv1d at import; each
keeps its torch function as ``__wrapped__`` (the fused training path's returns None: the mixer then
runs its step-by-step path)."""


def use_torch_in_transformers() -> list[str]:
    """Put transformers' torch functions back in its Nemotron-H module (``trainer.kernels=torch``
    where the kernels installed): returns the names changed."""
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    changed = []
    for name in TRANSFORMERS_FUNCTIONS:
        fn = getattr(hf, name, None)
        torch_fn = getattr(fn, "__wrapped__", None)
        if torch_fn is not None:
            setattr(hf, name, torch_fn)
            changed.append(name)
    return changed
