"""Megatron-core on a CPU-only host: the one place that deals with its hard CUDA calls.

Megatron-core allocates buffers with ``device=torch.cuda.current_device()`` or ``device="cuda"``
(pinned, for the context-parallel rotary slice), seeds and forks the CUDA RNG, and synchronises
streams (the MoE dispatcher copies on a side stream) — all over its modules. On a host without CUDA
(our CPU tests with gloo) every ``megatron.core`` module's ``torch`` is swapped for a proxy that is
the real ``torch`` except that CUDA devices mean the CPU (and nothing is pinned), CUDA RNG calls use
the CPU generator, stream/cache calls do nothing, and the list collectives gloo lacks for uneven
sizes (MoE with expert tensor parallel) are padded. On GPUs nothing is patched, except one name Megatron-core leaves
undefined without Transformer Engine (``_define_missing_te_names``).
"""

from __future__ import annotations

import contextlib
import sys
import types
from importlib.metadata import version
from typing import Any

import torch

SUPPORTED = ("0.16", "0.17", "0.18", "0.19")
"""megatron-core minor versions this backend is tested with: 0.16.1 on CPU (Python 3.11), 0.19.2 on GPU."""


def check_version() -> str:
    found = version("megatron-core")
    if not found.startswith(SUPPORTED):
        raise RuntimeError(
            f"megatron-core {found} is not supported by hpcrl's megatron backend (tested: "
            f"{', '.join(v + '.x' for v in SUPPORTED)}); install megatron-core==0.19.2 (or 0.16.1 on Python 3.11)"
        )
    return found


def _cpu(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int) or str(device).startswith("cuda"):
        return torch.device("cpu")
    return device


class _NoEvent:
    """A CUDA event where everything is synchronous already."""

    def synchronize(self) -> None:
        return None


class _NoStream(_NoEvent):
    """A CUDA stream on the CPU: work is ordered already (the MoE dispatcher's device-to-host copies)."""

    def wait_stream(self, *args: Any) -> None:
        return None

    def record_event(self, *args: Any) -> _NoEvent:
        return _NoEvent()


_DEFAULT_STREAM = _NoStream()


class _CpuCuda:
    """``torch.cuda`` as Megatron-core uses it, on the CPU."""

    def Stream(self, *args: Any, **kwargs: Any) -> _NoStream:  # torch.cuda's name
        return _NoStream()

    def current_stream(self, *args: Any) -> _NoStream:
        return _DEFAULT_STREAM

    def stream(self, *args: Any) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    def current_device(self) -> str:
        return "cpu"

    def synchronize(self, *args: Any, **kwargs: Any) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def get_rng_state(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        torch.set_rng_state(state)

    @property
    def random(self) -> _CpuCuda:
        return self  # ``torch.cuda.random.get_rng_state``: the same CPU-generator calls

    @property
    def default_generators(self) -> tuple[torch.Generator, ...]:
        return (torch.default_generator,)

    def is_available(self) -> bool:
        return False

    def device_count(self) -> int:
        return 0


_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "arange",
    "rand",
    "randn",
    "empty_like",
    "zeros_like",
)


class _GlooDistributed(types.ModuleType):
    """``torch.distributed``, except the two list collectives with uneven sizes that gloo refuses and
    NCCL does: the MoE dispatcher's gather of each expert-TP rank's routed tokens (``all_gather`` into
    uneven splits) and its backward (``reduce_scatter`` of uneven splits). Padded to the largest
    split, run as collectives gloo has, trimmed."""

    def __init__(self) -> None:
        super().__init__("torch.distributed")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)

    @staticmethod
    def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if t.shape[0] < rows else t

    def all_gather(
        self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> Any:
        sizes = [t.shape[0] for t in tensor_list]
        if async_op or len(set([*sizes, tensor.shape[0]])) == 1:
            return torch.distributed.all_gather(tensor_list, tensor, group=group, async_op=async_op)
        rows = max([*sizes, tensor.shape[0]])
        parts = [tensor.new_empty(rows, *tensor.shape[1:]) for _ in tensor_list]
        torch.distributed.all_gather(parts, self._padded(tensor.contiguous(), rows), group=group)
        for out, part, n in zip(tensor_list, parts, sizes, strict=True):
            out.copy_(part[:n])
        return None

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: Any = None,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        if async_op:
            return torch.distributed.reduce_scatter(output, input_list, group=group, async_op=True)
        rows = max(t.shape[0] for t in input_list)
        stacked = torch.stack([self._padded(t.contiguous(), rows) for t in input_list])
        torch.distributed.all_reduce(stacked, op=op or torch.distributed.ReduceOp.SUM, group=group)
        output.copy_(stacked[torch.distributed.get_rank(group)][: output.shape[0]])
        return None


class _CpuTorch(types.ModuleType):
    """The real ``torch`` module, except that "cuda" means the CPU (and gloo's gaps in
    ``torch.distributed`` are filled: ``_GlooDistributed``)."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        self.distributed = _GlooDistributed()
        for name in _FACTORIES:
            setattr(self, name, self._on_cpu(getattr(torch, name)))

    @staticmethod
    def _on_cpu(factory: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs:
                kwargs["device"] = _cpu(kwargs["device"])
            kwargs.pop("pin_memory", None)  # no pinned-memory allocator without an accelerator
            return factory(*args, **kwargs)

        return call

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_PROXY: _CpuTorch | None = None


def _cpu_tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``tensor.cuda()`` (Megatron's tied-embedding set-up, data helpers) on a host that has no CUDA,
    where it could only raise: the tensor stays where it is."""
    return self


def _define_missing_te_names() -> None:
    """On every device: megatron-core's MoE router tests ``te_general_gemm is not None`` but binds
    the name only when Transformer Engine imports, so without TE every MoE forward raised NameError."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def prepare(device: str) -> None:
    """Import what the backend uses, then (CPU only) point every ``megatron.core`` module at the proxy.

    Idempotent; call before building any Megatron object."""
    global _PROXY
    check_version()
    import megatron.core.models.gpt
    import megatron.core.pipeline_parallel
    import megatron.core.tensor_parallel  # noqa: F401

    _define_missing_te_names()
    if device != "cpu" or torch.cuda.is_available():
        return
    if _PROXY is None:
        _PROXY = _CpuTorch()
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = _PROXY  # type: ignore[attr-defined]
    torch.Tensor.cuda = _cpu_tensor_cuda  # type: ignore[method-assign,assignment]
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _to_host  # bound by name there


def _to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """Megatron's ``maybe_move_tensor_to_cpu`` converts only CUDA tensors (to NumPy when asked): with
    CPU tensors the MoE all-to-all got tensors for its split sizes, which torch.distributed refuses."""
    from megatron.core.transformer.moe import moe_utils

    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return moe_utils.maybe_move_tensor_to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)
