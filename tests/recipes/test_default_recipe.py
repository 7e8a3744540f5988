"""Issue 32 point 5: the headline command trains the seed's job, synthetic data is for the tiny models
only, and ``plan`` says what it trains on. Real composition (Hydra and the Hydra-free composer) and the
real CLI; nothing is mocked."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from hpcrl.config import compose as composer
from hpcrl.config.paths import group_options
from hpcrl.errors import ConfigError
from hpcrl.plan.planner import matching_recipes, plan_from_overrides
from hpcrl.plan.show import header, show_plan
from hpcrl.rollout.config import VLLMRolloutConfig
from hpcrl.trainer.config import FSDPTrainerConfig, MegatronTrainerConfig
from tests.conftest import JOB_FETCH, SITE, compose

SEEDS = {  # cluster -> (the seed's recipe, rollout nodes, training nodes, rollout TP)
    "gb200": ("dapo-nemotron-super-5n4g-megatron", 1, 4, 4),
    "b200": ("dapo-nemotron-super-3n8g-megatron", 1, 2, 8),
}
MATH500 = "hf:HuggingFaceH4/MATH-500"


@pytest.mark.parametrize("cluster", sorted(SEEDS))
def test_the_headline_command_composes_the_seed_recipe(cluster):
    recipe, rollout_nodes, train_nodes, rollout_tp = SEEDS[cluster]
    cfg = compose(f"+cluster={cluster}", "+model=nemotron_super", *SITE)
    assert cfg.run.name == recipe
    assert cfg.algo.name == "dapo" and isinstance(cfg.trainer, MegatronTrainerConfig)
    assert (cfg.data.name, cfg.data.source) == ("dapo_math_17k", "hf:BytedTsinghua-SIA/DAPO-Math-17k")
    assert cfg.data.val_source == MATH500
    assert (cfg.layout.rollout_nodes, cfg.layout.train_nodes) == (rollout_nodes, train_nodes)
    assert (cfg.trainer.tp, cfg.trainer.ep) == (2, 16)
    assert isinstance(cfg.rollout, VLLMRolloutConfig) and cfg.rollout.tp == rollout_tp
    assert cfg == compose(f"+experiment={recipe}", *SITE)


@pytest.mark.parametrize("cluster", sorted(SEEDS))
def test_the_headline_plan_is_the_seed_layout_not_a_search(cluster):
    _, rollout_nodes, train_nodes, _ = SEEDS[cluster]
    p = plan_from_overrides([f"+cluster={cluster}", "+model=nemotron_super", *SITE])
    assert p.fits and p.search is None
    assert (p.topology.rollout_nodes, p.topology.train_nodes) == (rollout_nodes, train_nodes)


def test_the_users_overrides_apply_on_top_of_the_default_recipe():
    cfg = compose(
        "+cluster=gb200", "+model=nemotron_super", "algo.max_steps=7", "rollout.tp=2", "data=math500", *SITE
    )
    assert cfg.run.name == "dapo-nemotron-super-5n4g-megatron"  # still the recipe ...
    assert cfg.trainer.ep == 16 and cfg.algo.name == "dapo"
    assert cfg.algo.max_steps == 7 and cfg.rollout.tp == 2  # ... with the command line on top
    assert cfg.data.name == "math500" and cfg.data.source == MATH500


def test_experiment_none_opts_out_and_an_explicit_recipe_wins():
    catalog = compose("+experiment=none", "+cluster=gb200", "+model=nemotron_super", *SITE)
    assert catalog.run.name == "hpcrl" and catalog.algo.name == "grpo"
    assert isinstance(catalog.trainer, FSDPTrainerConfig) and catalog.layout.train_nodes == 1
    assert catalog.data.name == "dapo_math_17k"  # a real model still gets a real data set
    other = "dapo-nemotron-super-5n4g-megatron-tp4cp4ep4etp4"
    chosen = compose(f"+experiment={other}", "+cluster=gb200", "+model=nemotron_super", *SITE)
    assert chosen.run.name == other and chosen.trainer.cp == 4


def test_pairs_without_a_marked_recipe_keep_the_catalog_defaults():
    cfg = compose("+cluster=h100", "+model=gemma4_31b", *SITE)  # h100 has gemma4_31b recipes, none marked
    assert cfg.run.name == "hpcrl" and cfg.algo.name == "grpo"
    assert cfg.data.name == "dapo_math_17k"
    assert compose("+cluster=h100", "+model=tiny", *SITE).data.name == "synthetic_math"
    assert compose("model=tiny_nemotronh").data.source == "synthetic"


DEFAULTED = [
    ["+cluster=gb200", "+model=nemotron_super", *SITE],
    ["+cluster=b200", "+model=nemotron_super", "algo.max_steps=7", "data=math500", *SITE],
    ["+experiment=none", "+cluster=gb200", "+model=nemotron_super", *SITE],
    ["+cluster=h100", "+model=qwen3_8b", *SITE],
]


@pytest.mark.parametrize("overrides", DEFAULTED, ids=" ".join)
def test_the_hydra_free_composer_agrees_with_hydra_on_the_defaults(overrides):
    fast = composer._compose_fast(overrides)
    assert fast is not None, "a plain override set fell back to Hydra"
    assert fast == composer._compose_hydra(overrides)


def test_a_site_recipe_marked_default_replaces_the_shipped_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCRL_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("HPCRL_COMPOSE_CACHE", "0")
    recipes = tmp_path / "conf" / "experiment"
    recipes.mkdir(parents=True)
    body = (
        "# @package _global_\n# @hpcrl default-recipe\ndefaults:\n  - override /cluster: gb200\n"
        "  - override /model: nemotron_super\n  - override /trainer: megatron\n  - override /data: math500\n"
        "run:\n  name: {name}\n"
    )
    (recipes / "site-super.yaml").write_text(body.format(name="site-super"))
    overrides = ["+cluster=gb200", "+model=nemotron_super", *SITE]
    cfg = compose(*overrides)
    assert cfg.run.name == "site-super" and cfg.data.name == "math500"
    assert composer._compose_fast(overrides) == composer._compose_hydra(overrides) == cfg
    (recipes / "site-super-2.yaml").write_text(body.format(name="site-super-2"))
    with pytest.raises(
        ConfigError,
        match=r"site-super-2\.yaml and .*site-super\.yaml are both '# @hpcrl default-recipe' for model=nemotron_super",
    ):
        compose(*overrides)


def test_a_mark_on_a_recipe_without_a_model_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCRL_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("HPCRL_COMPOSE_CACHE", "0")
    recipe = tmp_path / "conf" / "experiment" / "half.yaml"
    recipe.parent.mkdir(parents=True)
    recipe.write_text(
        "# @package _global_\n# @hpcrl default-recipe\ndefaults:\n  - override /cluster: gb200\n"
    )
    with pytest.raises(ConfigError, match=r"half\.yaml: '# @hpcrl default-recipe' .* does not choose both"):
        compose("+cluster=gb200", "+model=nemotron_super", *SITE)


def test_synthetic_data_with_a_real_model_is_refused_in_one_line(cli):
    result = cli("plan", "+cluster=h100", "+model=qwen3_8b", "data=synthetic_math", *SITE)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    line = result.stderr
    assert line.startswith(
        "hpcrl: error: data=synthetic_math with data.source=synthetic is the built-in arithmetic task, "
        "for the tiny local models only; qwen3_8b needs a real data set: data= one of "
    )
    listed = line.split("data= one of ", 1)[1].split(" (", 1)[0].split(", ")
    assert {"dapo_math_17k", "math500", "openmathinstruct2"} <= set(listed) and "synthetic_math" not in listed
    assert set(listed) == set(group_options("data")) - {"synthetic_math"}
    assert line.endswith("(`hpcrl show --groups` lists them)\n")


def test_a_recipe_that_chooses_synthetic_data_refuses_a_real_model():
    with pytest.raises(ConfigError, match=r"data=synthetic_math with data\.source=synthetic is the built-in"):
        compose("+experiment=grpo-tiny-1n1g-fsdp", "model=qwen2_1p5b")
    with pytest.raises(ConfigError, match=r"data=dapo_math_17k with data\.source=synthetic is the built-in"):
        compose("model=qwen2_1p5b", "data.source=synthetic")
    assert compose("+experiment=grpo-tiny-1n1g-fsdp").data.source == "synthetic"  # tiny: fine
    served = compose("model.hf_id=org/tiny-math")  # the tiny network from a hub is still the tiny model
    assert served.data.source == "synthetic" and served.model.hf_id == "org/tiny-math"


def test_a_real_model_alone_plans_on_a_real_data_set(cli):
    result = cli("plan", "+cluster=h100", "+model=qwen3_8b", *JOB_FETCH)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("GRPO · fsdp · data dapo_math_17k (hf:BytedTsinghua-SIA/DAPO-Math-17k")


def test_the_header_names_algorithm_backend_data_template_verifier_and_validation():
    cfg = compose(
        "+cluster=gb200", "+model=nemotron_super", "data.template=dapo", "data.verifier=math", *SITE
    )
    assert header(cfg) == (
        "DAPO · megatron · data dapo_math_17k (hf:BytedTsinghua-SIA/DAPO-Math-17k, template dapo, "
        "verifier math) · val hf:HuggingFaceH4/MATH-500"
    )
    tiny = compose("data.verifier=math", "data.max_val_samples=100")
    assert header(tiny) == (
        "GRPO · fsdp · data synthetic_math (synthetic, template plain, verifier math) · val 100 generated "
        "problems, none of them trained on"
    )
    held_out = compose("data=gsm8k", "data.val_source=null", "data.val_fraction=0.1")
    assert header(held_out).endswith(" · val 10% of the training set held out")


def _plan_text(overrides: list[str], width: int) -> str:
    out = io.StringIO()
    show_plan(plan_from_overrides(overrides), Console(file=out, width=width, color_system=None))
    return out.getvalue()


@pytest.mark.parametrize("cluster", sorted(SEEDS))
def test_plan_opens_with_the_header_then_says_the_recipe_was_chosen(cluster):
    recipe = SEEDS[cluster][0]
    lines = _plan_text([f"+cluster={cluster}", "+model=nemotron_super", *SITE], 200).splitlines()
    assert lines[0].startswith("DAPO · megatron · data dapo_math_17k (hf:BytedTsinghua-SIA/DAPO-Math-17k,")
    assert lines[0].endswith(f"· val {MATH500}")
    assert lines[1].startswith(f"{recipe}  nemotron_super (120.67B params")
    assert lines[2] == (
        f"recipe {recipe}: the default for nemotron_super on {cluster} (+experiment=none plans without it)"
    )
    catalog = _plan_text(["+experiment=none", f"+cluster={cluster}", "+model=nemotron_super", *SITE], 200)
    assert "the default for" not in catalog


def test_shipped_layouts_keep_every_recipe_name_whole_at_80_columns():
    text = _plan_text(["+cluster=gb200", "+model=nemotron_super", *SITE], 80)
    assert max(len(line) for line in text.splitlines()) <= 80
    recipes = matching_recipes("nemotron_super", "gb200")
    assert "dapo-nemotron-super-5n4g-megatron-tp4cp4ep4etp4" in recipes and len(recipes) == 2
    for recipe in recipes:
        assert f"+experiment={recipe}" in text, recipe
    assert "+experiment=dapo-nemotron-super-5n4g-megatron (this plan) · 1 + 4 nodes" in text
