"""Catalog architecture numbers against the parameter counts their publishers state."""

from __future__ import annotations

import pytest

from hpcrl.config.compose import conf_dir
from tests.conftest import compose

MODELS = sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml"))


@pytest.mark.parametrize("name", MODELS)
def test_parameter_count_matches_stated_size(name):
    model = compose(f"model={name}").model
    counts = model.param_counts()
    assert counts.total / 1e9 == pytest.approx(model.stated_params_b, rel=0.08)


def test_qwen2_1p5b_hand_count():
    # embed 151936*1536 (tied) + 28 x (attention 2*1536*12*128 + 2*1536*2*128 + MLP 3*1536*8960)
    counts = compose("model=qwen2_1p5b").model.param_counts()
    assert counts.total == 233_373_696 + 28 * (4_718_592 + 786_432 + 41_287_680)


def test_nemotron_super_active_and_expert_split():
    counts = compose("model=nemotron_super").model.param_counts()
    assert counts.active / 1e9 == pytest.approx(12.0, rel=0.1)
    assert counts.expert / counts.total > 0.9  # LatentMoE experts hold almost all weights


def test_gemma4_moe_active_params():
    counts = compose("model=gemma4_26b_a4b").model.param_counts()
    assert counts.active / 1e9 == pytest.approx(4.0, rel=0.1)


def test_sliding_window_bounds_kv_cache():
    model = compose("model=gemma3_1b").model
    # 26 layers, one global layer in 6: 4 global, 22 local capped at the 512-token window
    per_token = 2 * 1 * 256 * 2
    expected = 22 * per_token * 512 + 4 * per_token * 8192
    assert model.kv_bytes_for_sequence(8192) == expected
