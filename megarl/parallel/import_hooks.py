"""Three third-party imports that cost every megarl process seconds and give it nothing.

Every launch starts the launcher, torchrun and one process per rank, and each imports Torch,
Megatron-Core and transformers before doing anything; on two cores a tiny run spent more time
importing than training. Three of those imports are pure waste for megarl, and this module skips
them, at import time, in every process that imports megarl first (``megarl/__init__.py`` calls
:func:`install`; it imports nothing itself, so the CLI's fast paths stay torch-free):

* **Megatron's JIT fuser without CUDA.** ``megatron.core.jit`` sets ``jit_fuser =
  torch.compile`` and Megatron's fusion modules decorate functions with it when imported;
  ``torch.compile`` then imports Inductor (~2.5 s a process, ~3.6 s each when two ranks start
  on two cores). Without CUDA none of those functions runs compiled (megarl turns every fusion
  off on the local, non-TE spec: :mod:`megarl.models.gpt`), so the moment ``megatron.core.jit``
  has loaded, its documented ``disable_jit_fuser()`` makes the fuser the identity; a fused
  function that does run then runs eagerly, the same arithmetic. With CUDA nothing changes.
* **scikit-learn under transformers' generation utilities.** ``AutoTokenizer`` imports
  ``transformers.generation``, whose ``candidate_generator`` imports ``sklearn.metrics`` (and with
  it SciPy's stats and optimisers, ~3 s a process) whenever scikit-learn is installed, which the
  pinned MLflow requires. It is used for one thing: tuning the confidence threshold of
  *assisted* generation (a draft model), which megarl never runs. While that one module
  executes, transformers' ``is_sklearn_available`` answers False, so the module binds that answer
  and skips the tuning as it does where scikit-learn is absent; scikit-learn itself stays
  importable (a reward function may use it).
* **wandb under Megatron's inference engine and timers.** Megatron's model code imports
  ``megatron.core.inference``, whose dynamic context and engine (and ``megatron.core.timers``)
  ``import wandb`` when it is installed, for their own metric logging, which megarl never turns
  on. The import costs ~0.8 s a process, and wandb creates two temporary directories
  (``tmp*wandb-media``, ``tmp*wandb-artifacts``) that only a normal interpreter exit removes: a
  rank ended by ``os._exit`` or a signal left them in ``/tmp`` on every run. While those modules
  execute, ``import wandb`` raises ImportError (``sys.modules["wandb"] = None``), so they bind
  ``wandb = None`` as where it is not installed. When wandb is already imported (megarl's own
  wandb sink), nothing changes.

Each hook is a meta-path finder for one module name that defers to the normal path finder and
wraps only the loader's ``exec_module``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType

_JIT = "megatron.core.jit"
_CANDIDATES = "transformers.generation.candidate_generator"
_MEGATRON_WANDB = (
    "megatron.core.inference.contexts.dynamic_context",
    "megatron.core.inference.engines.dynamic_engine",
    "megatron.core.timers",
)


def _fuser_off_without_cuda(exec_module: Callable[[ModuleType], None], module: ModuleType) -> None:
    exec_module(module)
    import torch

    if not torch.cuda.is_available():
        module.disable_jit_fuser()


def _without_sklearn(exec_module: Callable[[ModuleType], None], module: ModuleType) -> None:
    import transformers.utils

    available = transformers.utils.is_sklearn_available
    transformers.utils.is_sklearn_available = lambda: False
    try:
        exec_module(module)
    finally:
        transformers.utils.is_sklearn_available = available


def _without_wandb(exec_module: Callable[[ModuleType], None], module: ModuleType) -> None:
    if "wandb" in sys.modules:
        exec_module(module)
        return
    sys.modules["wandb"] = None  # type: ignore[assignment] -- the documented "not importable"
    try:
        exec_module(module)
    finally:
        if sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]


_AROUND: dict[str, Callable[[Callable[[ModuleType], None], ModuleType], None]] = {
    _JIT: _fuser_off_without_cuda,
    _CANDIDATES: _without_sklearn,
    **dict.fromkeys(_MEGATRON_WANDB, _without_wandb),
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
