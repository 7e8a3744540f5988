"""Per-GPU memory estimate for one run: training state, activations and the rollout's share.

Back-of-the-envelope numbers in GB (1e9 bytes), good to ~15%: enough to tell a layout that fits
from one that cannot, before an allocation is spent finding out. Sources of each term:
- mixed-precision Adam: bf16 weights (2 B/param), fp32 gradients (4) and fp32 master + m + v (12);
  FSDP2 keeps fp32 sharded parameters instead of a bf16 copy (16 B/param, all sharded);
- activations per layer and token: 34*h bytes without recompute, 2*h with full recompute plus one
  recomputed layer (Korthikanti et al. 2022, flash attention, sequence parallel dividing by tp);
- logits: fp32 logits and their gradient over the tensor-parallel vocabulary shard; with the chunked
  log-prob head (``trainer.fused_logprob``: fsdp, or megatron at tp=1) only one chunk of bf16 logits
  and its gradient exist at a time (``trainer/logprob_head.py``);
- the frozen reference policy (``algo.kl_coef > 0``): held as the trainer holds it, in fp32 (both
  backends build it with fp32 parameters), sharded like the policy: over the training world under
  fsdp (``trainer/fsdp/``), by TP/PP/EP under megatron (a whole copy per data-parallel rank);
- start-up: the rank's shards (policy and reference) plus one layer's full tensors as they are read
  from the checkpoint (``trainer/hf_load.py`` converts a fused MoE tensor from one whole layer), no
  gathered layers and no optimizer state yet;
- vLLM: ``gpu_memory_utilization`` of the GPU is taken while generating (weights/tp + KV cache);
- colocated with ``rollout.sleep`` (vLLM sleep level 2): the engine releases its weights and KV cache
  while the trainer trains, wakes its weights for the refit (written through two buckets of
  ``rollout.weight_sync_bucket_mb``), then its KV cache to generate; the GPU's peak is the largest of
  the three phases, not training plus the engine's share. The trainer keeps its weights and
  optimizer state resident throughout (the latter in host memory when offloaded); its gradients exist only inside a
  step (``trainer/step.py`` frees them after the last optimizer step), so the refit and generation
  phases do not count them.
- ``trainer.optimizer_offload`` (fsdp): the optimizer state lives in host memory and only the one
  tensor being stepped has its state on the GPU (``optimizer``); ``host`` is the state per training
  rank, counted per node against ``cluster.host_memory_gb`` where the cluster gives it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.config.schema import RunConfig
from hpcrl.plan.activations import ROUTER_BYTES, Share, activation_bytes
from hpcrl.plan.topology import Placement, Topology
from hpcrl.rollout.backends import served_weights, sleeps, speculative
from hpcrl.trainer.backends import layer_params, trainer_spec
from hpcrl.trainer.config import FUSED_CHUNK_ELEMENTS

GB = 1e9
RUNTIME_OVERHEAD_GB = 4.0  # CUDA context, NCCL buffers, allocator fragmentation
ENGINE_OVERHEAD_GB = 2.0  # vLLM activations and sampler workspace outside the KV cache
ENGINE_ASLEEP_GB = 4.0
"""What a vLLM engine still holds on its GPU asleep at level 2: its CUDA context (~0.5 GB), the
CUDA-graph pools and the allocator's cached blocks, which sleep mode does not release (vLLM reports
1-3 GB "still in use" after sleeping; measured 3.9 GB for an 8B shape on an H200, vLLM 0.26, graphs
captured up to 512 sequences: bench/results, session 15)."""
MIB = 2**20
DTYPE_BYTES = {"float32": 4, "float": 4}
"""Bytes per engine weight by ``rollout.dtype``; every other dtype vLLM takes (bfloat16, float16,
half, auto from a bf16 checkpoint) is 2."""
FP8_BLOCK_BYTES = 1 + 4 / (128 * 128)
"""Bytes per linear weight under ``rollout.quantization=fp8``: one e4m3 byte, plus a float32 scale
per 128x128 block. Embeddings, LM head and vision towers stay in ``rollout.dtype`` (norms and
routers too, a rounding error the parameter counts leave out)."""


@dataclass(frozen=True)
class TrainMemory:
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    overhead: float = RUNTIME_OVERHEAD_GB
    reference: float = 0.0
    """The frozen reference policy's share (``algo.kl_coef > 0``), resident for the whole run."""
    gathered: float = 0.0
    """The part of ``weights`` that is unsharded layer copies gathered for compute (fsdp)."""
    loading: float = 0.0
    """One layer's full tensors, read from the checkpoint at start-up."""
    host: float = 0.0
    """Host memory of one rank's offloaded optimizer state (``trainer.optimizer_offload``)."""

    @property
    def resident(self) -> float:
        """What stays on the GPU between training steps (the rollout phase shares the GPU with it):
        no gradients, which the step frees after its last optimizer step."""
        return self.weights + self.reference + self.optimizer + self.overhead

    @property
    def startup(self) -> float:
        """Peak while the models are loaded: the shards, one layer being read, no gradients or Adam state."""
        return self.weights - self.gathered + self.reference + self.loading + self.overhead

    @property
    def peak(self) -> float:
        return self.resident + self.grads + self.activations + self.logits


@dataclass(frozen=True)
class RolloutMemory:
    budget: float
    """GPU memory the engines on one GPU take together (gpu_memory_utilization x HBM)."""
    weights: float
    """One engine's weights on one of its GPUs."""
    kv_per_sequence: float
    sequence_len: int
    wanted_sequences: int
    """Sequences one engine should hold at once: samples per step / engines, capped by max_num_seqs."""
    per_gpu: int = 1
    """Engines sharing each GPU (``rollout.engines_per_gpu``), each with 1/per_gpu of the budget."""
    quantized: bool = False
    """The engine's linear layers are FP8 (``rollout.quantization``): ``weights`` counts them at
    ``FP8_BLOCK_BYTES``."""

    @property
    def engine_budget(self) -> float:
        return self.budget / self.per_gpu

    @property
    def kv_capacity(self) -> float:
        """One engine's KV cache."""
        return self.engine_budget - self.weights - ENGINE_OVERHEAD_GB

    @property
    def sequences_that_fit(self) -> int:
        """In one engine's KV cache."""
        if self.kv_per_sequence <= 0:
            return 0
        return max(0, int(self.kv_capacity // self.kv_per_sequence))

    def cpu_kv_gb(self, sequences: int | None = None) -> float:
        """The explicit KV budget of a vLLM engine on CPU, which would otherwise size its memory from one
        NUMA node: ``sequences`` (default ``wanted_sequences``) twice over, because the CPU engine holds
        its KV in float32, twice the 2 bytes a value ``kv_per_sequence`` plans for; never under 0.05 GB."""
        n = self.wanted_sequences if sequences is None else sequences
        return max(0.05, 2 * n * self.kv_per_sequence)


@dataclass(frozen=True)
class ColocatedPeaks:
    """One colocated GPU (trainer rank and engine taking turns), phase by phase, in GB."""

    sleep: bool
    """``rollout.sleep`` as resolved: the engine sleeps while the trainer trains."""
    train: float
    """Training. Sleep on: the trainer's peak + the sleeping engine's residue (``ENGINE_ASLEEP_GB``).
    Sleep off: the trainer's peak alone, as before sleep existed."""
    refit: float
    """Weights to the engine. Sleep on: the trainer's resident state + the woken engine weights + two
    weight-sync buckets + the residue. Sleep off: the same as ``generate`` (the refit happens inside
    the awake engine's share)."""
    generate: float
    """Generating: the trainer's resident state + the engine's whole share (weights, KV cache)."""
    buckets: float = 0.0
    """The two weight-sync buckets of the refit (counted with sleep on only)."""

    @property
    def peak(self) -> float:
        return max(self.train, self.refit, self.generate)


def colocated_peaks(
    train: TrainMemory, rollout: RolloutMemory, *, sleep: bool, bucket_mb: int
) -> ColocatedPeaks:
    generate = train.resident + rollout.budget
    if not sleep:
        # awake, the engine keeps its whole share allocated while the trainer trains
        return ColocatedPeaks(
            sleep=False, train=train.peak + rollout.budget, refit=generate, generate=generate
        )
    buckets = 2 * bucket_mb * MIB / GB
    return ColocatedPeaks(
        sleep=True,
        train=train.peak + rollout.per_gpu * ENGINE_ASLEEP_GB,
        refit=train.resident + rollout.per_gpu * (rollout.weights + ENGINE_ASLEEP_GB) + buckets,
        generate=generate,
        buckets=buckets,
    )


@dataclass(frozen=True)
class MemoryEstimate:
    capacity: float
    placement: Placement
    train: TrainMemory
    rollout: RolloutMemory
    colocated: ColocatedPeaks | None = None
    """The phases of a shared GPU (None: split, the engines have GPUs of their own)."""
    host_per_node: float = 0.0
    """Host memory the training ranks of one node take for their offloaded optimizer state."""
    host_capacity: float | None = None
    """``cluster.host_memory_gb`` (None: not known, not checked)."""

    @property
    def train_gpu_peak(self) -> float:
        return self.colocated.peak if self.colocated is not None else self.train.peak

    @property
    def rollout_gpu_peak(self) -> float:
        return self.rollout.budget if self.placement is Placement.SPLIT else self.train_gpu_peak

    @property
    def problems(self) -> list[str]:
        found = []
        cap = self.capacity
        if self.colocated is not None:
            found += self.colocated_problems(self.colocated)
        elif self.train.peak > cap:
            found.append(f"training needs {self.train.peak:.0f} GB per GPU of {cap:.0f} GB")
        if self.train.startup > cap:
            found.append(f"loading the models needs {self.train.startup:.0f} GB per GPU of {cap:.0f} GB")
        if self.host_capacity is not None and self.host_per_node > self.host_capacity:
            found.append(
                f"the offloaded optimizer state needs {self.host_per_node:.0f} GB of host memory per node "
                f"of {self.host_capacity:.0f} GB (cluster.host_memory_gb)"
            )
        if self.rollout.sequences_that_fit < 1:
            found.append(
                f"a rollout engine's share ({self.rollout.engine_budget:.0f} GB) cannot hold its weights "
                f"({self.rollout.weights:.0f} GB) and one {self.rollout.sequence_len}-token sequence"
            )
        return found

    def colocated_problems(self, phases: ColocatedPeaks) -> list[str]:
        t, r, cap = self.train, self.rollout, self.capacity
        per_gpu = f"per GPU of {cap:.0f} GB"
        found = []
        if phases.train > cap and phases.sleep:
            found.append(
                f"training beside the sleeping engine needs {t.peak:.0f} + {r.per_gpu * ENGINE_ASLEEP_GB:.0f} GB "
                f"= {phases.train:.0f} GB {per_gpu}"
            )
        elif phases.train > cap:
            found.append(f"training alone needs {phases.train:.0f} GB {per_gpu}")
        if phases.sleep and phases.refit > cap:
            found.append(
                f"the refit needs the training state ({t.resident:.0f} GB) plus the engine's weights "
                f"({r.per_gpu * r.weights:.0f} GB), two weight-sync buckets ({phases.buckets:.1f} GB) and the sleeping "
                f"engine's residue ({r.per_gpu * ENGINE_ASLEEP_GB:.0f} GB) = {phases.refit:.0f} GB {per_gpu}"
            )
        if phases.generate > cap:
            found.append(
                f"colocated rollout needs the training state ({t.resident:.0f} GB) plus vLLM's "
                f"share ({r.budget:.0f} GB) = {phases.generate:.0f} GB {per_gpu}"
            )
        return found

    @property
    def fits(self) -> bool:
        return not self.problems


def estimate_memory(cfg: RunConfig, topo: Topology, *, recompute: bool) -> MemoryEstimate:
    """The estimate of ``cfg`` as the planner resolved it (``rollout.sleep`` None counts as off) at the
    plan's degrees (``topo``) and recompute (its layout's: ``cfg.trainer.activation_checkpointing`` is
    not read)."""
    train, rollout = estimate_train(cfg, topo, recompute=recompute), estimate_rollout(cfg, topo)
    phases = None
    if topo.placement is Placement.COLOCATED:
        sleep = sleeps(cfg.rollout)
        phases = colocated_peaks(train, rollout, sleep=sleep, bucket_mb=cfg.rollout.weight_sync_bucket_mb)
    ranks_per_node = min(cfg.cluster.gpus_per_node, topo.train.world)
    return MemoryEstimate(
        cfg.cluster.gpu_memory_gb,
        topo.placement,
        train,
        rollout,
        phases,
        host_per_node=train.host * ranks_per_node,
        host_capacity=cfg.cluster.host_memory_gb,
    )


def estimate_train(cfg: RunConfig, topo: Topology, *, recompute: bool) -> TrainMemory:
    """One training GPU's memory at the degrees of ``topo.train`` (the one record; ``cfg.trainer``'s
    own degrees are not read) with activation checkpointing as ``recompute`` says."""
    model, trainer, par = cfg.model, cfg.trainer, topo.train
    counts = model.param_counts()
    if trainer.mtp_loss_scale is not None:
        counts = counts.with_mtp()
    layer = layer_params(counts, model)
    state = trainer_spec(trainer).state(counts, model, trainer, par)  # the backend's own share
    share = train_share(cfg, topo)
    activations = activation_bytes(model, share, recompute)
    if trainer.chunked_logprob(par.tp):
        chunk = min(share.tokens, FUSED_CHUNK_ELEMENTS // model.vocab_size)
        logits = chunk * model.vocab_size * 2 * 2
    else:
        logits = share.tokens * model.vocab_size / par.tp * 4 * 2
    return TrainMemory(
        weights=state.weights / GB,
        grads=state.grads / GB,
        optimizer=state.optimizer / GB,
        activations=activations / GB,
        logits=logits / GB,
        reference=state.reference / GB if cfg.algo.kl_coef > 0 else 0.0,
        gathered=state.gathered / GB,
        loading=4 * layer / GB,  # fp32 at most (the tensors are cast as they are copied in)
        host=state.host / GB,
    )


def train_share(cfg: RunConfig, topo: Topology) -> Share:
    """One training GPU's slice of a micro-batch, as the activation terms divide it."""
    trainer, par = cfg.trainer, topo.train
    sp = trainer_spec(trainer).sequence_parallel(trainer)
    return Share(
        tokens=trainer.micro_tokens(cfg.max_seq_len) / par.cp,
        tp=par.tp,
        sp=par.tp if sp else 1,
        cp=par.cp,
        expert_tp=par.expert_tp,
        router_bytes=ROUTER_BYTES.get(trainer.router_dtype or "", 2),
    )


def estimate_rollout(cfg: RunConfig, topo: Topology) -> RolloutMemory:
    model, rollout = cfg.model, cfg.rollout
    tp = topo.rollout.tp
    counts = model.param_counts()
    if speculative(rollout) is not None:
        counts = counts.with_mtp()
    served_as = served_weights(rollout)  # None: bf16, the whole model
    text_only = served_as is not None and served_as.language_model_only
    served = counts.total - (counts.frozen if text_only else 0)
    weight_bytes = DTYPE_BYTES.get(served_as.dtype, 2) if served_as is not None else 2
    quantized = served_as is not None and served_as.quantization is not None
    if quantized:  # the decoder's linear layers: all but embeddings and vision towers
        linear = counts.total - counts.embedding - counts.frozen
        engine_bytes = weight_bytes * (served - linear) + FP8_BLOCK_BYTES * linear
    else:
        engine_bytes = weight_bytes * served
    seq_len = cfg.max_seq_len
    samples = cfg.algo.samples_per_step
    wanted = -(-samples // topo.rollout.engines)  # engines_per_gpu included
    wanted = min(wanted, rollout.max_num_seqs)
    return RolloutMemory(
        budget=rollout.gpu_memory_utilization
        * cfg.cluster.rollout_memory_gb(topo.placement is Placement.SPLIT),
        weights=engine_bytes / tp / GB,
        kv_per_sequence=model.kv_bytes_for_sequence(seq_len, tp=tp) / GB,
        sequence_len=seq_len,
        wanted_sequences=wanted,
        per_gpu=topo.rollout.per_gpu,
        quantized=quantized,
    )
