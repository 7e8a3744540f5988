"""AdamW with its state sharded as Megatron's distributed optimizer shards it (ZeRO-1).

Dense weights are identical on every data-parallel and context-parallel rank (their gradients are
averaged over DP x CP before the step), so their Adam state is split over that group; an expert is
identical on the ranks of its expert-data-parallel group, so its state is split over that one. Each
rank updates its part and broadcasts it (torch's ZeroRedundancyOptimizer). A group of one rank keeps
a plain AdamW. The memory estimate (hpcrl/memory.py) counts the state the same way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class ShardedAdamW:
    def __init__(self, parts: list[tuple[list[torch.Tensor], Any]], **adam: Any) -> None:
        """``parts``: (parameters, process group to shard their state over, or None) pairs."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.parts: list[Any] = []
        for params, group in parts:
            if not params:
                continue
            opt: Any
            if group is not None and dist.get_world_size(group) > 1:
                opt = ZeroRedundancyOptimizer(
                    params, optimizer_class=torch.optim.AdamW, process_group=group, **adam
                )
            else:
                opt = torch.optim.AdamW(params, **adam)
            self.parts.append(opt)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for opt in self.parts:
            opt.step()

    def local(self) -> list[Any]:
        """The optimizers holding this rank's state (its shards)."""
        return [getattr(opt, "optim", opt) for opt in self.parts]

    @property
    def state(self) -> dict[Any, Any]:
        """This rank's Adam state, every part together (parameter -> its state)."""
        return {p: st for opt in self.local() for p, st in opt.state.items()}
