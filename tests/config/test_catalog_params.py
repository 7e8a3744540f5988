"""Nemotron 3 Super's parameter count, tensor by tensor, against its checkpoint's published element
count (Megatron-Bridge's verification card: 123,611,033,088 elements in 42,683 tensors, MTP included)."""

from __future__ import annotations

import pytest

from hpcrl.errors import ConfigError
from tests.conftest import compose

H = 4096
MAMBA = (
    18560 * H + 10240 * 4 + 10240 + 3 * 128 + 8192 + H * 8192
)  # in_proj, conv w/b, A/D/dt_bias, norm, out_proj
ATTENTION = 2 * H * H + 2 * 256 * H  # q, o; k, v (2 KV heads x 128)
MOE_COMMON = 512 * H + 512 + 2 * 1024 * H + 2 * 5376 * H  # router, correction bias, latent projs, shared
EXPERTS = 512 * 2 * 2688 * 1024  # up/down at the 1024-wide latent
MAIN = 40 * MAMBA + 8 * ATTENTION + 40 * (MOE_COMMON + EXPERTS) + 88 * H + 2 * 131072 * H + H


def test_nemotron_super_is_its_checkpoint_exactly():
    counts = compose("model=nemotron_super").model.param_counts()
    assert MAIN == 120_668_707_840  # the notes' per-tensor total
    assert counts.total == 120_668_707_840
    mtp_block = ATTENTION + MOE_COMMON + EXPERTS + 2 * H + 2 * H * H + 3 * H  # *E, eh_proj, 3 norms
    assert counts.mtp == mtp_block
    assert counts.checkpoint == 123_611_033_088  # the Bridge card's element count
    assert counts.expert == 40 * EXPERTS == 112_742_891_520
    assert counts.active == MAIN - 40 * EXPERTS + 40 * 22 * 2 * 2688 * 1024


def test_tp_replicated_and_qkv_parts():
    counts = compose("model=nemotron_super").model.param_counts()
    assert counts.replicated == 40 * (512 * H + 512 + 2 * 1024 * H) + 89 * H
    assert counts.qkv == 8 * H * (32 + 2 * 2) * 128


def test_mtp_layers_without_a_pattern_is_one_clear_error():
    cfg = compose("model=nemotron_super")
    cfg.model.hybrid.mtp_pattern = ""
    with pytest.raises(ConfigError, match=r"model.mtp_layers=1 needs model.hybrid.mtp_pattern"):
        cfg.model.check()
    cfg.model.hybrid.mtp_pattern = "*X"
    with pytest.raises(ConfigError, match="one of M \\* E - each"):
        cfg.model.check()
