"""What Megatron-core's hybrid (Mamba-2 + attention + MoE) stack needs and cannot get here, in one
contained module: pure torch, autograd-safe, used only where the real pieces are absent.

- ``TorchMambaMixer`` stands in for ``megatron.core.ssm.mamba_mixer.MambaMixer``, which needs
  mamba_ssm's Triton chunked scan and gated RMSNorm and causal_conv1d (none installs on the CPU
  machines or the lent GPU; the module even imports triton at the top). Same parameters and per-TP-rank
  layout as Megatron's: ``in_proj`` rows [z | x | B | C | dt] of this rank, a depthwise causal
  ``conv1d`` over [x | B | C], ``A_log``/``D``/``dt_bias`` per head, the gated group RMSNorm, ``out_proj``.
  The scan is the SSD chunked form (``trainer/ssd.py``) in fp32, with Hugging Face's and vLLM's dt
  floor (``time_step_min``): Megatron's kernels do not clamp, but the rollout engines do, and the
  trainer must score what they sample. Packed rows (``packed_seq_params``, as Megatron's mixer takes
  them) convolve and scan each sequence from zeros, the kernels through their ``seq_idx``. Where mamba_ssm
  and causal_conv1d do install (a CUDA host with them, ``trainer.kernels=auto``: trainer/kernels.py),
  the mixer keeps its parameters and math and calls mamba_ssm's fused scan and gated norm with the
  same arguments, floor included, and causal_conv1d's conv (with the SiLU after it fused).
  Context parallel as Megatron's MambaContextParallel (``mamba_cp.MambaCP``): the conv and the scan
  run on whole sequences for heads/cp of this rank's heads, between two all-to-alls over the CP group.
- ``LatentMoELayer`` is Megatron's MoELayer with the latent projections (``fc1_latent_proj``,
  ``fc2_latent_proj``) as replicated torch linears: Megatron builds them only with Transformer Engine
  (families/nemotron_h.py's TE build takes Megatron's MoELayer).
- ``hybrid_model`` builds the hybrid model under either name megatron-core gives it: ``MambaModel`` /
  ``MambaStack`` / ``hybrid_override_pattern`` (0.16, the CPU lock) or ``HybridModel`` / ``HybridStack``
  / ``hybrid_layer_pattern`` (0.19, the GPU), with a final norm that is not Transformer Engine's.

Imports Megatron-core: imported only where a Megatron model is built.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer

from hpcrl.trainer.kernels import TORCH, Kernels, active_for
from hpcrl.trainer.megatron.mamba_cp import MambaCP
from hpcrl.trainer.megatron.spec_utils import build
from hpcrl.trainer.ssd import seq_index_of_bounds, ssd_scan


def mamba_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    chunk: int,
    d: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_min: float,
    kernels: Kernels = TORCH,
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """The mixer's scan from the raw dt: softplus(dt + dt_bias) floored at ``dt_min``, the SSD scan,
    D's skip; by mamba_ssm's ``mamba_chunk_scan_combined`` (same arguments) when ``kernels`` has it.
    ``seq_idx`` [b, l]: a packed row's sequences, each scanned from a zero state (trainer/ssd.py)."""
    if kernels.scan is not None:
        return kernels.scan(
            x,
            dt,
            a,
            b,
            c,
            chunk,
            D=d,
            dt_bias=dt_bias,
            dt_softplus=True,
            dt_limit=(dt_min, float("inf")),
            seq_idx=seq_idx,
        )
    dt = F.softplus(dt.float() + dt_bias.float()).clamp(min=dt_min)
    return ssd_scan(x, dt, a, b, c, chunk, seq_idx) + x.float() * d.float()[:, None]


def gated_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group: int, eps: float
) -> torch.Tensor:
    """Mamba-2's output norm: y * silu(z), RMS-normalised over groups of ``group`` channels, in fp32."""
    h = y.float() * F.silu(z.float())
    g = h.view(*h.shape[:-1], -1, group)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view_as(h).to(y.dtype)


# -- the mixer ------------------------------------------------------------------------------------------
class TorchMambaMixer(MegatronModule):
    """Megatron's MambaMixer in torch (module docstring). Input and output [s, b, h]; under sequence
    parallel the input is this TP rank's slice of the sequence (``in_proj`` gathers it, ``out_proj``
    reduce-scatters), heads and groups are split over TP; under context parallel it is this CP rank's
    two chunks of every sequence, and the conv + scan run on whole sequences for heads/cp of the heads
    (``self.cp``: the exchanges and this rank's slices of conv1d, A_log, D and dt_bias)."""

    def __init__(
        self,
        config: Any,
        d_model: int,
        *,
        chunk_size: int,
        conv_kernel: int,
        dt_min: float,
        linears: tuple[type, type] | None = None,
        **_: Any,
    ) -> None:
        """``linears``: in_proj's and out_proj's classes (Transformer Engine's, families/nemotron_h.py);
        None: Megatron's own column- and row-parallel linears."""
        super().__init__(config)
        tp = ps.get_tensor_model_parallel_world_size()
        heads, groups = config.mamba_num_heads, config.mamba_num_groups
        if heads % tp or groups % tp:
            raise ValueError(
                f"trainer.tp={tp} must divide the model's {heads} Mamba heads and {groups} groups"
            )
        self.heads, self.groups, self.state = heads // tp, groups // tp, config.mamba_state_dim
        self.head_dim, self.chunk, self.dt_min = config.mamba_head_dim, chunk_size, dt_min
        self.inner = self.heads * self.head_dim
        self.group_size = heads * self.head_dim // groups
        self.eps = config.layernorm_epsilon
        conv_dim = self.inner + 2 * self.groups * self.state
        column, row = linears or (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear)
        self.in_proj = column(
            d_model,
            (2 * self.inner + 2 * self.groups * self.state + self.heads) * tp,
            config=config,
            init_method=config.init_method,
            bias=False,
            gather_output=False,
            skip_bias_add=False,
            is_expert=False,
        )
        self.conv1d = torch.nn.Conv1d(
            conv_dim, conv_dim, conv_kernel, groups=conv_dim, padding=conv_kernel - 1
        )
        self.A_log = torch.nn.Parameter(torch.zeros(self.heads))
        self.D = torch.nn.Parameter(torch.ones(self.heads))
        self.dt_bias = torch.nn.Parameter(torch.zeros(self.heads))
        self.norm = _Weight(self.inner)
        self.out_proj = row(
            self.inner * tp,
            d_model,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
        )
        cp_group = ps.get_context_parallel_group() if config.context_parallel_size > 1 else None
        self.cp = MambaCP(cp_group, self.heads, self.groups, self.state, self.head_dim)

    def forward(
        self, hidden: torch.Tensor, packed_seq_params: Any = None, **_: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``packed_seq_params``: a packed row's sequence bounds (``cu_seqlens_q``, as Megatron's
        MambaMixer reads them); each sequence then convolves and scans on its own."""
        zxbcdt, _ = self.in_proj(hidden)  # [s (/cp), b, this rank's z|x|B|C|dt]
        gn = self.groups * self.state
        z, xbc, dt = zxbcdt.split([self.inner, self.inner + 2 * gn, self.heads], dim=-1)
        # under CP: the whole sequence for this CP rank's heads (mamba_cp.py), and back after the scan
        xbc, dt = self.cp.to_heads(xbc, dt)
        seq_idx = None  # a packed row (whole again under CP): its sequences' bounds, row order
        if packed_seq_params is not None:
            seq_idx = seq_index_of_bounds(packed_seq_params.cu_seqlens_q, xbc.shape[0])
        y = self._conv_scan(xbc.transpose(0, 1), dt.transpose(0, 1), seq_idx)
        y = self.cp.to_sequence(y.transpose(0, 1))
        if (kernels := active_for(y)).mamba:
            y = kernels.norm(
                y,
                self.norm.weight,
                None,
                z=z,
                eps=self.eps,
                group_size=self.group_size,
                norm_before_gate=False,
            )
        else:
            y = gated_rms_norm(y, z, self.norm.weight, self.group_size, self.eps)
        return self.out_proj(y.contiguous())

    def _conv_scan(
        self, xbc: torch.Tensor, dt: torch.Tensor, seq_idx: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[b, s, x|B|C] and [b, s, heads] of this CP rank's heads -> the scan's y [b, s, heads x
        head_dim] (D's skip included), in the activations' dtype; ``seq_idx``: a packed row's sequences."""
        cp = self.cp
        batch, length = xbc.shape[:2]
        kernels = active_for(xbc)
        xbc = cp.conv(xbc, self.conv1d, seq_idx, kernels.conv)
        x, b, c = xbc.split([cp.inner, cp.groups * self.state, cp.groups * self.state], dim=-1)
        xh = x.reshape(batch, length, cp.heads, self.head_dim)
        a = -torch.exp(cp.per_head(self.A_log).float())
        b = b.reshape(batch, length, cp.groups, self.state)
        c = c.reshape(batch, length, cp.groups, self.state)
        dt_bias, d = cp.per_head(self.dt_bias), cp.per_head(self.D)
        y = mamba_scan(xh, dt, a, b, c, self.chunk, d, dt_bias, self.dt_min, kernels, seq_idx)
        return y.reshape(batch, length, -1).to(x.dtype)


class _Weight(torch.nn.Module):
    """Holds the gated norm's weight under Megatron's and Hugging Face's name (``mixer.norm.weight``)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))


# -- latent MoE -----------------------------------------------------------------------------------------
class ReplicatedLinear(torch.nn.Linear):
    """Transformer Engine's ``parallel_mode="duplicated"`` linear in torch: the whole weight on every
    TP rank, returning (out, None) as Megatron's linears do. Under sequence parallel each TP rank
    projects its own tokens, so its gradient is partial: marked ``sequence_parallel`` for the TP sum."""

    def __init__(self, n_in: int, n_out: int, config: Any) -> None:
        super().__init__(n_in, n_out, bias=False)
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return super().forward(x), None


class LatentMoELayer(MoELayer):
    """Megatron's MoELayer with its latent projections built here (module docstring). The parent is
    built without the latent width (its Transformer-Engine-only branch is skipped) and without experts;
    the experts are then built at the latent width, and the token dispatcher again with it."""

    def __init__(
        self,
        config: Any,
        submodules: Any = None,
        layer_number: Any = None,
        pg_collection: Any = None,
        **kw: Any,
    ) -> None:
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

        groups = pg_collection if pg_collection is not None else get_default_pg_collection()
        plain, placeholder = copy.copy(config), copy.copy(submodules)
        plain.moe_latent_size = None
        placeholder.experts = IdentityOp  # built once below, at the latent width (a whole layer's worth)
        super().__init__(plain, placeholder, layer_number, groups, **kw)
        self.config, self.submodules = config, submodules
        # the experts' spec in either megatron-core shape (0.19: a partial)
        self.experts = build(self.submodules.experts, self.num_local_experts, config, pg_collection=groups)
        dispatcher: Any = type(self.token_dispatcher)  # type: ignore[has-type]  # rebuilt at latent width
        self.token_dispatcher = dispatcher(
            self.num_local_experts, self.local_expert_indices, config=config, pg_collection=groups
        )
        self.fc1_latent_proj = ReplicatedLinear(config.hidden_size, config.moe_latent_size, config)
        self.fc2_latent_proj = ReplicatedLinear(config.moe_latent_size, config.hidden_size, config)


# -- the model --------------------------------------------------------------------------------------------
def _stack_class(base: type) -> type:
    """The version's hybrid stack with a torch final norm (the stock one is Transformer Engine's)."""
    from hpcrl.trainer.megatron.norms import SPNorm

    class Stack(base):
        def __init__(self, config: Any, *args: Any, post_layer_norm: bool = True, **kwargs: Any) -> None:
            super().__init__(config, *args, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm
            if post_layer_norm and self.post_process:
                self.final_norm = SPNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    Stack.__name__ = Stack.__qualname__ = f"Torch{base.__name__}"
    return Stack


def hybrid_model(
    config: Any,
    layers: dict[str, Any],
    *,
    pattern: str,
    vocab_size: int,
    max_sequence_length: int,
    pre_process: bool,
    post_process: bool,
    tied: bool,
) -> Any:
    """This pipeline stage of megatron-core's hybrid model for ``pattern`` (one of M * E - per layer),
    its layers built from ``layers`` (the stack submodules: mamba_layer, attention_layer, moe_layer,
    mlp_layer)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    common = dict(
        config=config,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="none",
    )
    try:  # megatron-core >= 0.19
        from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
        from megatron.core.models.hybrid.hybrid_model import HybridModel
    except ImportError:  # 0.16: the same model under its first names
        from megatron.core.models.mamba.mamba_model import MambaModel
        from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules

        spec = ModuleSpec(module=_stack_class(MambaStack), submodules=MambaStackSubmodules(**layers))
        return MambaModel(mamba_stack_spec=spec, hybrid_override_pattern=pattern, **common)
    spec = ModuleSpec(module=_stack_class(HybridStack), submodules=HybridStackSubmodules(**layers))
    return HybridModel(hybrid_stack_spec=spec, hybrid_layer_pattern=_stages(pattern, config), **common)


def _stages(pattern: str, config: Any) -> str:
    """0.19 reads pipeline stages from ``|`` in the pattern: equal stages, as 0.16 splits them."""
    pp = config.pipeline_model_parallel_size
    per = math.ceil(len(pattern) / pp)
    return "|".join(pattern[i : i + per] for i in range(0, len(pattern), per))
