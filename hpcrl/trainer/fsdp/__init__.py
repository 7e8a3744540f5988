"""FSDP2 training backend: parameters, gradients and optimizer state sharded with ``fully_shard``
over the training ranks (NCCL on GPUs, gloo on CPU).

The step itself (minibatches, micro-batches, the loss) is trainer/step.py's; this backend supplies
its forward (the Hugging Face model's, through the chunked log-prob head where installed) and its
optimizer step (the gradient norm clipped over the sharded gradients, then AdamW).

The model is built on the meta device and sharded before it has storage; each rank then reads only
its rows of every checkpoint tensor (trainer/hf_load.py), so no rank ever holds the whole model.

``trainer.cp`` > 1 splits each sequence over consecutive ranks (trainer/context_parallel.py): FSDP
still shards over every rank; the ranks of a CP group train the same rows (``data_rank``).
``trainer.activation_checkpointing`` recomputes each decoder layer in the backward.

MoE models take the quirks' settings: ``trainer.router_dtype=fp32`` makes each router an fp32 unit
under bf16 compute; no load-balancing loss is ever added (``trainer.moe_aux_loss_coeff`` is 0 by the
quirk); buffers ``trainer.freeze`` names (Nemotron-H's correction bias) stay out of refits.
``trainer.ep`` > 1 splits each MoE layer's experts over expert-parallel ranks and sends tokens to them
by all-to-all (expert_parallel.py).

trainer.py   FSDPTrainer: the step's backend (trainer/step.py), weights to the engines, checkpoints
model.py     the model before and under FSDP2 (fully_shard per decoder layer, routers in fp32)
expert_parallel.py   experts split over trainer.ep ranks, the all-to-all token dispatch
optim.py             the optimizers on the shards and where their state lives (``trainer.optimizer*``)
segments.py          packed rows through Nemotron-H's Mamba layers (each sequence's conv and scan alone)
The process group is set up as megatron's is (trainer/process_group.py).
"""

from hpcrl.trainer.fsdp.model import apply_fsdp, checkpoint_names, position_dependent_rope, routers
from hpcrl.trainer.fsdp.trainer import FSDPTrainer

__all__ = [
    "FSDPTrainer",
    "apply_fsdp",
    "checkpoint_names",
    "position_dependent_rope",
    "routers",
]
