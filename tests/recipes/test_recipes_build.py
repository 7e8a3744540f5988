"""Every shipped recipe whose plan fits also builds (issue 17, item 6): no recipe may plan and then
fail in the job.

Each recipe in conf/experiment (all of them, found on disk) is planned as ``hpcrl plan`` plans it, with
a test site. One that does not fit or cannot be submitted is left out: a skipped id with the plan's
reason, and a fast test checks the left-out set against what ``hpcrl plan`` prints (today none). Each other recipe maps to a case: a tiny random checkpoint of its catalog model's
family and layer kinds (tests/harness/tiny_checkpoints.py), its backend, and its training layout scaled to CPU
ranks: every degree above 1 (TP, PP, CP, EP, expert TP, DP; sequence parallel as the recipe has it)
becomes 2, at most 4 ranks; a layout that needs more drops the fewest degrees, DP first (the id says
which: dapo-gemma4-31b-it-4n8g-megatron's TP4 x PP2 x DP4 runs as "TP2xPP2xSP-no-DP"). Recipes with the
same case share one run; the id names them all.

The slow tests build each case's trainer under torchrun (gloo, CPU, fp32) and run one step on
tests/harness/megatron_parity.py's batch (tests/harness/recipe_build.py, one torchrun per world size): the loss is
finite, the gradient norm positive, the ranks ran the scaled layout (Megatron's process groups as
built); and cases on one checkpoint with one algorithm take the same step whatever their backend and
layout. A recipe in KNOWN_GAPS (one that plans but does not build yet) is xfail(strict).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest

from hpcrl.config.compose import conf_dir
from hpcrl.core.parallel import TrainParallel
from hpcrl.errors import ConfigError
from hpcrl.plan.planner import Plan, plan_from_overrides
from hpcrl.trainer.config import MegatronTrainerConfig
from tests.conftest import (
    JOB_DOWNLOADS,
    TorchrunCase,
    local_gpu,
    recipe_gpu,
    register_torchrun_case,
    run_cli,
)
from tests.harness.tiny_checkpoints import Kinds, kinds_of, save_tiny

SITE = ["cluster.slurm.account=a", "cluster.container.image=i.sqsh"]
MAX_WORLD = 4
DEGREES = ("tp", "pp", "cp", "ep", "expert_tp", "dp")
DROP_ORDER = ("dp", "pp", "cp", "expert_tp", "ep", "tp")
"""Which degrees go first when a scaled layout needs more than MAX_WORLD ranks."""
KNOWN_GAPS: dict[str, str] = {}
"""Recipes that plan but do not build yet: their case is xfail(strict) with this reason."""


def shipped_recipes() -> list[str]:
    return sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))


def recipe_plan(recipe: str) -> Plan:
    """A one-GPU recipe of cluster=local planned on the GPU it is written for (conftest.recipe_gpu)."""
    with local_gpu(recipe_gpu(recipe)):
        return plan_from_overrides([f"+experiment={recipe}", *SITE])


def submittable(plan: Plan) -> bool:
    """What ``hpcrl plan`` and ``submit`` accept as far as the recipe decides: the memory fits and the
    backend builds the model (``launch/gate.py`` adds this machine's cache and mounts)."""
    return plan.memory.fits and not plan.backend_gaps


@dataclass(frozen=True)
class TinyLayout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    expert_tp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    dropped: tuple[str, ...] = ()

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def label(self) -> str:
        names = {"expert_tp": "ETP"}
        parts = [f"{names.get(k, k.upper())}{getattr(self, k)}" for k in DEGREES if getattr(self, k) > 1]
        parts += ["SP"] * self.sequence_parallel
        dropped = f"-no-{'-'.join(d.upper() for d in self.dropped)}" if self.dropped else ""
        return ("x".join(parts) or "1rank") + dropped

    def valid(self) -> bool:
        try:
            TrainParallel(self.world, self.tp, self.pp, self.cp, self.ep, self.expert_tp)
        except ConfigError:
            return False
        return self.world <= MAX_WORLD


def tiny_layout(plan: Plan) -> TinyLayout:
    """The recipe's training layout with each degree above 1 at 2, dropping the fewest degrees
    (in DROP_ORDER) that keep it within MAX_WORLD ranks and valid."""
    train, trainer = plan.topology.train, plan.cfg.trainer
    kept = [k for k in DEGREES if getattr(train, k) > 1]
    sp = isinstance(trainer, MegatronTrainerConfig) and trainer.sequence_parallel and train.tp > 1
    for n in range(len(kept) + 1):
        for drop in combinations([d for d in DROP_ORDER if d in kept], n):
            degrees = {k: 2 for k in kept if k not in drop}
            layout = TinyLayout(**degrees, sequence_parallel=sp and "tp" in degrees, dropped=drop)
            if layout.valid():
                return layout
    raise AssertionError(f"no layout of at most {MAX_WORLD} ranks for {plan.cfg.run.name}")


@dataclass(frozen=True)
class Case:
    kinds: Kinds
    backend: str
    layout: TinyLayout

    def name(self) -> str:
        return f"{self.kinds.label()}-{self.backend}-{self.layout.label()}"


def recipe_cases() -> tuple[dict[Case, list[str]], dict[str, Plan]]:
    """Every submittable recipe under its case; the others with their plans (left out)."""
    cases: dict[Case, list[str]] = {}
    left_out = {}
    for recipe in shipped_recipes():
        plan = recipe_plan(recipe)
        if not submittable(plan):
            left_out[recipe] = plan
            continue
        case = Case(kinds_of(plan.cfg.model), plan.cfg.trainer.backend, tiny_layout(plan))
        cases.setdefault(case, []).append(recipe)
    return cases, left_out


CASES, LEFT_OUT = recipe_cases()


def overrides(case: Case, recipe: str) -> list[str]:
    """The recipe at the tiny layout, in fp32 (CPU)."""
    lay = case.layout
    scaled = [f"trainer.{k}={getattr(lay, k)}" for k in ("tp", "pp", "cp", "ep")]
    if case.backend == "megatron":
        scaled.append(f"trainer.expert_tp={lay.expert_tp}")
    return [f"+experiment={recipe}", *SITE, *scaled, "trainer.precision=float32"]


def expected_run(case: Case) -> dict[str, Any]:
    """What tests/harness/recipe_build.py reads back from the ranks for this case."""
    lay = case.layout
    if case.backend != "megatron":
        return {"dp": lay.dp, "cp": lay.cp} | ({"ep": lay.ep} if case.kinds.moe else {})
    keys = ["tp", "pp", "cp", "dp", "sequence_parallel"] + ["ep", "expert_tp"] * case.kinds.moe
    return {k: getattr(lay, k) for k in keys}


def _group(case: Case) -> int:
    return case.layout.world


def _known_gap(case: Case) -> str:
    return "; ".join(KNOWN_GAPS[r] for r in CASES[case] if r in KNOWN_GAPS)


ORDER = sorted(CASES, key=lambda c: (_group(c), c.backend != "fsdp", bool(_known_gap(c)), c.name()))
"""One torchrun per world size (tests/conftest.py's torchrun_cases runs them in this order)."""


def _file_name(text: str) -> str:
    return re.sub(r"[^\w.-]", "_", text)


def _torchrun_case(case: Case) -> TorchrunCase:
    """The case as one of the session's torchrun cases (tests/conftest.py): the world size's run
    serves this module and tests/megatron/test_megatron_nemotron_h.py's parity layouts alike."""
    return register_torchrun_case(
        TorchrunCase(
            id=_file_name(case.name()),
            module=__name__,
            world=case.layout.world,
            backend=case.backend,
            overrides=tuple(overrides(case, CASES[case][0])),
            checkpoint=_file_name(case.kinds.label()),
            make=lambda out, kinds=case.kinds: save_tiny(kinds, out),
            last=bool(_known_gap(case)),
        )
    )


TORCHRUN = {case: _torchrun_case(case) for case in ORDER}


@pytest.fixture(scope="module")
def built(torchrun_cases):
    """A case's result, all cases of its world size run on first use."""
    return lambda case: torchrun_cases.result(TORCHRUN[case].id)


def _param(case: Case) -> Any:
    marks = [pytest.mark.xfail(strict=True, reason=gap)] if (gap := _known_gap(case)) else []
    return pytest.param(case, id=f"{'+'.join(CASES[case])}:{case.layout.label()}", marks=marks)


def _left_out(recipe: str) -> Any:
    plan = LEFT_OUT[recipe]
    why = "; ".join(plan.backend_gaps) or "; ".join(plan.memory.problems)
    return pytest.param(None, id=recipe, marks=pytest.mark.skip(reason=f"plan says it cannot run: {why}"))


@pytest.mark.slow
@pytest.mark.parametrize("case", [_param(c) for c in ORDER] + [_left_out(r) for r in LEFT_OUT])
def test_recipe_builds_and_trains_one_step_at_its_tiny_layout(case, built):
    result = built(case)
    assert "error" not in result, f"{CASES[case]} as {case.name()} did not build:\n{result['error']}"
    metrics = result["metrics"]
    assert math.isfinite(metrics["loss"]), metrics
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0, metrics
    expected = expected_run(case)  # the ranks ran the scaled layout, not another
    assert {k: result["layout"][k] for k in expected} == expected, result["layout"]


@pytest.mark.slow
def test_cases_on_one_checkpoint_take_the_same_step(built):
    """One tiny checkpoint, the parity batch, one algorithm config: every backend and layout built
    the same model, so each takes the same step (fsdp = megatron; TP/PP/CP/EP/ETP = one rank)."""
    runs: dict[tuple[Kinds, str], list[tuple[Case, dict]]] = {}
    for case in ORDER:
        if "error" not in (result := built(case)):
            algo = repr(recipe_plan(CASES[case][0]).cfg.algo)
            runs.setdefault((case.kinds, algo), []).append((case, result["metrics"]))
    compared = []
    for (first, base), *others in runs.values():
        for case, metrics in others:
            for key in ("loss", "grad_norm"):
                assert metrics[key] == pytest.approx(base[key], rel=1e-4), (first.name(), case.name(), key)
            compared.append(case.name())
    assert len(compared) >= 3, compared


def _case_of(recipe: str) -> Case:
    (case,) = [c for c, recipes in CASES.items() if recipe in recipes]
    return case


def test_recipes_map_to_their_tiny_layouts():
    """Hand-checked: TP4 x PP2 x DP4 needs 8 ranks at 2 each, so DP goes; TP2 x EP16 over 16 GPUs
    keeps its DP (8) as 2; the NeMo RL layout keeps all four degrees, DP1 stays 1."""
    nemotron = Kinds("nemotron_h", moe=True, layers="M*E", latent=True)
    gemma4 = Kinds("gemma4", tied=True, vlm=True, windowed=True, keys_as_values=True)
    expected = {
        "dapo-nemotron-super-5n4g-megatron": (nemotron, TinyLayout(tp=2, ep=2, dp=2, sequence_parallel=True)),
        "dapo-nemotron-super-5n4g-megatron-tp4cp4ep4etp4": (
            nemotron,
            TinyLayout(tp=2, cp=2, ep=2, expert_tp=2, sequence_parallel=True),
        ),
        "dapo-gemma4-31b-it-4n8g-megatron": (
            gemma4,
            TinyLayout(tp=2, pp=2, sequence_parallel=True, dropped=("dp",)),
        ),
        "dapo-gemma4-26ba4b-it-4n8g-fsdp2": (
            Kinds(**{**gemma4.__dict__, "moe": True}),
            TinyLayout(ep=2, dp=2),
        ),
        "dapo-gemma4-26ba4b-it-4n8g-fsdp2ep16cp2": (
            Kinds(**{**gemma4.__dict__, "moe": True}),
            TinyLayout(cp=2, ep=2, dp=2),
        ),
        "grpo-tiny-1n1g-fsdp": (Kinds("qwen2", tied=True), TinyLayout()),
    }
    for recipe, (kinds, layout) in expected.items():
        case = _case_of(recipe)
        assert (case.kinds, case.layout) == (kinds, layout), recipe
    assert _case_of("dapo-gemma4-31b-it-4n8g-megatron").layout.label() == "TP2xPP2xSP-no-DP"
    # one run for recipes of one case: both TP2 x EP16 Nemotron layouts, the tiny fsdp recipes
    assert CASES[_case_of("dapo-nemotron-super-3n8g-megatron")] == [
        "dapo-nemotron-super-3n8g-megatron",
        "dapo-nemotron-super-5n4g-megatron",
    ]
    assert CASES[_case_of("grpo-tiny-2n1g-fsdp-split")] == [
        "grpo-tiny-1n1g-fsdp",
        "grpo-tiny-1n1g-fsdp-calculator",
        "grpo-tiny-1n1g-fsdp-judge",
        "grpo-tiny-2n1g-fsdp-hetjob",
        "grpo-tiny-2n1g-fsdp-split",
        "grpo-tiny-3n1g-fsdp-judge-env-hetjob",
        "grpo-tiny-3n1g-fsdp-judge-hetjob",
    ]
    assert all(c.layout.world <= MAX_WORLD for c in CASES)


def test_only_recipes_plan_says_cannot_run_are_left_out():
    """Left out = what ``hpcrl plan`` itself refuses (exit 2, as submit does), recipe by recipe, with
    the job downloading the weights (this machine has none); every other shipped recipe is in a case."""
    says_no = set()
    for recipe in shipped_recipes():
        with local_gpu(recipe_gpu(recipe)):  # the CLI inherits HPCRL_LOCAL_GPU
            shown = run_cli("plan", f"+experiment={recipe}", *SITE, *JOB_DOWNLOADS)
        if shown.returncode != 0:
            says_no.add(recipe)
    assert set(LEFT_OUT) == says_no == set()  # today every shipped recipe runs (fsdp CP2 included)
    covered = [r for recipes in CASES.values() for r in recipes]
    assert sorted(covered + list(LEFT_OUT)) == shipped_recipes() and len(covered) == len(set(covered))


def _saved_kinds(path: Path) -> Kinds:
    """A saved checkpoint's kinds, read back from its config.json."""
    top = json.loads((path / "config.json").read_text())
    text = top.get("text_config", top)
    family = {"gemma3_text": "gemma3", "gemma4_text": "gemma4", "gemma4_unified_text": "gemma4"}
    types = set(text.get("layer_types") or [])
    blocks = {"linear_attention": "M", "full_attention": "*", "moe": "E", "mlp": "-"}  # Nemotron-H's
    hybrid = {blocks[b] for b in text.get("layers_block_type", [])}
    return Kinds(
        family=family.get(text["model_type"], text["model_type"]),
        tied=bool(top.get("tie_word_embeddings", text.get("tie_word_embeddings"))),
        moe=any(text.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")),
        vlm="text_config" in top,
        windowed={"sliding_attention", "full_attention"} <= types,
        keys_as_values=bool(text.get("attention_k_eq_v")),
        per_layer=bool(text.get("hidden_size_per_layer_input")) and text.get("num_kv_shared_layers", 0) > 0,
        wide_mlp=bool(text.get("use_double_wide_mlp")),
        unified="Unified" in top["architectures"][0],
        layers="".join(k for k in "M*E-" if k in hybrid),
        latent=bool(text.get("moe_latent_size")),
    )


def test_tiny_checkpoints_have_the_kinds_of_every_catalog_model(tmp_path):
    from hpcrl.config.compose import compose_config

    models = sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml"))
    kinds = {kinds_of(compose_config([f"model={m}"]).model) for m in models}
    assert {k.family for k in kinds} >= {"qwen2", "gemma3", "gemma4", "nemotron_h"}
    for k in kinds:
        assert _saved_kinds(save_tiny(k, tmp_path / _file_name(k.label()))) == k, k.label()
