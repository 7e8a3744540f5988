"""The Megatron model-family table: catalog family (``model.family``) -> the class that builds it.

Adding a family:
1. a module in this package with a ``GPTFamily`` subclass (families/base.py) that sets
   ``model_types`` and overrides only the hooks where the decoder departs from the plain GPT (the
   shared pieces it needs come from the family-free modules one floor down: norms, attention,
   spec_utils, experts, gemma, weights; never from another family);
2. its entry in ``FAMILIES`` below (this is the only module that imports a family module);
3. its name in ``trainer.config.MEGATRON_FAMILIES`` (and its ``model_type`` in ``megatron_family``
   where the two differ): the torch-free list the planner reads.
tests/megatron/test_megatron_families.py keeps the three agreeing.
"""

from __future__ import annotations

from hpcrl.trainer.megatron.families.base import GPTFamily
from hpcrl.trainer.megatron.families.gemma3 import Gemma3
from hpcrl.trainer.megatron.families.gemma4 import Gemma4
from hpcrl.trainer.megatron.families.nemotron_h import NemotronH
from hpcrl.trainer.megatron.families.qwen import Llama, Qwen2, Qwen3
from hpcrl.trainer.megatron.families.qwen3_moe import Qwen3MoE

FAMILIES: dict[str, type[GPTFamily]] = {
    "qwen2": Qwen2,
    "qwen3": Qwen3,
    "llama": Llama,
    "qwen3_moe": Qwen3MoE,
    "gemma3": Gemma3,
    "gemma4": Gemma4,
    "nemotron_h": NemotronH,
}
