"""The Hydra-free composer gives Hydra's exact config for plain overrides and defers on the rest."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpcrl.config import compose, fastcompose
from hpcrl.config.compose import conf_dir, normalize_overrides
from hpcrl.config.defaults import with_defaults
from hpcrl.config.schema import GROUP_SCHEMAS, RunConfig
from hpcrl.errors import ConfigError

EXPERIMENTS = sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))

PLAIN = [
    [],
    ["+cluster=gb200", "+model=nemotron_super"],
    ["cluster=h200", "model=qwen2_1p5b", "trainer=megatron", "trainer.tp=2", "algo=dapo", "algo.lr=3e-6"],
    ["rollout=hf", "rollout.max_new_tokens=64", "algo.kl_type=k1", "algo.is_correction=none"],
    ["algo=drgrpo", "algo.policy_loss=gspo", "algo.loss_agg=sequence"],
    ["+experiment=dapo-nemotron-super-5n4g-megatron", "cluster=b200", "layout.train_nodes=2"],
    ["+experiment=grpo-tiny-1n1g-fsdp", "+cluster.env.NCCL_DEBUG=INFO", "run.name=my-run.v2"],
    ["cluster=gb200", "cluster.slurm.time=08:00:00", "cluster.container.image=nvcr.io/nv/rl:v0.4"],
    ["checkpoint.dir=null", "logger.wandb=True", "algo.dual_clip=3", "algo.eps_high=0.28", "run.seed=-1"],
    ["rewards.processes=4", "rewards.timeout_s=2", "cluster=h100", "cluster.bootstrap.ray_nodes_s=600"],
    ["trainer=megatron", "trainer.activation_checkpointing=false", "trainer.micro_batch_size=2"],
    ["trainer.optimizer=adafactor", "trainer.optimizer_dtype=bfloat16", "trainer.optimizer_offload=true"],
    ["cluster=h100", "cluster.host_memory_gb=512", "trainer.weight_decay=0.01"],
    *[[f"+experiment={name}"] for name in EXPERIMENTS],
]


def _fast(overrides: list[str]) -> RunConfig | None:
    normalized = normalize_overrides(with_defaults(overrides))
    return fastcompose.compose(conf_dir(), normalized, GROUP_SCHEMAS, RunConfig)


@pytest.mark.parametrize("overrides", PLAIN, ids=lambda o: " ".join(o) or "embedded-default")
def test_plain_overrides_compose_like_hydra(overrides):
    fast = _fast(overrides)
    assert fast is not None, "a plain override set fell back to Hydra: the cold start slows down"
    assert fast == compose._compose_hydra(overrides)
    assert type(fast.trainer) is type(compose._compose_hydra(overrides).trainer)


DEFERRED = [
    ["trainer.tp=abc"],  # a type Hydra reports
    ["trainer.typo=1"],  # an unknown key
    ["trainer=megatron", "trainer.backend=fsdp"],  # the backend is the schema class, not a key
    ["rollout.backend=hf"],
    ["cluster=nope"],  # an unknown option
    ["algo.kl_type=k9"],  # not an enum member
    ["model.num_layers=[1,2]"],  # list syntax
    ["run.name='quoted'"],  # quotes
    ["run.name=${oc.env:USER}"],  # an interpolation
    ["~trainer.tp"],  # a deletion
    ["algo.lr=1e-6,3e-6"],  # sweep syntax
    ["run.name=007"],  # digits Hydra and YAML read differently
    ["run.name=nan"],  # a float to Hydra
    ["cluster=gb200", "+cluster.env.NCCL_MNNVL_ENABLE=0"],  # + on an entry that exists
    ["cluster=gb200", "cluster.env.NEW_VAR=x"],  # a new map entry without +
    ["run.name=a$b"],  # characters Hydra treats specially
    ["run.name=with space"],
    ["+experiment=grpo-tiny-1n1g-fsdp", "+experiment=grpo-tiny-2n1g-fsdp-split"],
    ["cluster=slurmtest", "cluster.name=???"],  # a required value left unset
]


@pytest.mark.parametrize("overrides", DEFERRED, ids=lambda o: " ".join(o))
def test_anything_unusual_is_left_to_hydra(overrides):
    assert _fast(overrides) is None


def test_float_forms_follow_omegaconf():
    assert fastcompose.parse_value("1e-6") == 1e-6
    assert fastcompose.parse_value("-2.5E+3") == -2500.0
    assert fastcompose.parse_value("3") == 3 and isinstance(fastcompose.parse_value("3"), int)
    assert fastcompose.parse_value("FALSE") is False
    assert fastcompose.parse_value("NULL") is None
    assert fastcompose.parse_value("08:00:00") == "08:00:00"
    assert fastcompose.parse_value("v0.4") == "v0.4"
    with pytest.raises(fastcompose.Unsupported):
        fastcompose.parse_value("1_000")


def test_errors_still_come_from_hydra_in_one_line():
    with pytest.raises(ConfigError, match=r"trainer\.typo"):
        compose.compose_config(["trainer.typo=1"])


def test_cold_composition_imports_no_hydra(tmp_path):
    code = (
        "import sys, json; from hpcrl.config.compose import compose_config;"
        "c = compose_config(['+experiment=dapo-nemotron-super-5n4g-megatron',"
        "'cluster.slurm.account=rl', 'cluster.container.image=nvcr.io/nvidia/nemo-rl:v0.4']);"
        "print(json.dumps([c.trainer.ep, 'hydra' in sys.modules, 'omegaconf' in sys.modules]))"
    )
    env = {**os.environ, "HPCRL_COMPOSE_CACHE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [16, False, False]
