"""Skip or defer third-party imports that cost every megarl process seconds and give it nothing,
and let Transformer Engine find CUDA 13's libraries where pip put them.

Every launch starts the launcher, torchrun and one process per rank, each importing Torch,
Megatron-Core and transformers. ``megarl/__init__.py`` calls :func:`install` (this module imports
nothing itself, so the CLI's fast paths stay torch-free); from then on a meta-path finder wraps
the ``exec_module`` of a few named modules: Megatron's JIT fuser without CUDA, scikit-learn under
transformers' assisted generation, SciPy under transformers' object-detection losses and vLLM's
audio helpers (until they are used), wandb under Megatron's inference engine and timers, and
``CUDA_PATH`` before Transformer Engine loads (see each wrapper). Nothing else about those
imports changes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

_JIT = "megatron.core.jit"
_CANDIDATES = "transformers.generation.candidate_generator"
_DETECTION_LOSSES = tuple(
    f"transformers.loss.loss_{name}"
    for name in ("for_object_detection", "deformable_detr", "grounding_dino", "lw_detr",
                 "rf_detr", "rt_detr")
)  # fmt: skip
"""transformers' losses that import SciPy's ``linear_sum_assignment`` at module level."""
_VLLM_AUDIO = "vllm.multimodal.audio"
_MEGATRON_WANDB = (
    "megatron.core.inference.contexts.dynamic_context",
    "megatron.core.inference.engines.dynamic_engine",
    "megatron.core.timers",
)


def _fuser_off_without_cuda(exec_module: Callable[[ModuleType], None], module: ModuleType) -> None:
    """``megatron.core.jit`` sets ``jit_fuser = torch.compile``, and decorating Megatron's fusion
    functions with it imports Inductor. Without CUDA none of them runs compiled (megarl turns
    every fusion off on the local spec), so the fuser becomes the identity
    (``disable_jit_fuser()``): a fused function that does run runs eagerly, the same arithmetic.
    With CUDA nothing changes."""
    exec_module(module)
    import torch

    if not torch.cuda.is_available():
        module.disable_jit_fuser()


def _without_sklearn(exec_module: Callable[[ModuleType], None], module: ModuleType) -> None:
    """``candidate_generator`` (imported by ``AutoTokenizer``) imports ``sklearn.metrics``, and
    SciPy with it, whenever scikit-learn is installed (the pinned MLflow requires it), only to
    tune *assisted* generation, which megarl never runs. While it executes
    ``is_sklearn_available`` answers False, so it skips the tuning as without scikit-learn;
    scikit-learn itself stays importable (a reward function may use it)."""
    _executed_unavailable("is_sklearn_available", exec_module, module)


def _executed_unavailable(check: str, exec_module, module: ModuleType) -> Callable[[], bool]:
    """Execute ``module`` while transformers' ``utils.<check>`` answers False; returns the real
    check."""
    import transformers.utils

    available = getattr(transformers.utils, check)
    setattr(transformers.utils, check, lambda: False)
    try:
        exec_module(module)
    finally:
        setattr(transformers.utils, check, available)
    return available


def _linear_sum_assignment(*args, **kwargs):
    """``scipy.optimize.linear_sum_assignment``, SciPy imported at the first call."""
    from scipy.optimize import linear_sum_assignment

    return linear_sum_assignment(*args, **kwargs)


def _scipy_when_called(exec_module: Callable[[ModuleType], None], module: ModuleType) -> None:
    """transformers' object-detection losses (imported by ``modeling_utils``, so by every
    model, vLLM's config included) import ``scipy.optimize`` (about a third of a CPU-second)
    whenever SciPy is installed (the pinned MLflow requires it), for a Hungarian matcher megarl
    never runs. While such a module executes ``is_scipy_available`` answers False; then, where
    SciPy is installed, its ``linear_sum_assignment`` is bound to a stand-in that imports
    SciPy's at the first call, so a matcher that does run gets SciPy's own."""
    if _executed_unavailable("is_scipy_available", exec_module, module)():
        module.linear_sum_assignment = _linear_sum_assignment


class _ScipySignal:
    """Stands for ``scipy.signal``: the module, imported at the first attribute read."""

    def __getattr__(self, name: str):
        import scipy.signal

        return getattr(scipy.signal, name)


def _scipy_signal_when_used(exec_module: Callable[[ModuleType], None], module: ModuleType) -> None:
    """vLLM's audio helpers (imported by ``vllm.sampling_params``, so by every engine) import
    ``scipy.signal`` (about a CPU-second with what it imports) for resampling audio, which
    megarl's text and image models never do. While the module executes ``import scipy.signal``
    raises ImportError (vLLM then binds a placeholder); where SciPy is installed the module's
    ``scipy_signal`` is then bound to :class:`_ScipySignal`, so resampling that does run gets
    SciPy's own. When ``scipy.signal`` is already imported, nothing changes."""
    if "scipy.signal" in sys.modules:
        exec_module(module)
        return
    sys.modules["scipy.signal"] = None  # type: ignore[assignment] -- "not importable"
    try:
        exec_module(module)
    finally:
        if sys.modules.get("scipy.signal", 0) is None:
            del sys.modules["scipy.signal"]
    if importlib.util.find_spec("scipy") is not None:
        module.scipy_signal = _ScipySignal()


def _without_wandb(exec_module: Callable[[ModuleType], None], module: ModuleType) -> None:
    """Megatron's inference context, engine and timers ``import wandb`` when installed, for
    logging megarl never turns on; wandb also makes two temporary directories that only a
    normal interpreter exit removes (a rank ended by ``os._exit`` or a signal left them in
    ``/tmp``). While those modules execute ``import wandb`` raises ImportError, so they bind
    ``wandb = None``. When wandb is already imported (megarl's own sink), nothing changes."""
    if "wandb" in sys.modules:
        exec_module(module)
        return
    sys.modules["wandb"] = None  # type: ignore[assignment] -- the documented "not importable"
    try:
        exec_module(module)
    finally:
        if sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]


def _cuda_path_for_te(exec_module: Callable[[ModuleType], None], module: ModuleType) -> None:
    """Transformer Engine 2.9 loads ``libnvrtc`` and ``libcublas`` from ``$CUDA_PATH``, else
    from where CUDA 12's pip wheels put them (``nvidia/<lib>/lib``), not from CUDA 13's
    ``nvidia/cu13/lib``: on a node with the driver only (no toolkit) ``import megatron.core``
    then fails. When ``CUDA_PATH`` is unset and a ``nvidia/cu13/lib`` folder is on
    ``sys.path``, ``CUDA_PATH`` points at it (docs/install.md); a ``CUDA_PATH`` set is kept."""
    if not os.environ.get("CUDA_PATH"):
        for entry in sys.path:
            wheels = Path(entry or ".") / "nvidia" / "cu13"
            if (wheels / "lib").is_dir():
                os.environ["CUDA_PATH"] = str(wheels)
                break
    exec_module(module)


_AROUND: dict[str, Callable[[Callable[[ModuleType], None], ModuleType], None]] = {
    _JIT: _fuser_off_without_cuda,
    _CANDIDATES: _without_sklearn,
    **dict.fromkeys(_DETECTION_LOSSES, _scipy_when_called),
    _VLLM_AUDIO: _scipy_signal_when_used,
    **dict.fromkeys(_MEGATRON_WANDB, _without_wandb),
    "transformer_engine": _cuda_path_for_te,
}
"""module name -> how to run its ``exec_module``."""


class _Hook(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the modules of ``_AROUND`` as the path finder does and runs their loaders through
    ``_AROUND``'s wrappers."""

    def __init__(self) -> None:
        self._loaders: dict[str, importlib.abc.Loader] = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in _AROUND:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        self._loaders[fullname] = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loaders[spec.name].create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        name = module.__spec__.name
        _AROUND[name](self._loaders[name].exec_module, module)


def install() -> None:
    """Add the hook once (modules already imported are left as they are)."""
    if not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())
