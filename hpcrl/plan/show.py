"""Rich rendering of a plan: nodes and roles, parallel degrees, memory, quirks, sbatch keys."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from hpcrl.config.cluster import Scheduler
from hpcrl.plan.planner import Plan, matching_recipes
from hpcrl.plan.topology import Placement
from hpcrl.trainer.config import MegatronTrainerConfig


def _b(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def show_plan(plan: Plan, console: Console) -> None:
    cfg, topo, mem = plan.cfg, plan.topology, plan.memory
    counts = cfg.model.param_counts()
    console.print(
        f"[bold]{cfg.run.name}[/]  {cfg.algo.name.upper()} · {cfg.model.name} "
        f"({_b(counts.total)} params, {_b(counts.active)} active) · trainer={cfg.trainer.backend} "
        f"· rollout={cfg.rollout.backend} · cluster={cfg.cluster.name} ({cfg.cluster.gpu})"
    )

    nodes = Table(title=f"Nodes: {topo.nodes} x {topo.gpus_per_node} GPUs, {topo.placement.value}")
    for col in ("node", "role", "GPUs", "runs"):
        nodes.add_column(col)
    engines_per_node = topo.gpus_per_node // topo.rollout.tp
    for index, role in enumerate(topo.node_roles()):
        runs = []
        if "train" in role:
            first = (index - topo.rollout_nodes) * topo.gpus_per_node
            runs.append(f"trainer ranks {first}-{first + topo.gpus_per_node - 1}")
        if "rollout" in role:
            runs.append(f"{engines_per_node} {cfg.rollout.backend} engine(s) x TP{topo.rollout.tp}")
        nodes.add_row(str(index), role, str(topo.gpus_per_node), ", ".join(runs))
    console.print(nodes)

    par = Table(title="Parallelism")
    for col in ("side", "GPUs", "TP", "PP", "CP", "EP", "DP", "notes"):
        par.add_column(col)
    tr = topo.train
    notes = []
    if isinstance(cfg.trainer, MegatronTrainerConfig):
        notes.append("SP" if cfg.trainer.sequence_parallel else "no SP")
        notes.append("dist-opt" if cfg.trainer.distributed_optimizer else "replicated optimizer")
    if cfg.model.is_moe:
        if tr.expert_tp > 1:
            notes.append(f"expert TP {tr.expert_tp}")
        notes.append(f"expert DP {tr.expert_dp}")
    notes.append("recompute" if cfg.trainer.activation_checkpointing else "no recompute")
    par.add_row(
        "train", str(tr.world), str(tr.tp), str(tr.pp), str(tr.cp), str(tr.ep), str(tr.dp), ", ".join(notes)
    )
    ro = topo.rollout
    par.add_row(
        "rollout", str(ro.gpus), str(ro.tp), "1", "1", "-", str(ro.engines), f"{ro.engines} engine(s)"
    )
    console.print(par)

    table = Table(title=f"Memory per GPU (GB of {mem.capacity:.0f})")
    table.add_column("item")
    table.add_column("GB", justify="right")
    t = mem.train
    for name, value in (
        ("train: weights", t.weights),
        ("train: gradients", t.grads),
        ("train: optimizer", t.optimizer),
        ("train: activations", t.activations),
        ("train: logits", t.logits),
        ("train: runtime overhead", t.overhead),
        ("train: peak", t.peak),
    ):
        table.add_row(name, f"{value:.1f}")
    r = mem.rollout
    table.add_row("rollout: engine share", f"{r.budget:.1f}")
    table.add_row("rollout: weights (per GPU)", f"{r.weights:.1f}")
    table.add_row(f"rollout: KV per {r.sequence_len}-token sequence", f"{r.kv_per_sequence:.3f}")
    table.add_row("rollout: sequences in KV (fit / wanted)", f"{r.sequences_that_fit} / {r.wanted_sequences}")
    if topo.placement is Placement.COLOCATED:
        table.add_row("colocated peak (train state + engine share)", f"{mem.train_gpu_peak:.1f}")
    console.print(table)
    for gap in plan.backend_gaps:
        console.print(f"[yellow]cannot submit yet[/]: {gap}")
    if mem.fits:
        console.print(f"[green]fits[/]: peak {mem.train_gpu_peak:.0f} GB of {mem.capacity:.0f} GB per GPU")
    else:
        for problem in mem.problems:
            console.print(f"[red]does not fit[/]: {problem}")
        for recipe in matching_recipes(cfg.model.name, cfg.cluster.name):
            console.print(f"a shipped layout for this model and cluster: [bold]+experiment={recipe}[/]")

    if plan.quirks:
        quirks = Table(title="Model quirks applied")
        for col in ("quirk", "setting", "why"):
            quirks.add_column(col)
        for q in plan.quirks:
            quirks.add_row(q.quirk, f"{q.key}={q.value}", q.reason)
        console.print(quirks)

    if cfg.cluster.scheduler is Scheduler.slurm:
        from hpcrl.launch.sbatch import slurm_parameters

        params = slurm_parameters(plan)
        sb = Table(title="sbatch")
        sb.add_column("key")
        sb.add_column("value")
        for key in ("job_name", "partition", "account", "qos", "nodes", "gpus_per_node", "time"):
            if key in params:
                value = params[key]
                sb.add_row(key, f"{value} min" if key == "time" else str(value))
        for key, value in params["additional_parameters"].items():
            sb.add_row(key, str(value))
        container = cfg.cluster.container.image
        sb.add_row("container", container or "(none)")
        for name in sorted(cfg.cluster.env):
            sb.add_row(f"env {name}", cfg.cluster.env[name])
        console.print(sb)
