"""The training backends' table: what the planner, the driver and the login-node tools know about
each backend, without importing it (no torch here: ``hpcrl plan`` reads this table).

A training backend is its folder (``trainer/fsdp/``, ``trainer/megatron/``), its schema class
(``trainer/config.py``) and one ``TrainerSpec`` in ``TRAINERS``; code outside those asks the spec
(``trainer_spec(cfg.trainer)``), never which backend it has (``tests/project/test_backend_sites.py``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from hpcrl.core.parallel import TrainParallel
from hpcrl.trainer.config import (
    MegatronTrainerConfig,
    Optimizer,
    Precision,
    TrainerConfig,
    fsdp_build_gap,
    megatron_build_gap,
)

if TYPE_CHECKING:
    from hpcrl.config.model import ModelConfig, ParamCounts

Options = Callable[[str, list[int]], list[int]]
"""The layout search's filter: the searched values of a ``trainer.*`` key, or only its typed one."""
Degrees = tuple[int, int, int, int, int]
"""(tp, pp, cp, ep, expert_tp) of one layout the search tries."""


@dataclass(frozen=True)
class TrainState:
    """Bytes one training GPU holds for its share of the model (the memory estimate's terms)."""

    weights: float
    """Parameters as the backend holds them (fsdp: with the two gathered layers, ``gathered``)."""
    reference: float
    """The frozen reference policy, in fp32 (``algo.kl_coef`` > 0)."""
    grads: float
    optimizer: float
    """On the GPU (with ``trainer.optimizer_offload``: the one tensor's state being stepped)."""
    gathered: float = 0.0
    host: float = 0.0
    """Host memory this rank's optimizer state takes (``trainer.optimizer_offload``)."""


@dataclass(frozen=True)
class TrainerSpec:
    name: str
    """The ``trainer`` group's option and the schema's ``backend``."""
    build: str
    """``module:Class`` of its Trainer, imported only where a rank builds one (``make``)."""
    packages: tuple[str, ...]
    """Distributions it needs beyond torch, ray and transformers (``hpcrl doctor`` checks their pins)."""
    degrees: tuple[str, ...]
    """The ``trainer.*`` parallel degrees it splits over, which the layout search varies and a plan
    that does not fit may raise; the others must stay 1 (``build_gaps`` says why)."""
    checkpoint_layout: tuple[str, ...]
    """The degrees a checkpoint's model.json records beside the world size."""
    pads_cp: bool
    """Pads each sequence to a multiple of ``trainer.cp`` itself; otherwise cp must divide the length."""
    packs: bool
    """Runs packed micro-batches (``trainer.packing``: several sequences in one row)."""
    packs_over_cp: bool
    """Splits a packed row over context-parallel ranks (``trainer.packing`` with ``trainer.cp`` > 1)."""
    checkpoint_weight_bytes: int
    """One checkpoint's weights per parameter, beside the optimizer state (``optimizer_bytes``; fsdp:
    fp32 weights; megatron: bf16 weights + fp32 master)."""
    ipc_any_world: bool
    """Every rank gathers each tensor whole, so every rank can feed the engine on its own GPU by CUDA
    IPC at any world size; otherwise only a single rank can."""
    checkpoint_prefix: str
    """Where the model's tensors sit in its DCP checkpoint (``hpcrl export`` reads them)."""
    export_names: str
    """``module:function`` (imported only by ``hpcrl export``): (HF config dir, source model dir) -> a
    function turning a group of its checkpoint tensors into the Hugging Face checkpoint's names."""
    expert_tp: bool
    """Tensor parallel inside each expert (``trainer.expert_tp``, read through ``expert_tp_view``)."""
    model_gap: Callable[[ModelConfig], str]
    """Why it cannot build this model at any layout ("": it can)."""
    build_gaps: Callable[[ModelConfig, TrainerConfig], list[str]]
    """Why it cannot train this model at the configured layout (empty: it can)."""
    choices: Callable[[ModelConfig, TrainerConfig, int, int, Options], list[Degrees]]
    """The layouts the search tries for (model, trainer, GPUs per node, sequence length, options),
    least parallel first."""
    state: Callable[[ParamCounts, ModelConfig, TrainerConfig, TrainParallel], TrainState]
    """Its per-GPU training state (memory estimate)."""
    sequence_parallel: Callable[[TrainerConfig], bool]
    """Whether activations outside attention/MLP are split over the TP ranks."""
    notes: Callable[[TrainerConfig], list[str]]
    """Its own settings worth a word in ``hpcrl plan``'s parallelism table."""
    images: bool = False
    """Trains on image prompts (``data.image_field``): the processor's pixel tensors ride with the batch
    into the model's forward, whose vision tower stays frozen."""
    optimizer_options: tuple[str, ...] = ()
    """The optimizer settings it runs beyond AdamW in fp32 on the GPU, as ``key=value`` of
    ``trainer.*`` (``optimizer_gap`` refuses the others)."""
    mtp_gap: Callable[[ModelConfig, TrainerConfig], str] | None = None
    """Loads, trains, exports and refits the model's multi-token-prediction layers
    (``trainer.mtp_loss_scale``) where this says nothing: why a model or layout cannot yet. None: never."""

    def checkpoint_bytes(self, model: ModelConfig, trainer: TrainerConfig) -> float:
        """One checkpoint's bytes per parameter: weights and optimizer state."""
        return self.checkpoint_weight_bytes + optimizer_bytes(model, trainer)

    def make(self) -> Any:
        """The Trainer class (imports the backend: torch and its libraries)."""
        return _load(self.build)

    def hf_names(self, hf_dir: Path, source: Path) -> Callable[[dict[str, Any]], dict[str, Any]]:
        """``export_names`` for this checkpoint (imports the backend)."""
        return cast(Callable[[dict[str, Any]], dict[str, Any]], _load(self.export_names)(hf_dir, source))


def with_mtp() -> str:
    """The backends that carry MTP layers, for a message."""
    return " or ".join(f"trainer={n}" for n, s in TRAINERS.items() if s.mtp_gap is not None)


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def layer_params(counts: ParamCounts, model: ModelConfig) -> float:
    """Trainable parameters of one decoder layer (on average)."""
    return (counts.total - counts.embedding - counts.frozen) / model.num_layers


# -- fsdp ------------------------------------------------------------------------------------------------
def _fsdp_choices(
    model: ModelConfig, trainer: TrainerConfig, gpn: int, seq: int, options: Options
) -> list[Degrees]:
    """CP, and EP as configured or 1 (``fsdp_build_gap``): FSDP shards experts over every rank
    either way, so EP only shrinks the gathered layer; a configured EP that does not divide another
    node count's GPUs leaves EP1 there."""
    fixed = [options(f"trainer.{k}", [1]) for k in ("tp", "pp")]
    eps = options("trainer.ep", sorted({1, trainer.ep}))
    cps = options("trainer.cp", [c for c in (1, 2, 4, 8) if not fsdp_build_gap(model, cp=c)])
    return [(tp, pp, cp, ep, 1) for tp in fixed[0] for pp in fixed[1] for ep in eps for cp in cps]


def optimizer_settings(trainer: TrainerConfig) -> list[str]:
    """The optimizer settings ``trainer`` asks for beyond the default (``TrainerSpec.optimizer_options``)."""
    return [
        f"{key}={value}"
        for key, value, default in (
            ("optimizer", trainer.optimizer.value, Optimizer.adamw.value),
            ("optimizer_dtype", trainer.optimizer_dtype.value, Precision.float32.value),
            ("optimizer_offload", str(trainer.optimizer_offload).lower(), "false"),
        )
        if value != default
    ]


def optimizer_gap(trainer: TrainerConfig) -> str:
    """Why the chosen backend cannot run ``trainer``'s optimizer settings ("": it can)."""
    spec = trainer_spec(trainer)
    for setting in optimizer_settings(trainer):
        if setting not in spec.optimizer_options:
            others = [f"trainer={n}" for n, s in TRAINERS.items() if setting in s.optimizer_options]
            return (
                f"trainer.{setting} is not supported by trainer={spec.name}: use "
                f"{' or '.join(others) or 'the default'}, or drop trainer.{setting.partition('=')[0]}"
            )
    return ""


def optimizer_bytes(model: ModelConfig, trainer: TrainerConfig, fp32: bool = False) -> float:
    """Bytes of optimizer state per trainable parameter as kept between steps (``fp32``: as stepped):
    AdamW's m and v; Adafactor's row and column means of each matrix (rows + columns values for rows
    x columns parameters, about 2 / hidden_size of them; vectors, with a full second moment, are few)."""
    dtype = 2 if trainer.optimizer_dtype is Precision.bfloat16 and not fp32 else 4
    if trainer.optimizer is Optimizer.adafactor:
        return dtype * 2 / model.hidden_size
    return 2 * dtype


def largest_tensor(counts: ParamCounts, model: ModelConfig) -> float:
    """Elements of the largest parameter tensor: the embedding, or one layer's fused experts."""
    experts = counts.expert / model.num_layers if counts.expert else 0
    return max(model.vocab_size * model.hidden_size, experts)


def _fsdp_optimizer(
    counts: ParamCounts, model: ModelConfig, trainer: TrainerConfig, trainable: float, world: int
) -> tuple[float, float]:
    """(GPU, host) bytes of one rank's optimizer state (trainer/fsdp/optim.py). Offloaded or in bf16,
    one tensor at a time is stepped with its state in fp32 on the GPU; bf16's stochastic rounding
    takes 8 bytes an element more while it runs (the noise and the sum), Adafactor's step 12 (its
    full-size variance estimate and squared gradients). Measured on one H200, a 4096 x 4096 tensor
    (bench/optimizer_gpu.py): 8.0, 13.4, 17.2 and 11.5 bytes an element for AdamW offloaded, bf16,
    bf16 offloaded and Adafactor; counted here as 8, 16, 16 and 12. The largest tensor is stepped
    last in the worst case: its shard is what is counted."""
    bf16, offload = trainer.optimizer_dtype is Precision.bfloat16, trainer.optimizer_offload
    kept = optimizer_bytes(model, trainer) * trainable
    fp32 = optimizer_bytes(model, trainer, fp32=True) if offload or bf16 else 0.0
    workspace = 8 * bf16 + 12 * (trainer.optimizer is Optimizer.adafactor)
    stepped = (fp32 + workspace) * largest_tensor(counts, model) / world
    return (stepped, kept) if offload else (kept + stepped, 0.0)


def _fsdp_state(
    counts: ParamCounts, model: ModelConfig, trainer: TrainerConfig, par: TrainParallel
) -> TrainState:
    """FSDP2 shards everything over the training world, experts too (over EP, then expert DP); what
    EP changes is the gathered layer: its dense part whole, 1/ep of its experts."""
    frozen = counts.frozen
    trainable = (counts.dense - frozen + counts.expert) / par.world
    dense_layer = layer_params(counts, model) - counts.expert / model.num_layers
    layer = dense_layer + counts.expert / model.num_layers / par.ep
    gathered = 2 * 2 * layer / par.tp  # bf16 copies: the current and the prefetched layer
    # the optimizer's state (the fp32 master weights are `weights`)
    optimizer, host = _fsdp_optimizer(counts, model, trainer, trainable, par.world)
    return TrainState(
        # frozen towers are fp32 shards like the rest (no gradients, no Adam state)
        weights=4 * trainable + 4 * frozen / par.world + gathered,
        reference=4 * counts.total / par.world,
        grads=4 * trainable,
        optimizer=optimizer,
        gathered=gathered,
        host=host,
    )


FSDP = TrainerSpec(
    name="fsdp",
    build="hpcrl.trainer.fsdp:FSDPTrainer",
    packages=(),
    degrees=("cp", "ep"),
    checkpoint_layout=(),
    pads_cp=True,
    packs=True,
    packs_over_cp=False,
    checkpoint_weight_bytes=4,
    ipc_any_world=True,
    checkpoint_prefix="model.",
    export_names="hpcrl.trainer.fsdp.export:hf_names",
    expert_tp=False,
    model_gap=lambda model: "",
    build_gaps=lambda model, t: [gap] if (gap := fsdp_build_gap(model, t.tp, t.cp, t.ep)) else [],
    choices=_fsdp_choices,
    state=_fsdp_state,
    sequence_parallel=lambda t: False,
    notes=lambda t: [],
    images=True,
    optimizer_options=("optimizer=adafactor", "optimizer_dtype=bfloat16", "optimizer_offload=true"),
    mtp_gap=lambda model, t: "",
)


# -- megatron --------------------------------------------------------------------------------------------
def _megatron(trainer: TrainerConfig) -> MegatronTrainerConfig:
    """The megatron schema's own settings (the ``trainer`` group picked it for this spec)."""
    return cast(MegatronTrainerConfig, trainer)


def _megatron_mtp_gap(model: ModelConfig, t: MegatronTrainerConfig) -> str:
    """MTP layers run under TP/SP, PP, EP, CP, packing and router replay (their routers free) as the
    decoder's (megatron/mtp.py). Under PP the last stage keeps a copy of the input embedding for them;
    a tied head is a second copy there, a case no Nemotron-H checkpoint has and none is tested."""
    if t.pp > 1 and model.tie_embeddings:
        return (
            f"trainer=megatron does not carry the MTP layers of a model with tied embeddings "
            f"(model.tie_embeddings=true) under trainer.pp={t.pp} yet: set trainer.pp=1, or use trainer=fsdp"
        )
    return ""


def _megatron_gaps(model: ModelConfig, trainer: TrainerConfig) -> list[str]:
    t = _megatron(trainer)
    gaps = []
    if gap := megatron_build_gap(model, t.tp, t.pp, t.cp):
        missing = gap.startswith("trainer=megatron cannot build")  # else: a layout to change
        gaps.append(f"{gap}; the plan above is the layout it will use once it can" if missing else gap)
    if model.is_moe and t.moe_gap(model.name):
        gaps.append(t.moe_gap(model.name))
    return gaps


def _megatron_choices(
    model: ModelConfig, trainer: TrainerConfig, gpn: int, seq: int, options: Options
) -> list[Degrees]:
    from hpcrl.core.checks import divisors

    t = _megatron(trainer)
    heads = model.num_attention_heads
    tps = options("trainer.tp", [d for d in divisors(gpn) if heads % d == 0])
    pps = options("trainer.pp", [p for p in (1, 2, 4, 8, 16) if model.num_layers % p == 0])
    cps = options("trainer.cp", [c for c in (1, 2, 4, 8) if seq % c == 0])
    experts = [e for e in (1, 2, 4, 8, 16, 32, 64) if model.is_moe and model.num_experts % e == 0]
    eps = options("trainer.ep", experts or [1])
    out = []
    for tp in tps:
        if model.is_moe and tp > 1 and not t.sequence_parallel:
            continue  # MegatronTrainerConfig.moe_gap
        for pp in pps:
            for cp in cps:
                if megatron_build_gap(model, tp, pp, cp):
                    continue
                out += [(tp, pp, cp, ep, t.expert_tp) for ep in eps]
    return out


def megatron_dense_share(counts: ParamCounts, kv_heads: int, tp: int) -> float:
    """Trainable non-expert parameters on one TP rank: split by tp, except what Megatron keeps whole
    on every rank (router, latent projections) and Q/K/V, split only as far as the KV heads go."""
    dense = counts.dense - counts.frozen
    split = dense - counts.replicated - counts.qkv
    return split / tp + counts.replicated + counts.qkv / min(tp, kv_heads)


def _megatron_state(
    counts: ParamCounts, model: ModelConfig, trainer: TrainerConfig, par: TrainParallel
) -> TrainState:
    t = _megatron(trainer)
    weight_bytes = 4 if t.precision is Precision.float32 else 2
    dense = megatron_dense_share(counts, model.num_kv_heads, par.tp) / par.pp
    expert = counts.expert / (par.ep * par.expert_tp * par.pp)
    frozen = counts.frozen / (par.tp * par.pp)
    dense_opt_group = par.dp * par.cp if t.distributed_optimizer else 1
    expert_opt_group = par.expert_dp if t.distributed_optimizer else 1
    return TrainState(
        weights=weight_bytes * (dense + expert + frozen),
        reference=4 * (dense + expert + frozen),
        grads=4 * (dense + expert),
        optimizer=12 * (dense / dense_opt_group + expert / expert_opt_group),
    )


def _megatron_notes(trainer: TrainerConfig) -> list[str]:
    t = _megatron(trainer)
    return [
        "SP" if t.sequence_parallel else "no SP",
        "dist-opt" if t.distributed_optimizer else "replicated optimizer",
    ]


MEGATRON = TrainerSpec(
    name="megatron",
    build="hpcrl.trainer.megatron:MegatronTrainer",
    packages=("megatron-core",),
    degrees=("tp", "pp", "cp", "ep"),
    checkpoint_layout=("tp", "pp", "cp", "ep", "expert_tp"),
    pads_cp=False,
    packs=True,
    packs_over_cp=True,
    checkpoint_weight_bytes=6,
    ipc_any_world=False,
    checkpoint_prefix="model/",
    export_names="hpcrl.trainer.megatron.export:hf_names",
    expert_tp=True,
    mtp_gap=lambda model, t: _megatron_mtp_gap(model, _megatron(t)),
    model_gap=lambda model: megatron_build_gap(model),
    build_gaps=_megatron_gaps,
    choices=_megatron_choices,
    state=_megatron_state,
    sequence_parallel=lambda t: _megatron(t).sequence_parallel,
    notes=_megatron_notes,
)


TRAINERS: dict[str, TrainerSpec] = {spec.name: spec for spec in (FSDP, MEGATRON)}
"""Every training backend, by the ``trainer`` group's option."""


def trainer_spec(trainer: TrainerConfig) -> TrainerSpec:
    """The spec of the backend the ``trainer`` group chose."""
    return TRAINERS[trainer.backend]


def with_degree(name: str) -> str:
    """The backends that split over ``trainer.<name>``, for a message (e.g. "trainer=megatron")."""
    return " or ".join(f"trainer={n}" for n, s in TRAINERS.items() if name in s.degrees)


def with_capability(flag: str) -> str:
    """The backends whose table entry sets ``flag`` (e.g. "packs"), for a message."""
    return " or ".join(f"trainer={n}" for n, s in TRAINERS.items() if getattr(s, flag))


class ExpertTP(Protocol):
    expert_tp: int


def expert_tp_view(trainer: TrainerConfig) -> ExpertTP | None:
    """``trainer.expert_tp`` where the backend has it (``TrainerSpec.expert_tp``)."""
    return cast(ExpertTP, trainer) if trainer_spec(trainer).expert_tp else None


def expert_tp(trainer: TrainerConfig) -> int:
    """The tensor-parallel degree inside each expert (1 where the backend has none)."""
    view = expert_tp_view(trainer)
    return view.expert_tp if view is not None else 1
