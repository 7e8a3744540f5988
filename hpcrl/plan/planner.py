"""From a composed config to a checked plan: quirks applied, topology built, memory estimated."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

from hpcrl.config.cluster import Scheduler
from hpcrl.config.compose import compose_config, conf_dir
from hpcrl.config.schema import RunConfig
from hpcrl.errors import ConfigError, DoesNotFitError, HpcrlError
from hpcrl.plan.engine_defaults import (
    GLOO_BROADCAST,
    RefitChoice,
    engine_line,
    resolve_block_size,
    resolve_engines_per_gpu,
    resolve_logprob_fraction,
    resolve_refit,
)
from hpcrl.plan.judge import JudgePlan, plan_judge
from hpcrl.plan.layout import Layout, LayoutSearch, typed_layout_keys
from hpcrl.plan.local_gpu import resolve_local_gpu
from hpcrl.plan.memory import MemoryEstimate, estimate_memory
from hpcrl.plan.micro_batch import resolve_micro_batch
from hpcrl.plan.moe import check_router_replay
from hpcrl.plan.mtp import check_mtp
from hpcrl.plan.nvlink import NvlinkCheck, check_nvlink
from hpcrl.plan.packing import check_packing, resolve_packing
from hpcrl.plan.quantization import check_quantization
from hpcrl.plan.quirks import AppliedQuirk, apply_quirks
from hpcrl.plan.search import search_layouts
from hpcrl.plan.topology import (
    Placement,
    Topology,
    build_topology,
    check_engine_fits_node,
    check_rollout_nodes,
    on_gpus,
)
from hpcrl.rollout.backends import sleep_mode
from hpcrl.trainer.backends import trainer_spec, with_degree


@dataclass(frozen=True)
class SleepChoice:
    """``rollout.sleep`` as the planner resolved it into the config, and why."""

    value: bool
    explicit: bool
    """Set by the user (True) or decided by the planner from None (False)."""
    reason: str
    """Why it is what it is, for ``hpcrl plan``."""


@dataclass(frozen=True)
class Plan:
    cfg: RunConfig
    topology: Topology
    memory: MemoryEstimate
    quirks: tuple[AppliedQuirk, ...]
    sleep: SleepChoice | None
    """None: the rollout backend has no sleep mode (rollout=hf)."""
    nvlink: NvlinkCheck = field(default_factory=NvlinkCheck)
    """Whether each TP and expert group stays inside one NVLink domain as the ranks are placed."""
    search: LayoutSearch | None = None
    """How auto layout chose this layout (None: the layout is the config's own)."""
    no_layout: str = ""
    """Why auto layout found no layout that fits either (this plan is then the config's own)."""
    engine_defaults: tuple[str, ...] = ()
    """Engine settings the planner chose where the config left them unset, as ``hpcrl plan`` prints them."""
    refit: RefitChoice = GLOO_BROADCAST
    """How weights reach the engines after a step (``engine_defaults.resolve_refit``): the job runs this."""
    judge: JudgePlan | None = None
    """The judge engines (``rewards.judge``, plan/judge.py); None: no judge."""

    @property
    def job_nodes(self) -> int:
        """The job's nodes: the topology's, the judges' own (``rewards.judge.nodes``), the environments'."""
        return self.topology.nodes + len(self.own_nodes())

    def node_roles(self) -> list[str]:
        """Each node's role by index: the topology's (``Topology.node_roles``), then ``own_nodes``."""
        return self.topology.node_roles() + self.own_nodes()

    def own_nodes(self) -> list[str]:
        """The roles after the topology's: judge nodes, then environment nodes (``env.nodes``)."""
        return ["judge"] * (self.judge.nodes if self.judge is not None else 0) + ["env"] * self.cfg.env.nodes

    @property
    def problems(self) -> list[str]:
        return [*self.memory.problems, *self.nvlink.problems]

    @property
    def fits(self) -> bool:
        return not self.problems

    def bigger_keys(self) -> str:
        """The parallel degrees this backend can raise to fit (fsdp: context and expert parallel)."""
        return "trainer." + "/".join(trainer_spec(self.cfg.trainer).degrees)

    def require_fit(self) -> None:
        if not self.fits:
            if self.no_layout:
                raise DoesNotFitError(self.no_layout)
            problems = "; ".join(self.problems)
            recipes = matching_recipes(self.cfg.model.name, self.cfg.cluster.name)
            hint = (
                f"; shipped recipes for this pair: {', '.join('+experiment=' + r for r in recipes)}"
                if recipes
                else ""
            )
            raise DoesNotFitError(
                f"{self.cfg.model.name} does not fit on {self.cfg.cluster.name}: {problems}. "
                f"Try more nodes, layout.rollout_nodes>=1 (split), larger {self.bigger_keys()}, "
                f"trainer.activation_checkpointing=true or a lower rollout.gpu_memory_utilization{hint}"
            )

    @property
    def backend_gaps(self) -> list[str]:
        """Why the chosen training backend cannot run this plan yet (empty: it can)."""
        return trainer_spec(self.cfg.trainer).build_gaps(self.cfg.model, self.cfg.trainer)

    def require_buildable(self) -> None:
        """Before anything is submitted: refuse a run whose backend cannot build the model."""
        if self.backend_gaps:
            raise ConfigError("; ".join(self.backend_gaps))


@dataclass(frozen=True)
class ShippedLayout:
    """A shipped recipe for the plan's model and cluster, planned on its own (``error``: why not)."""

    recipe: str
    plan: Plan | None
    error: str = ""


def shipped_layouts(current: Plan) -> list[ShippedLayout]:
    """Every shipped recipe for this model and cluster, planned with this run's site keys (account,
    image: they change no number, but a Slurm cluster refuses to compose without them); the recipe
    this plan was made from is this plan, not composed again."""
    cfg, cluster = current.cfg, current.cfg.cluster
    site = [
        f"cluster.{key}={value}"
        for key in cluster.slurm.required
        if isinstance(value := cluster.site_value(key), str) and value
    ]
    layouts = []
    for recipe in matching_recipes(cfg.model.name, cluster.name):
        if recipe == cfg.run.name:
            layouts.append(ShippedLayout(recipe, current))
            continue
        try:
            # as the recipe says, without auto layout: the table compares the shipped layouts
            recipe_cfg = compose_config([f"+experiment={recipe}", *site])
            layouts.append(ShippedLayout(recipe, make_plan(recipe_cfg)))
        except HpcrlError as exc:
            layouts.append(ShippedLayout(recipe, None, str(exc)))
    return layouts


def matching_recipes(model: str, cluster: str) -> list[str]:
    """Shipped experiment recipes that select this model on this cluster."""
    wanted = (f"override /model: {model}\n", f"override /cluster: {cluster}\n")
    paths = sorted((conf_dir() / "experiment").glob("*.yaml"), key=lambda p: p.stem)
    return [p.stem for p in paths if all(w in p.read_text() for w in wanted)]


def make_plan(cfg: RunConfig, layout: Layout | None = None) -> Plan:
    """Check cross-component rules and derive the plan; raises ConfigError on the first problem.

    ``layout``: one the auto layout search chose, else the config's own (``Layout.configured``). The
    plan's topology and memory estimate are built from it; a chosen one is also written into ``cfg``
    (the job's copy, ``Layout.apply``), where the run still reads some of its keys (the engines'
    ``rollout.tp``, the trainers' recompute, the sbatch's segment)."""
    resolve_local_gpu(cfg.cluster)  # cluster=local: this machine's GPU, before anything reads it
    if layout is not None:
        layout.apply(cfg)  # into the job's copy, where the trainers read recompute and the sbatch the segment
    check_cluster_layout(cfg)
    quirks = apply_quirks(cfg)
    check_algo(cfg)
    check_backend(cfg)
    shared = resolve_engines_per_gpu(cfg)
    gpus_per_node, rollout_gpus = cfg.cluster.gpus_per_node, cfg.cluster.rollout_node_gpus()
    check_rollout_nodes(cfg.cluster, split=cfg.layout.rollout_nodes > 0)
    if layout is None:  # named before the training degrees
        check_engine_fits_node(cfg.rollout.tp, rollout_gpus or gpus_per_node, rollout_gpus is not None)
        layout = Layout.configured(cfg)
    topo = build_topology(
        gpus_per_node=gpus_per_node,
        train=layout.train,
        rollout_nodes=layout.rollout_nodes,
        rollout_tp=layout.rollout_tp,
        engines_per_gpu=cfg.rollout.engines_per_gpu or 1,
        rollout_node_gpus=rollout_gpus,
    )
    check_model_parallel(cfg)
    check_images(cfg)
    check_quantization(cfg, topo.rollout.tp)
    sleep = resolve_sleep(cfg, topo.placement)
    micro = resolve_micro_batch(cfg, topo, recompute=layout.recompute)  # before the packing budget reads it
    lines = [
        shared,
        micro,
        resolve_block_size(cfg),
        resolve_logprob_fraction(cfg),
        engine_line(cfg),
        resolve_packing(cfg),
    ]
    chosen = tuple(filter(None, lines))
    nvlink = check_nvlink(topo, cfg.cluster.nvlink_domain_nodes, cfg.cluster.slurm.segment)
    memory = estimate_memory(cfg, topo, recompute=layout.recompute)
    refit = resolve_refit(cfg, topo)
    judge = plan_judge(cfg, on_gpus(cfg.cluster))
    return Plan(
        cfg, topo, memory, tuple(quirks), sleep, nvlink, engine_defaults=chosen, refit=refit, judge=judge
    )


def plan_from_overrides(overrides: list[str]) -> Plan:
    return plan_config(compose_config(overrides), typed_layout_keys(overrides))


def plan_config(cfg: RunConfig, fixed: frozenset[str] = frozenset()) -> Plan:
    """The config's own layout when it fits (exactly as ``make_plan``), else, or with
    ``layout.auto=true``, the best layout the search finds (``plan/search.py``), keeping the layout keys
    in ``fixed`` (typed on the command line) as they are. ``layout.auto=false`` keeps the config's
    layout whatever it needs; so does a search that finds nothing, with the reason (``no_layout``)."""
    resolve_local_gpu(cfg.cluster)  # the search sizes layouts by the GPU's memory
    auto = cfg.layout.auto
    if auto is True:
        return auto_plan(cfg, "layout.auto=true", fixed)
    pristine = copy.deepcopy(cfg) if auto is None else cfg
    plan = make_plan(cfg)
    if plan.fits or auto is False:
        return plan
    topo = plan.topology
    layout = (
        f"{topo.rollout_nodes} + {topo.train_nodes} nodes split"
        if topo.rollout_nodes
        else f"{topo.nodes} node{'s' if topo.nodes > 1 else ''} colocated"
    )
    try:
        return auto_plan(
            pristine, f"the configured layout ({layout}) does not fit: {plan.problems[0]}", fixed
        )
    except DoesNotFitError as exc:
        return replace(plan, no_layout=str(exc))


def auto_plan(cfg: RunConfig, reason: str, fixed: frozenset[str] = frozenset()) -> Plan:
    """Plan the best layout the search found (the next one should the full planner refuse it): its
    record is the plan's, written into a copy of ``cfg`` for the job."""
    search = search_layouts(cfg, reason, fixed)
    candidates = [search.chosen, *search.runners_up]
    for scored in candidates:
        try:
            plan = make_plan(copy.deepcopy(cfg), scored.layout)
        except ConfigError:
            continue
        if plan.fits:
            rest = tuple(c for c in candidates if c is not scored)
            return replace(plan, search=replace(search, chosen=scored, runners_up=rest))
    raise DoesNotFitError(
        f"auto layout: none of the {len(candidates)} best layouts for {cfg.model.name} on "
        f"{cfg.cluster.name} passed the planner's checks; set the layout by hand (hpcrl plan shows why)"
    )


def sleep_blocker(cfg: RunConfig, placement: Placement) -> str:
    """Why the engines cannot sleep while the trainer trains ("": they can)."""
    if placement is Placement.SPLIT:
        return "placement is split: the engines have GPUs of their own"
    if cfg.algo.max_staleness:
        return f"algo.max_staleness={cfg.algo.max_staleness}: the engines generate while the trainer trains"
    if not on_gpus(cfg.cluster):
        return f"cluster '{cfg.cluster.name}' runs on cpu, where vLLM has no sleep mode"
    return ""


SLEEP_ON = "the vllm engines share the trainer's GPUs: they sleep while it trains"
SLEEP_OFF = "the vllm engines stay awake, holding their share while the trainer trains"


def resolve_sleep(cfg: RunConfig, placement: Placement) -> SleepChoice | None:
    """Set ``rollout.sleep`` in place (the engine is built from the resolved config): None is on exactly
    for vllm engines colocated with the trainer on GPUs; an explicit true where it cannot apply is an error."""
    rollout = sleep_mode(cfg.rollout)
    if rollout is None:  # the engine has no sleep mode
        return None
    blocker = sleep_blocker(cfg, placement)
    explicit = rollout.sleep is not None
    if rollout.sleep is None:
        rollout.sleep = not blocker
    elif rollout.sleep and blocker:
        # colocated on cpu: the machine may have a GPU the cluster config does not name
        gpu = "" if placement is Placement.SPLIT else ", or name this machine's GPU (e.g. cluster.gpu=H200)"
        raise ConfigError(f"rollout.sleep=true needs colocated GPUs ({blocker}); drop it{gpu}")
    reason = blocker or (SLEEP_ON if rollout.sleep else SLEEP_OFF)
    return SleepChoice(rollout.sleep, explicit=explicit, reason=reason)


def check_cluster_layout(cfg: RunConfig) -> None:
    cluster, nodes = cfg.cluster, cfg.layout.train_nodes + cfg.layout.rollout_nodes
    if cluster.scheduler is Scheduler.local and nodes > 1:
        raise ConfigError(
            f"cluster=local runs on this machine only, but the layout asks for {nodes} nodes; "
            "pick a Slurm cluster (e.g. +cluster=gb200) or set layout.train_nodes=1 layout.rollout_nodes=0"
        )
    if cluster.scheduler is Scheduler.local and cluster.gpus_per_node > 1:
        # a local run places one trainer rank and one engine (run/fleet.py): a wider layout would plan
        # memory and parallelism it never runs
        raise ConfigError(
            f"cluster=local runs one trainer rank and one rollout engine, but cluster.gpus_per_node="
            f"{cluster.gpus_per_node}; set cluster.gpus_per_node=1, or pick a Slurm cluster for more GPUs"
        )
    if cluster.max_nodes is not None and nodes > cluster.max_nodes:
        raise ConfigError(
            f"the layout asks for {nodes} nodes but cluster '{cluster.name}' has {cluster.max_nodes} "
            "(cluster.max_nodes); lower layout.train_nodes/rollout_nodes"
        )
    segment = cluster.slurm.segment
    if segment is not None and nodes % segment:
        raise ConfigError(
            f"cluster.slurm.segment={segment} does not divide the job's {nodes} nodes; "
            f"use a segment that divides {nodes} (e.g. cluster.slurm.segment={nodes})"
        )
    if segment is not None and segment > cluster.nvlink_domain_nodes > 1:
        raise ConfigError(
            f"cluster.slurm.segment={segment} is larger than one NVLink domain "
            f"({cluster.nvlink_domain_nodes} nodes); a segment must fit in one rack"
        )


def check_algo(cfg: RunConfig) -> None:
    algo, rollout = cfg.algo, cfg.rollout
    if algo.overlong_buffer >= rollout.max_new_tokens:
        raise ConfigError(
            f"algo.overlong_buffer={algo.overlong_buffer} must be smaller than rollout.max_new_tokens="
            f"{rollout.max_new_tokens} (the penalty ramps over the last overlong_buffer tokens); "
            f"lower it, e.g. algo.overlong_buffer={rollout.max_new_tokens // 4}"
        )


def check_backend(cfg: RunConfig) -> None:
    trainer = cfg.trainer
    if "pp" not in trainer_spec(trainer).degrees and trainer.pp > 1:
        raise ConfigError(
            f"trainer.pp={trainer.pp}: the {trainer.backend} backend has no pipeline parallelism; "
            f"use {with_degree('pp')} or trainer.pp=1"
        )
    check_packing(cfg)
    check_router_replay(cfg)
    check_mtp(cfg)
    if trainer.ep > 1 and not cfg.model.is_moe:
        raise ConfigError(
            f"trainer.ep={trainer.ep} needs an MoE model; {cfg.model.name} is dense (set trainer.ep=1)"
        )


def check_images(cfg: RunConfig) -> None:
    """An image data set needs a model that takes images, and prompts long enough for one."""
    key, model, limit = cfg.data.image_field, cfg.model, cfg.data.max_prompt_tokens
    if not key:
        return
    if not model.image_tokens:
        raise ConfigError(
            f"data.image_field={key} sends images, and {model.name} takes none (model.image_tokens=0); "
            "use a vision-language model or drop data.image_field"
        )
    if model.image_tokens >= limit:
        raise ConfigError(
            f"data.max_prompt_tokens={limit} cannot hold one image of {model.name} ({model.image_tokens} "
            f"tokens) and its question: raise data.max_prompt_tokens above {model.image_tokens}"
        )


def check_model_parallel(cfg: RunConfig) -> None:
    model, trainer, rollout = cfg.model, cfg.trainer, cfg.rollout
    heads = model.num_attention_heads
    for key, tp in (("trainer.tp", trainer.tp), ("rollout.tp", rollout.tp)):
        if heads % tp:
            raise ConfigError(
                f"{key}={tp} does not divide {model.name}'s {heads} attention heads; "
                f"use a tp that divides {heads}"
            )
    if model.is_moe and model.num_experts % trainer.ep:
        raise ConfigError(
            f"trainer.ep={trainer.ep} does not divide {model.name}'s {model.num_experts} experts"
        )
    if trainer.pp > model.num_layers:
        raise ConfigError(f"trainer.pp={trainer.pp} exceeds {model.name}'s {model.num_layers} layers")
    if not trainer_spec(trainer).pads_cp and cfg.max_seq_len % trainer.cp:
        raise ConfigError(
            f"trainer.cp={trainer.cp} must divide the sequence length {cfg.max_seq_len} "
            "(data.max_prompt_tokens + rollout.max_new_tokens)"
        )
