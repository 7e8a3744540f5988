"""A named stand-in for ``trl``, on the path of veRL's run only (bench/device_runs/s22.sh's ``verl`` task).

veRL 0.9.1 imports ``AutoModelForCausalLMWithValueHead`` whenever a ``trl`` package is importable, to patch its
``state_dict`` (verl/models/transformers/monkey_patch.py), and only uses the class for critic/value-head models,
which GRPO does not build. TRL 1.16, staged for TRL's own row, no longer has that class, so veRL's FSDP engine
failed at import (session 21). This module shadows TRL in veRL's processes with the one name veRL touches.
"""


class AutoModelForCausalLMWithValueHead:
    """Never instantiated in a GRPO run: veRL only assigns ``state_dict`` on it."""
