"""Megatron-core layer specs of both shapes (0.16's ``ModuleSpec``, 0.19's ``functools.partial``):
read a spec's submodules, swap the module it builds, build it; and whether Transformer Engine is
installed (its spec or the local one). Family-free: the families and spec.py import these."""

from __future__ import annotations

import functools
from typing import Any


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def submodules_of(spec: Any) -> Any:
    """A module spec's submodules: megatron-core 0.16 holds specs as ``ModuleSpec``, 0.19 as
    ``functools.partial(Module, submodules=...)`` (None when it has none)."""
    return spec.submodules if hasattr(spec, "submodules") else spec.keywords.get("submodules")


def build(spec: Any, *args: Any, **kwargs: Any) -> Any:
    """The module a spec of either shape describes: a 0.16 ``ModuleSpec`` through Megatron's
    ``build_module``, a 0.19 ``functools.partial`` called (0.19's build_module cannot take one)."""
    if isinstance(spec, functools.partial):
        return spec(*args, **kwargs)
    from megatron.core.transformer.spec_utils import build_module

    return build_module(spec, *args, **kwargs)


def with_module(spec: Any, module: type) -> Any:
    """The same spec (either shape) building ``module`` instead: a ModuleSpec changed in place, a
    partial rebuilt with the same arguments."""
    if isinstance(spec, functools.partial):
        return functools.partial(module, *spec.args, **spec.keywords)
    spec.module = module
    return spec
