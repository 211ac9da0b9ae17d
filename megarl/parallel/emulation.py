"""CPU emulation of the few CUDA calls Megatron-Core makes unconditionally.

Megatron-Core assumes a GPU in a handful of places even when told to initialise on CPU (CUDA RNG
state, ``device="cuda"`` factories, ``.cuda()``, a ``torch.cuda.FloatTensor`` assert in
``clip_grads``, streams, ``synchronize``, ``nvtx``). This module makes those calls land on the
CPU and changes nothing else (no numerics, no control flow of megarl's code), so the GPU path
runs the same code with the real calls; :func:`megarl.parallel.init.init_distributed` switches it
on when CUDA is absent. On CPU the "cuda" and CPU random streams are one stream: code that needs
independent streams must use explicit generators.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, Self

import torch
from torch.overrides import TorchFunctionMode

_ACTIVE_MODE: _CudaToCpuMode | None = None
_PATCHED: dict[tuple[Any, str], Any] = {}
"""(owner, name) -> the value before the emulation patched it."""
_OURS: dict[tuple[Any, str], Any] = {}
"""(owner, name) -> the emulation's value (:func:`reassert_cpu_emulation`)."""


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


def _cpu_if_cuda(device: Any) -> Any:
    return torch.device("cpu") if _is_cuda(device) else device


class _CudaToCpuMode(TorchFunctionMode):
    """Routes CUDA placements to the CPU; everything else passes through untouched.

    ``device="cuda"`` (any form) in factory and ``.to`` calls becomes the CPU, ``Tensor.cuda()``
    a no-op, ``Tensor.pin_memory()`` a plain host copy (Megatron's parameter offload keeps one),
    and the argument-less ``Tensor.type()`` reports ``torch.cuda.*`` names (``clip_grads``).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:  # page-locked memory needs CUDA: a plain host copy
            return args[0].clone()
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if func is torch.Tensor.to and args:
            args = tuple(_cpu_if_cuda(a) for a in args)
        return func(*args, **kwargs)


def _cpu_get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.default_generator.get_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.default_generator.set_state(new_state)


def _megatron_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    return torch.default_generator.get_state()


def _cpu_manual_seed(seed: int) -> None:
    # Not torch.manual_seed: it calls torch.cuda.manual_seed_all, which is patched to this.
    torch.default_generator.manual_seed(seed)


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


class _CpuEvent:
    """A CUDA event on the in-order CPU: always complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _CpuStream:
    """The one CPU "stream": every stream is this one (so no tensor is ever on a side stream).

    The MoE ``alltoall`` dispatcher makes a side stream for its device-to-host copies, and
    shared-expert overlap another; the CPU runs everything in order, so waits are no-ops.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        global _CPU_STREAM
        if _CPU_STREAM is None:
            _CPU_STREAM = super().__new__(cls)
        return _CPU_STREAM

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _CpuEvent:
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


_CPU_STREAM: _CpuStream | None = None


def _fresh(fn: Callable) -> Callable:
    """A distinct function object with ``fn``'s behaviour."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


def _patch(owner: Any, name: str, value: Any) -> None:
    key = (owner, name)
    if key not in _PATCHED:
        _PATCHED[key] = getattr(owner, name, None)
    _OURS[key] = value
    setattr(owner, name, value)


def reassert_cpu_emulation() -> None:
    """Put the emulation's stand-ins back where a library sharing the process replaced them
    (no-op when the emulation is off).

    vLLM's CPU worker installs its own ``torch.cuda.Stream`` / ``Event`` / ``current_stream``
    placeholders for the whole process when the engine starts; their ``record_event`` returns
    None, and Megatron's ``alltoall`` MoE dispatcher then fails on ``None.synchronize()`` in the
    next training forward. The emulation's stand-ins do everything vLLM's do.
    """
    if _ACTIVE_MODE is None:
        return
    for (owner, name), value in _OURS.items():
        setattr(owner, name, value)


@contextlib.contextmanager
def device_routing_suspended():
    """The emulation's device routing (:class:`_CudaToCpuMode`) off inside the block, for code
    that never names CUDA: vLLM's CPU engine. Every torch call in the process otherwise passes
    through the mode's Python ``__torch_function__``. The patched ``torch.cuda`` names stay. A
    no-op when the emulation is off or another mode was entered after it (it stays as it is)."""
    mode = _ACTIVE_MODE
    if mode is None or torch.overrides._get_current_function_mode() is not mode:
        yield
        return
    mode.__exit__(None, None, None)
    try:
        yield
    finally:
        mode.__enter__()


def emulation_active() -> bool:
    """True while the CPU emulation layer is on in this process."""
    return _ACTIVE_MODE is not None


def enable_cpu_emulation() -> None:
    """Switch the emulation on for the rest of the process (idempotent).

    Call before building Megatron models. Refuses to run on a machine with CUDA, where the real
    calls must be used.
    """
    global _ACTIVE_MODE
    if _ACTIVE_MODE is not None:
        return
    if torch.cuda.is_available():
        raise RuntimeError("CPU emulation requested on a machine with CUDA; use the GPU path")
    cuda = torch.cuda
    # Each patched name gets its own function object: torch._dynamo's trace rules assert that
    # one object is not registered under two names with different rules.
    _patch(cuda, "current_device", _fresh(lambda: "cpu"))
    for name in ("synchronize", "empty_cache", "set_device"):
        _patch(cuda, name, _fresh(_noop))
    for owner in (cuda, cuda.random):
        _patch(owner, "get_rng_state", _fresh(_cpu_get_rng_state))
        _patch(owner, "set_rng_state", _fresh(_cpu_set_rng_state))
        _patch(owner, "manual_seed", _fresh(_cpu_manual_seed))
        _patch(owner, "manual_seed_all", _fresh(_cpu_manual_seed))
    _patch(cuda, "Stream", _CpuStream)
    _patch(cuda, "Event", _CpuEvent)
    _patch(cuda, "current_stream", _fresh(lambda device=None: _CpuStream()))
    _patch(cuda, "default_stream", _fresh(lambda device=None: _CpuStream()))
    _patch(cuda, "stream", _fresh(lambda stream=None: contextlib.nullcontext()))
    _patch(cuda.nvtx, "range_push", _fresh(_noop))
    _patch(cuda.nvtx, "range_pop", _fresh(_noop))
    _patch(cuda.nvtx, "range", _fresh(lambda *a, **k: contextlib.nullcontext()))
    _patch_megatron_rng()
    _patch_megatron_moe()
    _ACTIVE_MODE = _CudaToCpuMode()
    _ACTIVE_MODE.__enter__()


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    _patch(mrandom, "_get_cuda_rng_state", _megatron_get_rng_state)
    _patch(mrandom, "_set_cuda_rng_state", _cpu_set_rng_state)


def _cpu_tensor_as_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """``moe_utils.maybe_move_tensor_to_cpu`` for tensors already on the CPU.

    Megatron turns the alltoall dispatcher's split sizes into numpy arrays only when they are on
    the GPU, and ``all_to_all_single`` refuses the CPU tensors left otherwise.
    """
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _patch_megatron_moe() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    _patch(token_dispatcher, "maybe_move_tensor_to_cpu", _cpu_tensor_as_host)
    _patch(torch.distributed, "all_gather", _fresh(_all_gather_uneven))


def _all_gather_uneven(tensor_list, tensor, group=None, async_op=False):
    """``torch.distributed.all_gather`` that also takes outputs of unequal first dimension, as
    NCCL's does: gloo's refuses them ("invalid tensor size"). Megatron's ``alltoall`` MoE
    dispatcher gathers each expert-TP rank's tokens so (``output_split_sizes``) when
    ``expert_tensor_parallel_size`` > 1. Unequal: every rank sends its tensor padded to the
    longest, and each output keeps its own rows (the same values NCCL's gather gives)."""
    original = _PATCHED[(torch.distributed, "all_gather")]
    if all(t.shape == tensor.shape for t in tensor_list):
        return original(tensor_list, tensor, group=group, async_op=async_op)
    padded = tensor.new_zeros((max(t.shape[0] for t in tensor_list), *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    received = [torch.empty_like(padded) for _ in tensor_list]
    original(received, padded, group=group)
    for out, got in zip(tensor_list, received, strict=True):
        out.copy_(got[: out.shape[0]])
    return _DoneWork() if async_op else None


class _DoneWork:
    """The work handle of a collective that already finished (an emulated one)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def disable_cpu_emulation() -> None:
    """Undo :func:`enable_cpu_emulation` (used by tests that need a clean process state)."""
    global _ACTIVE_MODE
    if _ACTIVE_MODE is None:
        return
    _ACTIVE_MODE.__exit__(None, None, None)
    _ACTIVE_MODE = None
    for (owner, name), value in reversed(list(_PATCHED.items())):
        setattr(owner, name, value)
    _PATCHED.clear()
    _OURS.clear()


def cpu_emulated(fn: Callable) -> Callable:
    """Decorator: run ``fn`` with the emulation on when CUDA is absent."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.cuda.is_available():
            enable_cpu_emulation()
        return fn(*args, **kwargs)

    return wrapper
