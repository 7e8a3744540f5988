"""trainer.kernels: which Mamba-2 path each backend runs (trainer/kernels.py). The fused kernels run
only on a GPU with mamba_ssm and causal_conv1d (bench/kernels_gpu.py --parity checks their numbers);
here the selection, the key's validation and the torch fallback."""

from __future__ import annotations

import logging

import pytest
import torch

from hpcrl.config.compose import compose_config
from hpcrl.errors import ConfigError
from hpcrl.trainer import kernels


def test_selection_follows_mode_device_and_what_imports():
    have = kernels.installed()
    try:  # what this host really has decides auto on a GPU
        import causal_conv1d  # noqa: F401
        import mamba_ssm  # noqa: F401

        both = True
    except ImportError:
        both = False
    assert have.mamba == both
    assert kernels.select("auto", "cuda:0").mamba == have.mamba
    for mode, device in (("auto", "cpu"), ("torch", "cuda:0"), ("torch", "cpu")):
        chosen = kernels.select(mode, device)
        assert not chosen.mamba and chosen.scan is None and chosen.conv is None, (mode, device)
        assert chosen.transformer_engine == have.transformer_engine
    with pytest.raises(ValueError, match=r"trainer\.kernels=.fast."):
        kernels.select("fast", "cpu")


def test_configure_logs_the_path_once_and_sets_the_active_kernels(caplog):
    with caplog.at_level(logging.WARNING, logger="hpcrl.trainer.kernels"):
        kernels.configure("torch", "cpu")
        kernels.configure("torch", "cpu")
    said = [r.getMessage() for r in caplog.records if "trainer.kernels" in r.getMessage()]
    assert len(said) <= 1 and kernels.active() == kernels.select("torch", "cpu")
    assert "torch SSD scan" in kernels.active().describe()
    assert kernels.active_for(torch.zeros(1)) is kernels.TORCH


def test_the_key_is_typed_and_refused_by_name():
    cfg = compose_config(["trainer=megatron", "trainer.kernels=torch"])
    assert cfg.trainer.kernels == "torch"
    assert compose_config([]).trainer.kernels == "auto"
    with pytest.raises(ConfigError, match="kernels"):
        compose_config(["trainer.kernels=fast"])


def test_transformers_torch_functions_come_back_and_run():
    """``trainer.kernels=torch``: each function transformers bound is replaced by the torch function it
    wraps (here, with no kernels, the same math): the conv gives F.conv1d's causal numbers."""
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    changed = kernels.use_torch_in_transformers()
    assert set(changed) <= set(kernels.TRANSFORMERS_FUNCTIONS) and "causal_conv1d_fn" in changed
    assert not hasattr(hf.causal_conv1d_fn, "__wrapped__")
    x, w = torch.randn(1, 3, 7), torch.randn(3, 4)
    want = torch.nn.functional.conv1d(x, w[:, None], padding=3, groups=3)[..., :7]
    assert torch.allclose(hf.causal_conv1d_fn(x, w), want, atol=1e-6)
    assert hf.mamba2_split_conv1d_scan_combined(*[None] * 7) is None  # the step-by-step path runs


def test_megatron_mixer_conv_falls_back_to_torch_with_packed_rows():
    """The megatron mixer's conv without a kernel: SiLU of hpcrl's per-sequence causal conv."""
    from hpcrl.trainer.megatron.mamba_cp import MambaCP
    from hpcrl.trainer.ssd import causal_conv

    cp = MambaCP(None, heads=2, groups=1, state=2, head_dim=2)
    conv = torch.nn.Conv1d(8, 8, 4, groups=8, padding=3)
    xbc = torch.randn(1, 9, 8)
    seq_idx = torch.tensor([[0] * 4 + [1] * 5], dtype=torch.int32)
    got = cp.conv(xbc, conv, seq_idx)
    want = torch.nn.functional.silu(causal_conv(xbc.transpose(1, 2), conv.weight, conv.bias, seq_idx))
    assert torch.allclose(got, want.transpose(1, 2), atol=1e-6)
    alone = cp.conv(xbc[:, 4:], conv)  # the second sequence starts from zeros, as if alone
    assert torch.allclose(got[:, 4:], alone, atol=1e-6)
