"""Composition of the conf/ tree: every shipped YAML composes, both override forms work."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.config.cluster import Scheduler
from hpcrl.config.compose import conf_dir
from hpcrl.config.schema import GROUPS
from hpcrl.errors import ConfigError
from hpcrl.rollout.config import HFRolloutConfig, VLLMRolloutConfig
from hpcrl.trainer.config import FSDPTrainerConfig, MegatronTrainerConfig
from tests.conftest import SITE, compose


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


@pytest.mark.parametrize(
    ("group", "option"),
    [(g, o) for g in GROUPS if g != "experiment" for o in options(g)],
)
def test_every_group_option_composes(group, option):
    cfg = compose(f"{group}={option}", *SITE)
    node = getattr(cfg, group)
    name = getattr(node, "name", None) or getattr(node, "backend", None)
    assert name == option


@pytest.mark.parametrize("recipe", options("experiment"))
def test_every_recipe_composes_and_names_itself(recipe):
    cfg = compose(f"+experiment={recipe}", *SITE)
    assert cfg.run.name == recipe


def test_default_is_the_embedded_local_run():
    cfg = compose()
    assert cfg.cluster.scheduler is Scheduler.local
    assert cfg.model.name == "tiny"
    assert isinstance(cfg.trainer, FSDPTrainerConfig)
    assert isinstance(cfg.rollout, VLLMRolloutConfig)
    assert cfg.data.source == "synthetic"


def test_plus_and_plain_group_overrides_are_equivalent():
    a = compose("+cluster=gb200", "+model=nemotron_super", *SITE)
    b = compose("cluster=gb200", "model=nemotron_super", *SITE)
    assert a == b
    assert a.cluster.gpus_per_node == 4 and a.model.num_layers == 88


def test_experiment_without_plus_is_accepted():
    cfg = compose("experiment=dapo-nemotron-super-5n4g-megatron", *SITE)
    assert cfg.layout.rollout_nodes == 1 and isinstance(cfg.trainer, MegatronTrainerConfig)


def test_group_choice_switches_schema():
    cfg = compose("trainer=megatron", "rollout=hf")
    assert isinstance(cfg.trainer, MegatronTrainerConfig)
    assert isinstance(cfg.rollout, HFRolloutConfig)
    assert cfg.trainer.sequence_parallel is True


@pytest.mark.parametrize(
    ("overrides", "trainer", "rollout"),
    [([], "fsdp", "vllm"), (["trainer=megatron", "rollout=hf"], "megatron", "hf")],
)
def test_backend_is_the_schema_class_not_a_field(overrides, trainer, rollout):
    """``trainer=fsdp trainer.backend=megatron`` used to plan as FSDP and fail in the job: the backend is
    now a class variable of the schema the group picks, so there is nothing to contradict it."""
    cfg = compose(*overrides)
    assert (cfg.trainer.backend, cfg.rollout.backend) == (trainer, rollout)
    for part in (cfg.trainer, cfg.rollout):
        assert "backend" not in {f.name for f in dataclasses.fields(part)}


@pytest.mark.parametrize(
    "override",
    ["trainer.sequence_packing=true", "trainer.cpu_offload=true", "trainer=megatron trainer.virtual_pp=2"],
)
def test_settings_that_did_nothing_are_gone(override):
    """Nothing packed sequences, offloaded fsdp's optimizer (the planner counted it as 0 GB) or built
    a virtual pipeline: the keys are unknown now instead of silently accepted."""
    with pytest.raises(ConfigError, match=r"unknown key 'trainer\."):
        compose(*override.split())


def test_yaml_values_reach_typed_fields():
    cfg = compose("+experiment=grpo-gemma3-1b-it-1n8g-fsdp2tp1", *SITE)
    assert cfg.algo.num_prompts_per_step == 32 and cfg.algo.num_generations == 16
    assert cfg.algo.kl_coef == pytest.approx(0.01)
    assert cfg.max_seq_len == 2048


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("trainer.tpp=2", "unknown key 'trainer.tpp'"),
        ("+trainer.tpp=2", "unknown key 'trainer.tpp'"),
        ("cluster.slurm.partitoin=x", "unknown key 'cluster.slurm.partitoin'"),
        ("cluster=nope", "unknown config 'cluster/nope'; available: b200, gb200"),
        ("+experiment=nope", "unknown config 'experiment/nope'"),
        ("trainer.tp=two", "bad value in override 'trainer.tp=two'"),
        ("algo.kl_type=k7", "expected one of [k1, k2, k3]"),
        ("trainer.backend=megatron", "use trainer=fsdp or trainer=megatron instead"),
        ("rollout.backend=hf", "use rollout=hf or rollout=vllm instead"),
    ],
)
def test_composition_errors_name_the_key(override, fragment):
    with pytest.raises(ConfigError) as info:
        compose(override)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_env_entries_can_be_added():
    cfg = compose("+cluster=gb200", "+cluster.env.NCCL_DEBUG=INFO", *SITE)
    assert cfg.cluster.env["NCCL_DEBUG"] == "INFO" and cfg.cluster.env["NCCL_MNNVL_ENABLE"] == "1"


def _compose_in_subprocess(cache_dir, overrides):
    code = (
        "import sys; from hpcrl.config.compose import compose_config; cfg = compose_config(sys.argv[1:]); "
        "print(cfg.model.name, cfg.trainer.tp, 'hydra' in sys.modules)"
    )
    # Hydra composes every miss here, so 'hydra' in sys.modules tells a miss from a hit.
    env = {**os.environ, "HPCRL_CACHE": str(cache_dir), "HPCRL_COMPOSE_CACHE": "1", "HPCRL_FAST_COMPOSE": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code, *overrides], capture_output=True, text=True, env=env, check=True
    )
    return out.stdout.split()


def test_composition_cache_skips_hydra_and_any_edit_invalidates_it(tmp_path):
    overrides = ["model=qwen2_1p5b", "trainer.tp=2"]
    assert _compose_in_subprocess(tmp_path, overrides) == ["qwen2_1p5b", "2", "True"]  # composed by Hydra
    assert _compose_in_subprocess(tmp_path, overrides) == ["qwen2_1p5b", "2", "False"]  # from the cache
    assert _compose_in_subprocess(tmp_path, ["model=qwen2_1p5b", "trainer.tp=4"])[1:] == ["4", "True"]
    conf = Path(__file__).resolve().parents[2] / "conf" / "model" / "qwen2_1p5b.yaml"
    os.utime(conf)  # an edited conf file: the cached composition is not used
    assert _compose_in_subprocess(tmp_path, overrides) == ["qwen2_1p5b", "2", "True"]


@pytest.mark.parametrize(
    ("overrides", "compiled"),
    [
        (["trainer=fsdp"], True),
        (["trainer=fsdp", "trainer.compile=false"], False),
        (["trainer=megatron"], True),
        (["trainer=megatron", "trainer.tp=2"], False),  # measured slower under TP: the default skips it
        (["trainer=megatron", "trainer.tp=2", "trainer.compile=true"], True),  # an explicit choice wins
        (["trainer=megatron", "trainer.compile=false"], False),
        (["trainer=megatron", "trainer.cp=2"], False),  # CP: collectives inside the layer, as TP
    ],
)
def test_layer_compilation_default_depends_on_backend_and_tp(overrides, compiled):
    assert compose(*overrides).trainer.compile_layers() is compiled


def test_engine_logprobs_off_refuses_an_is_correction_that_needs_them():
    from hpcrl.errors import ConfigError

    assert compose("rollout.logprobs=false").rollout.logprobs is False  # fine without IS correction
    with pytest.raises(ConfigError, match=r"^rollout.logprobs=false leaves algo.is_correction=tis"):
        compose("rollout.logprobs=false", "algo.is_correction=tis")
