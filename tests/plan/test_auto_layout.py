"""Auto layout (hpcrl/plan/search.py) and the NVLink-domain check (hpcrl/plan/nvlink.py), issue 21
items 3 and 5: through the real planner and CLI."""

from __future__ import annotations

import itertools

import pytest

from hpcrl.config.compose import conf_dir
from hpcrl.core.parallel import TrainParallel
from hpcrl.errors import ConfigError, DoesNotFitError
from hpcrl.plan.nvlink import NvlinkCheck, check_nvlink, segment_for
from hpcrl.plan.planner import plan_from_overrides
from hpcrl.plan.topology import build_topology
from hpcrl.trainer.backends import expert_tp
from tests.conftest import JOB_FETCH, SITE, compose, local_gpu, plan, recipe_gpu

GB200_SUPER = ["+experiment=none", "+cluster=gb200", "+model=nemotron_super", *JOB_FETCH]
"""The catalog's nemotron_super on gb200 without its default recipe (GRPO + FSDP on DAPO-Math-17k):
the layout the search finds from the catalog's one node."""
CLUSTERS = sorted(p.stem for p in (conf_dir() / "cluster").glob("*.yaml"))
MODELS = sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml"))
RECIPES = sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))


def test_nemotron_super_on_gb200_plans_a_split_layout_of_at_most_five_nodes(cli):
    result = cli("plan", *GB200_SUPER)
    assert result.returncode == 0, result.stderr
    assert "auto layout: the configured layout (1 node colocated) does not fit" in result.stdout
    p = plan_from_overrides(GB200_SUPER)
    assert p.fits and p.search is not None
    layout = p.search.chosen.layout
    assert layout.rollout_nodes >= 1 and layout.nodes <= 5  # the seed's 1 + 4, or better
    assert p.topology.nodes == layout.nodes and p.cfg.cluster.slurm.segment == layout.nodes
    assert all(r.gpus >= p.search.chosen.gpus for r in p.search.runners_up)


def test_no_four_node_layout_of_nemotron_super_fits_gb200_under_fsdp():
    """The search's "fewest GPUs" checked by the planner itself: every 4-node layout fsdp can run
    (colocated or split, rollout TP, recompute) does not fit, so 5 nodes is the least."""
    for rollout_nodes, rollout_tp, recompute in itertools.product(range(4), (1, 2, 4), (False, True)):
        p = plan(
            *GB200_SUPER,
            f"layout.train_nodes={4 - rollout_nodes}",
            f"layout.rollout_nodes={rollout_nodes}",
            f"rollout.tp={rollout_tp}",
            f"trainer.activation_checkpointing={str(recompute).lower()}",
        )
        assert not p.fits, (rollout_nodes, rollout_tp, recompute)


@pytest.mark.parametrize("trainer", ["fsdp", "megatron"])
def test_every_catalog_model_on_every_catalog_cluster_fits_or_says_what_is_short(trainer):
    planned = 0
    for cluster, model in itertools.product(CLUSTERS, MODELS):
        overrides = [
            "+experiment=none",
            f"+cluster={cluster}",
            f"+model={model}",
            f"trainer={trainer}",
            *SITE,
        ]
        p = plan_from_overrides(overrides)
        if p.no_layout:  # the configured plan, with the search's one line on what is short
            assert not p.fits and p.search is None
            assert "\n" not in p.no_layout and f"{model} fits no layout on {cluster}" in p.no_layout
            with pytest.raises(DoesNotFitError, match="fits no layout"):
                p.require_fit()
            continue
        assert p.fits, (cluster, model, p.problems)
        planned += 1
        if p.search is not None:
            chosen = p.search.chosen
            assert p.topology.total_gpus == chosen.gpus
            assert all((r.gpus, r.step_s) >= (chosen.gpus, chosen.step_s) for r in p.search.runners_up)
    assert planned >= len(MODELS) * 3  # at least the four GPU clusters, less what megatron cannot build


def test_a_model_that_fits_nowhere_gets_one_line_with_what_is_short(cli):
    result = cli("submit", "+model=nemotron_super")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    line = result.stderr
    assert line.startswith(
        "hpcrl: error: nemotron_super fits no layout on local (1 x 16 GB per node, up to 1"
    )
    assert "rollout engine at rollout.tp=1" in line and "241 GB" in line


def test_keys_typed_on_the_command_line_stay_as_typed():
    p = plan_from_overrides([*GB200_SUPER, "trainer=megatron", "trainer.ep=4", "layout.rollout_nodes=2"])
    assert p.search is not None and p.fits
    assert p.cfg.trainer.ep == 4 and p.topology.rollout_nodes == 2
    free = plan_from_overrides([*GB200_SUPER, "trainer=megatron"])
    assert free.search is not None and free.topology.nodes <= p.topology.nodes
    stuck = plan_from_overrides([*GB200_SUPER, "layout.train_nodes=1", "layout.rollout_nodes=0"])
    assert stuck.search is None and stuck.topology.nodes == 1
    assert "keeping layout.rollout_nodes layout.train_nodes as typed" in stuck.no_layout


@pytest.mark.parametrize("recipe", RECIPES)
def test_shipped_layouts_that_fit_are_kept_exactly(recipe):
    with local_gpu(recipe_gpu(recipe)):  # a one-GPU recipe of cluster=local: on the GPU it is written for
        auto = plan_from_overrides([f"+experiment={recipe}", *SITE])
        own = plan(f"+experiment={recipe}", *SITE)
    assert own.fits and auto.search is None
    assert auto.topology == own.topology and auto.cfg == own.cfg


def test_layout_auto_true_searches_a_fitting_recipe_and_false_keeps_a_misfit():
    auto = plan_from_overrides(["+experiment=dapo-nemotron-super-5n4g-megatron", *SITE, "layout.auto=true"])
    assert auto.search is not None and auto.search.reason == "layout.auto=true"
    assert auto.fits and auto.topology.total_gpus <= 20
    kept = plan_from_overrides([*GB200_SUPER, "layout.auto=false"])
    assert kept.search is None and not kept.fits and kept.topology.nodes == 1


def test_render_uses_the_auto_layout(cli, tmp_path):
    result = cli("render", *GB200_SUPER, "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("layout  auto: 1 + 4 split (segment 5)")
    text = (tmp_path / "sbatch.sh").read_text()
    assert "#SBATCH --nodes=5\n" in text and "#SBATCH --segment=5\n" in text


# -- NVLink domains ----------------------------------------------------------------------------------------
def gb200(rollout_nodes: int, train_nodes: int, tp: int = 4, ep: int = 64, expert_tp: int = 1):
    train = TrainParallel(world=train_nodes * 4, tp=tp, ep=ep, expert_tp=expert_tp)
    return build_topology(gpus_per_node=4, train=train, rollout_nodes=rollout_nodes, rollout_tp=4)


def test_expert_groups_across_racks_are_refused_with_the_numbers():
    """TP4 x EP64 on 144 rollout + 1,008 train nodes: 64-GPU expert groups are 16 nodes each; the
    second (train nodes 16-31 = job nodes 160-175) straddles the 18-node racks at 162."""
    topo = gb200(144, 1008)
    refused = check_nvlink(topo, domain_nodes=18, segment=18)
    assert len(refused.problems) == 1
    assert "(trainer.ep=64 x trainer.expert_tp=1 = 64 GPUs) spans 16 nodes" in refused.problems[0]
    assert "group 1 lies on nodes 160-175" in refused.problems[0]
    assert check_nvlink(topo, 18, segment=16) == NvlinkCheck()  # 16 divides the 144 rollout nodes: aligned
    unset = check_nvlink(topo, 18, segment=None)
    assert not unset.problems and "cluster.slurm.segment is unset" in unset.warnings[0]


def test_a_group_larger_than_a_domain_is_refused_whatever_the_segment():
    too_big = check_nvlink(gb200(0, 64, tp=4, ep=32, expert_tp=4), domain_nodes=18, segment=16)
    assert "spans 32 nodes, more than one NVLink domain (18 nodes" in too_big.problems[0]


def test_segment_for_finds_the_largest_aligned_segment_or_none():
    assert segment_for(gb200(1, 16), 18) == 17  # the whole job in one rack
    assert segment_for(gb200(0, 32), 18) == 16  # 16-node groups at nodes 0-15 and 16-31
    # 4 rollout nodes in front: the first group covers nodes 4-19, crossing every divisor of 36 <= 18
    # (18, 12, 9, 6, 4, 3, 2, 1 all put a boundary inside 4-19)
    assert segment_for(gb200(4, 32), 18) is None


def test_hgx_clusters_warn_about_tp_across_nodes_but_not_about_ep():
    topo = build_topology(
        gpus_per_node=8, train=TrainParallel(world=32, tp=16), rollout_nodes=0, rollout_tp=1
    )
    check = check_nvlink(topo, domain_nodes=1, segment=None)
    assert not check.problems and "leave the node's NVLink" in check.warnings[0]
    wide_ep = build_topology(
        gpus_per_node=8, train=TrainParallel(world=32, ep=16), rollout_nodes=0, rollout_tp=1
    )
    assert check_nvlink(wide_ep, domain_nodes=1, segment=None) == NvlinkCheck()


def test_plan_refuses_a_layout_that_crosses_racks(cli):
    overrides = [
        "+experiment=dapo-nemotron-super-5n4g-megatron",
        *SITE,
        "layout.train_nodes=1008",
        "layout.rollout_nodes=144",
        "trainer.tp=4",
        "trainer.ep=64",
        "cluster.slurm.segment=18",
        "layout.auto=false",
    ]
    p = plan(*overrides)
    assert p.memory.fits and not p.fits
    with pytest.raises(DoesNotFitError, match="group 1 lies on nodes 160-175"):
        p.require_fit()
    result = cli("plan", *overrides)
    assert result.returncode == 2 and "does not fit the NVLink domains" in result.stdout
    assert result.stderr.startswith("hpcrl: error: nemotron_super does not fit on gb200: each expert"), (
        result.stderr
    )
    assert "group 1 lies on nodes 160-175" in result.stderr  # submit's refusal, as its line says it


def test_auto_layout_keeps_explicit_config_errors():
    with pytest.raises(ConfigError, match=r"trainer\.pp=3"):
        plan_from_overrides(["+cluster=gb200", *SITE, "trainer=megatron", "trainer.pp=3"])
    assert compose(*GB200_SUPER).layout.auto is None


def test_the_printed_overrides_reproduce_the_auto_layout():
    auto = plan_from_overrides(GB200_SUPER)
    assert auto.search is not None
    pinned = plan_from_overrides([*GB200_SUPER, *auto.search.chosen.layout.overrides()])
    assert pinned.search is None and pinned.fits and pinned.topology == auto.topology
    assert pinned.cfg == auto.cfg


def test_the_chosen_layout_is_the_plan_and_the_jobs_config_says_it():
    """The search's choice is the plan's degree record (``make_plan(cfg, layout)``), and the config the
    job is written with holds the same keys: the run reads recompute and ``rollout.tp`` there."""
    auto = plan_from_overrides([*GB200_SUPER, "trainer=megatron", "trainer.expert_tp=2"])
    assert auto.search is not None
    layout = auto.search.chosen.layout
    assert auto.topology.train == layout.train and auto.topology.rollout.tp == layout.rollout_tp
    trainer = auto.cfg.trainer
    degrees = (trainer.tp, trainer.pp, trainer.cp, trainer.ep, expert_tp(trainer))
    par = layout.train
    assert degrees == (par.tp, par.pp, par.cp, par.ep, par.expert_tp) and par.expert_tp == 2
    assert trainer.activation_checkpointing == layout.recompute and auto.cfg.rollout.tp == layout.rollout_tp
    assert (auto.cfg.layout.train_nodes, auto.cfg.layout.rollout_nodes) == (
        layout.train_nodes,
        layout.rollout_nodes,
    )
