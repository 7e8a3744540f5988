"""Rich rendering of a plan: nodes and roles, parallel degrees, memory, quirks, sbatch keys."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from hpcrl.config.defaults import default_recipes
from hpcrl.config.schema import RunConfig
from hpcrl.data.config import is_procedural
from hpcrl.plan.components import components, gpu_roles, node_gpus, one_gpu_kind
from hpcrl.plan.planner import Plan, ShippedLayout, shipped_layouts
from hpcrl.plan.savetime import save_time
from hpcrl.trainer.backends import trainer_spec


def _b(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def show_plan(plan: Plan, console: Console, sbatch: dict[str, Any] | None = None) -> None:
    """Print the plan; ``sbatch``: the job's Slurm parameters (``launch.sbatch.slurm_parameters``), for
    Slurm clusters (the caller computes them: the plan layer does not import the launch layer)."""
    cfg = plan.cfg
    counts = cfg.model.param_counts()
    # MTP blocks are in the checkpoint but neither trained nor served (ParamCounts.mtp)
    mtp = f", checkpoint {_b(counts.checkpoint)} with MTP" if counts.mtp else ""
    console.print(escape(header(cfg)))
    console.print(
        f"[bold]{escape(cfg.run.name)}[/]  {cfg.model.name} ({_b(counts.total)} params, {_b(counts.active)} "
        f"active{mtp}) · rollout={cfg.rollout.backend} · cluster={cfg.cluster.name} ({cfg.cluster.gpu})"
    )
    recipe = recipe_line(cfg)
    if recipe:
        console.print(recipe)
    if cfg.data.image_field:
        console.print(image_line(cfg))
    if plan.search is not None:
        _search(plan, console)
    console.print(_nodes(plan))
    console.print(_parallelism(plan))
    console.print(_memory(plan))
    if plan.judge is not None:
        console.print(escape(f"judge: {plan.judge.line()}"))
    if plan.sleep is not None:
        how = "explicit" if plan.sleep.explicit else "auto"
        console.print(f"rollout.sleep={str(plan.sleep.value).lower()} ({how}: {plan.sleep.reason})")
    for line in plan.engine_defaults:
        console.print(line)
    console.print(escape(plan.refit.line(cfg.rollout.weight_sync)))
    if cfg.checkpoint.enabled:
        console.print(escape(save_time(plan).line()))
    _verdict(plan, console)
    layouts = _layouts(plan)
    if layouts is not None:
        console.print(layouts)
    if plan.quirks:
        quirks = _table("Model quirks applied", "quirk", "setting", "why")
        for q in plan.quirks:
            quirks.add_row(q.quirk, f"{q.key}={q.value}", q.reason)
        console.print(quirks)
    if sbatch is not None:
        console.print(_sbatch(plan, sbatch))


def header(cfg: RunConfig) -> str:
    """The run in one line: algorithm, training backend, data set (source, template, verifier) and the
    validation set, e.g. ``DAPO · megatron · data dapo_math_17k (hf:..., template dapo, verifier math)
    · val hf:HuggingFaceH4/MATH-500``."""
    data = cfg.data
    if data.source == "synthetic" or is_procedural(data.source):
        val = f"{data.max_val_samples} generated problems, none of them trained on"
    else:
        val = data.val_source or f"{data.val_fraction:.0%} of the training set held out"
    return (
        f"{cfg.algo.name.upper()} · {cfg.trainer.backend} · data {data.name} ({data.source}, template "
        f"{data.template}, verifier {data.verifier}) · val {val}"
    )


def recipe_line(cfg: RunConfig) -> str:
    """One line when the run is its model's default recipe on its cluster (``hpcrl.config.defaults``),
    which a bare ``+cluster=C +model=M`` chooses; "" otherwise."""
    if cfg.run.name != default_recipes().get((cfg.model.name, cfg.cluster.name)):
        return ""
    return (
        f"recipe {cfg.run.name}: the default for {cfg.model.name} on {cfg.cluster.name} "
        "(+experiment=none plans without it)"
    )


def _search(plan: Plan, console: Console) -> None:
    search = plan.search
    assert search is not None
    console.print(f"[bold]auto layout[/]: {search.reason}")
    table = _table(
        f"Auto layout: best of {search.tried} estimates (fewest GPUs, then the nominal step)",
        "",
        "nodes (rollout + train)",
        "train",
        "rollout engines",
        "GPUs / peak per GPU",
        "nominal step",
    )
    for mark, scored in [("chosen", search.chosen), *(("", s) for s in search.runners_up)]:
        table.add_row(mark, *scored.describe())
    console.print(table)
    console.print("to keep this layout: " + " ".join(search.chosen.layout.overrides()))


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    return table


def _nodes(plan: Plan) -> Table:
    topo, per_node = plan.topology, node_gpus(plan)  # each node's own GPUs (a hetjob's components differ)
    gpn = topo.gpus_per_node
    kinds = sorted({g for g in per_node if g} or {gpn})  # environment nodes of their own hold none
    label = f"x {gpn} GPUs" if len(kinds) == 1 else f"of {' / '.join(str(k) for k in kinds)} GPUs"
    nodes = _table(f"Nodes: {plan.job_nodes} {label}, {topo.placement.value}", "node", "role", "GPUs", "runs")
    engines_per_node = topo.rollout_gpus_per_node // topo.rollout.tp * topo.rollout.per_gpu
    for first_node, last_node, role in _node_rows(topo.node_roles()):
        runs, count = [], last_node - first_node + 1
        if "train" in role:
            first = (first_node - topo.rollout_nodes) * gpn
            runs.append(f"trainer ranks {first}-{first + count * gpn - 1}")
        if "rollout" in role:
            each = " each" if count > 1 else ""
            runs.append(
                f"{engines_per_node} {plan.cfg.rollout.backend} engine(s) x TP{topo.rollout.tp}{each}"
            )
        where, own = str(first_node) if count == 1 else f"{first_node}-{last_node}", per_node[first_node]
        nodes.add_row(where, role, str(own) if count == 1 else f"{own} each", ", ".join(runs))
    if plan.judge is not None and plan.judge.nodes:
        first, last, s = topo.nodes, topo.nodes + plan.judge.nodes - 1, plan.judge.settings
        where = str(first) if first == last else f"{first}-{last}"
        judges = f"{s.engines} judge engine(s) x TP{s.tp} in all (frozen)"
        nodes.add_row(where, "judge", str(per_node[first]) + (" each" if last > first else ""), judges)
    if env := plan.cfg.env.nodes:
        first, last = plan.job_nodes - env, plan.job_nodes - 1
        where = str(first) if first == last else f"{first}-{last}"
        gpus = "0" if plan.cfg.cluster.env_node is not None else f"{gpn} (idle)"
        e = plan.cfg.env
        nodes.add_row(
            where, "env", gpus, f"{e.name} environments: an actor each, {e.processes} processes in all"
        )
    return nodes


NODE_ROWS = 16
"""Up to this many nodes the table has a row per node; larger jobs get a row per run of one role
(rendering a 1,152-row table alone took 0.75 s)."""


def _node_rows(roles: list[str]) -> list[tuple[int, int, str]]:
    """(first node, last node, role) rows: one per node, or one per run of a role on large jobs."""
    if len(roles) <= NODE_ROWS:
        return [(i, i, role) for i, role in enumerate(roles)]
    rows: list[tuple[int, int, str]] = []
    for index, role in enumerate(roles):
        if rows and rows[-1][2] == role:
            rows[-1] = (rows[-1][0], index, role)
        else:
            rows.append((index, index, role))
    return rows


def _parallelism(plan: Plan) -> Table:
    cfg, tr, ro = plan.cfg, plan.topology.train, plan.topology.rollout
    par = _table("Parallelism", "side", "GPUs", "TP", "PP", "CP", "EP", "DP", "notes")
    notes = []
    notes += trainer_spec(cfg.trainer).notes(cfg.trainer)
    if cfg.model.is_moe:
        if tr.expert_tp > 1:
            notes.append(f"expert TP {tr.expert_tp}")
        notes.append(f"expert DP {tr.expert_dp}")
    notes.append("recompute" if cfg.trainer.activation_checkpointing else "no recompute")
    degrees = (tr.world, tr.tp, tr.pp, tr.cp, tr.ep, tr.dp)
    par.add_row("train", *map(str, degrees), ", ".join(notes))
    par.add_row(
        "rollout",
        str(ro.gpus),
        str(ro.tp),
        "1",
        "1",
        "-",
        str(ro.engines),
        engines_note(ro.engines, ro.per_gpu),
    )
    return par


def engines_note(engines: int, per_gpu: int) -> str:
    return f"{engines} engine(s)" + (f", {per_gpu} on each GPU" if per_gpu > 1 else "")


def _memory(plan: Plan) -> Table:
    mem = plan.memory
    table = Table(title=memory_title(plan))
    table.add_column("item")
    table.add_column("GB", justify="right")
    t = mem.train
    for name, value in (
        ("train: weights", t.weights),
        ("train: reference policy (kl_coef > 0)", t.reference),
        ("train: gradients", t.grads),
        ("train: optimizer", t.optimizer),
        ("train: activations", t.activations),
        ("train: logits", t.logits),
        ("train: runtime overhead", t.overhead),
        ("train: peak", t.peak),
        ("train: start-up peak (shards + one layer read)", t.startup),
    ):
        table.add_row(name, f"{value:.1f}")
    r = mem.rollout
    if r.per_gpu > 1:
        table.add_row(f"rollout: share of the {r.per_gpu} engines on a GPU", f"{r.budget:.1f}")
    table.add_row("rollout: engine share", f"{r.engine_budget:.1f}")
    table.add_row(f"rollout: weights (per GPU{', fp8 linears' if r.quantized else ''})", f"{r.weights:.1f}")
    table.add_row(f"rollout: KV per {r.sequence_len}-token sequence", f"{r.kv_per_sequence:.3f}")
    table.add_row("rollout: sequences in KV (fit / wanted)", f"{r.sequences_that_fit} / {r.wanted_sequences}")
    for name, value in _colocated_rows(plan):
        table.add_row(name, f"{value:.1f}")
    judge = plan.judge
    if judge is not None and judge.gpus:
        table.add_row("judge: engine share", f"{judge.budget_gb:.1f}")
        table.add_row("judge: weights (per GPU)", f"{judge.weights_gb:.1f}")
        table.add_row(
            f"judge: KV per {judge.max_model_len}-token sequence", f"{judge.kv_per_sequence_gb:.3f}"
        )
        table.add_row("judge: sequences in KV (fit)", str(judge.sequences_that_fit))
    if mem.host_per_node:
        of = f" of {mem.host_capacity:.0f}" if mem.host_capacity is not None else ""
        table.add_row(f"host: offloaded optimizer state per node (GB{of})", f"{mem.host_per_node:.1f}")
    return table


def memory_title(plan: Plan) -> str:
    """The memory table's title: the GPU memory its figures are of, each role's where the roles' GPUs
    differ (rollout or judge nodes of another kind: ``cluster.rollout_node``, ``judge_node``)."""
    if one_gpu_kind(plan):
        return f"Memory per GPU (GB of {plan.memory.capacity:.0f})"
    return f"Memory per GPU (GB; {', '.join(k.label() for k in gpu_roles(plan))})"


def _colocated_rows(plan: Plan) -> list[tuple[str, float]]:
    phases = plan.memory.colocated
    if phases is None:
        return []
    if not phases.sleep:
        return [("colocated peak (sleep off: training peak + engine share)", phases.peak)]
    return [
        ("colocated peak (sleep on: max of train / refit / generate)", phases.peak),
        ("  train: training peak + sleeping engine's residue", phases.train),
        ("  refit: train state + engine weights + 2 buckets + residue", phases.refit),
        ("  generate: train state + engine share", phases.generate),
    ]


def _verdict(plan: Plan, console: Console) -> None:
    mem = plan.memory
    for warning in plan.nvlink.warnings:
        console.print(f"[yellow]NVLink[/]: {warning}")
    if plan.fits:
        each = "per GPU" if len({k.memory_gb for k in gpu_roles(plan)}) == 1 else "per training GPU"
        console.print(f"[green]fits[/]: peak {mem.train_gpu_peak:.0f} GB of {mem.capacity:.0f} GB {each}")
        return
    for problem in mem.problems:
        console.print(f"[red]does not fit[/]: {problem}")
    for problem in plan.nvlink.problems:
        console.print(f"[red]does not fit the NVLink domains[/]: {problem}")
    if plan.no_layout:
        console.print(f"[red]auto layout[/]: {plan.no_layout}")


def _layouts(plan: Plan) -> Group | None:
    """The shipped recipes for this model and cluster, one paragraph each with its own layout, per-GPU
    peak and verdict (this plan's marked), so that a layout that does not fit is never offered as one.
    Not a table: a recipe's name is what the user types, so it must stay whole at 80 columns, and a
    47-character name leaves a table's other five columns too little room."""
    cfg = plan.cfg
    layouts = shipped_layouts(plan)
    if not layouts:
        return None
    title = (
        f"Shipped layouts for {cfg.model.name} on {cfg.cluster.name}: nodes (rollout + train) · train "
        "TP x CP x PP x EP x ETP (DP) · rollout engines x TP · peak GB / GPU · verdict"
    )
    rows = [Padding(Text.from_markup(_layout_row(layout, cfg.run.name)), (0, 0, 0, 2)) for layout in layouts]
    return Group(Text(title, style="italic"), *rows)


def _layout_row(layout: ShippedLayout, this_plan: str) -> str:
    name = f"+experiment={layout.recipe}" + (" (this plan)" if layout.recipe == this_plan else "")
    if layout.plan is None:
        return f"{name} · [red]error[/]: {escape(layout.error)}"
    topo, mem, fits = layout.plan.topology, layout.plan.memory, layout.plan.fits
    tr = topo.train
    verdict = "[green]fits[/]" if fits else "[red]does not fit[/]: " + escape("; ".join(layout.plan.problems))
    if layout.plan.backend_gaps:
        verdict += " (cannot submit yet)"
    split = topo.rollout_nodes > 0
    nodes = f"{topo.rollout_nodes} + {topo.train_nodes} nodes" if split else f"{topo.nodes} nodes colocated"
    return " · ".join(
        [
            name,
            nodes,
            f"train {tr.tp} x {tr.cp} x {tr.pp} x {tr.ep} x {tr.expert_tp} ({tr.dp})",
            f"rollout {topo.rollout.engines} x TP{topo.rollout.tp}",
            f"{mem.train_gpu_peak:.0f} / {mem.capacity:.0f} GB",
            verdict,
        ]
    )


def _sbatch(plan: Plan, params: dict[str, Any]) -> Table:
    cfg = plan.cfg
    sb = _table("sbatch", "key", "value")
    for key in ("job_name", "partition", "account", "qos", "nodes", "gpus_per_node", "time"):
        if key in params:
            value = params[key]
            sb.add_row(key, f"{value} min" if key == "time" else str(value))
    for key, value in params["additional_parameters"].items():
        sb.add_row(key, str(value))
    parts = components(plan)
    if parts is not None:  # a heterogeneous job (launch/hetjob.py): each role's nodes with their own keys
        sb.add_row("hetjob", "; ".join(f"component {i}: {c.line()}" for i, c in enumerate(parts)))
    sb.add_row("container", cfg.cluster.container.image or "(none)")
    for name in sorted(cfg.cluster.env):
        sb.add_row(f"env {name}", cfg.cluster.env[name])
    return sb


def image_line(cfg: RunConfig) -> str:
    """What an image data set adds: each image's tokens (inside ``data.max_prompt_tokens``) and the
    towers, frozen (no gradients or optimizer state; served by the engines)."""
    model = cfg.model
    return (
        f"images ({cfg.data.image_field}): up to {model.image_tokens} prompt tokens each, within "
        f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}; vision/audio towers {model.vision_params_m:g}M "
        "params, frozen in training, served by the engines"
    )
