"""``trainer.micro_batch_size: null``: the planner picks the micro-batch, the largest that fits.

Small micro-batches leave a GPU waiting on the host: each one is a round of kernel launches (every layer's
forward and backward), and below a few tens of thousands of tokens a small model's kernels finish before
the next are launched. On one H100 (bench/results/README.md, session 23: SmolLM2-135M's fsdp step, 512
sequences of ~240 tokens) 64 rows a micro-batch kept the GPU busy 59% of a 0.68 s step (24k kernels), 128
rows 86% of 0.47 s, 256 rows 96% of 0.37 s. So: the most rows of a data-parallel rank's minibatch (a power
of two) whose training peak the memory estimate fits, the phases of a shared GPU included.
"""

from __future__ import annotations

from hpcrl.config.schema import RunConfig
from hpcrl.plan.memory import estimate_memory
from hpcrl.plan.topology import Topology


def rows_per_rank(cfg: RunConfig, topo: Topology) -> int:
    """Rows of one minibatch on one data-parallel rank."""
    algo = cfg.algo
    return max(1, algo.samples_per_step // max(1, topo.train.dp * algo.num_minibatches))


def resolve_micro_batch(cfg: RunConfig, topo: Topology, *, recompute: bool) -> str:
    """Set ``trainer.micro_batch_size`` in place where it is None; the line ``hpcrl plan`` prints ("" when
    the config set it). Where not even one row fits, 1 (the plan's memory problems then say so)."""
    trainer = cfg.trainer
    if trainer.micro_batch_size is not None:
        return ""
    rows = rows_per_rank(cfg, topo)
    size = 1 << (rows.bit_length() - 1)  # the largest power of two up to the rank's rows
    while size > 1:
        trainer.micro_batch_size = size
        if estimate_memory(cfg, topo, recompute=recompute).fits:
            break
        size //= 2
    trainer.micro_batch_size = size
    return (
        f"trainer.micro_batch_size={size} (auto: the most of a rank's {rows} rows a step whose memory fits; "
        "larger micro-batches keep the GPU off the host's launches: 256 rows were 1.85x 64 at 135M, one H100, "
        "bench session 23)"
    )
