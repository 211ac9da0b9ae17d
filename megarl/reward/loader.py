"""Which function scores a sample: the built-in router, or a user's function loaded by path.

``custom_reward_function.path`` takes what verl 0.9.1 takes: a Python file (``/abs/my_reward.py``,
``rel/my_reward.py`` or ``file://...``) or a module (``pkg://pkg.mod`` or plain ``pkg.mod``), so
a verl user's reward file works unchanged; ``reward_kwargs`` go to every call, as in verl.
:class:`ScorerSpec` is what a scoring worker receives (plain, picklable data): each worker loads
the function itself, by path and name.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["RewardFunctionError", "ScorerSpec", "load_scorer"]

BUILTIN = "megarl.reward.scorers.default_compute_score"
PATH_KEY = "custom_reward_function.path"


class RewardFunctionError(ValueError):
    """The configured reward function cannot be loaded (one line naming the key and value)."""


@dataclass(frozen=True)
class ScorerSpec:
    """A reward function by location: ``path`` None means the built-in router."""

    path: str | None = None
    """File or module of the function (``custom_reward_function.path``); None: built-in."""
    name: str = "compute_score"
    """Function name in that file or module (``custom_reward_function.name``)."""
    reward_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of every call (``custom_reward_function.reward_kwargs``; for the
    built-in router also ``reward.sandbox_fusion``'s, as verl hands them to it)."""
    manager: str = "naive"
    """How a worker calls the function and reads its result (``reward.reward_manager.name``):
    naive and dapo (verl's keywords; a dict's fields kept; dapo and gdpo add ``acc`` for a plain
    number), gdpo (also ``extra_info['experiment_name']``), prime (verl's positional call; a
    raise scores 0, a tuple's first entry is the score, no fields)."""
    experiment_name: str | None = None
    """``trainer.experiment_name``, which the gdpo manager puts into ``extra_info``."""
    manager_path: str | None = None
    """With ``manager`` importlib: the file or module of the user's manager class."""
    manager_class: str | None = None
    """With ``manager`` importlib: the class's name there."""
    tokenizer_path: str | None = None
    """With ``manager`` importlib: the tokenizer the class is given (the actor's)."""
    config: Mapping[str, Any] | None = None
    """With ``manager`` importlib: the resolved config the class is given (nested dicts)."""

    @classmethod
    def from_config(cls, fn_cfg: Any, run_cfg: Any = None) -> ScorerSpec:
        """From a ``CustomRewardFunctionConfig`` (or anything with path/name/reward_kwargs);
        with the whole ``run_cfg``, its reward manager too."""
        path = fn_cfg.path or None
        if path is not None and not Path(path).is_absolute() and _is_file_path(path):
            path = str(Path(path.removeprefix("file://")).expanduser().resolve())
        manager, experiment, user = "naive", None, {}
        if (
            run_cfg is not None
            and (run_cfg.reward.reward_manager.source or "register") == "register"
        ):
            manager = run_cfg.reward.reward_manager.name or "naive"
            experiment = run_cfg.trainer.experiment_name
        elif run_cfg is not None:  # importlib: a class of the user's (megarl.reward.user_manager)
            from megarl.config.loader import to_dict

            m, model = run_cfg.reward.reward_manager, run_cfg.actor_rollout_ref.model
            manager_path = m.module.path
            if (
                manager_path
                and not Path(manager_path).is_absolute()
                and _is_file_path(manager_path)
            ):
                manager_path = str(
                    Path(manager_path.removeprefix("file://")).expanduser().resolve()
                )
            manager = "importlib"
            user = {"manager_path": manager_path, "manager_class": m.name or m.module.name,
                    "tokenizer_path": model.tokenizer_path or model.path,
                    "config": to_dict(run_cfg)}  # fmt: skip
        kwargs = dict(fn_cfg.reward_kwargs or {})
        sandbox = run_cfg.reward.sandbox_fusion if run_cfg is not None else None
        if path is None and sandbox is not None and sandbox.url:  # verl: the built-in only
            kwargs.update(sandbox_fusion_url=sandbox.url, memory_limit_mb=sandbox.memory_limit_mb,
                          sandbox_fusion_max_concurrent=sandbox.max_concurrent)  # fmt: skip
        return cls(path, fn_cfg.name or "compute_score", kwargs, manager, experiment, **user)

    @property
    def label(self) -> str:
        """How error messages name the scorer."""
        if self.manager == "importlib":
            return f"{self.manager_class} from {self.manager_path} (reward.reward_manager)"
        if self.path is None:
            return "default_compute_score (built-in)"
        return f"{self.name} from {self.path} (custom_reward_function)"


def _is_file_path(path: str) -> bool:
    if path.startswith("pkg://"):
        return False
    return path.startswith("file://") or path.endswith(".py") or "/" in path


def _load_file(path: str, key: str = PATH_KEY) -> ModuleType:
    """The file as a module of its own name, ``megarl_reward_<stem>_<hash of its path>``,
    registered in ``sys.modules`` (so pickling and dataclasses inside it work); nothing is added
    to ``sys.path``, exactly as verl loads it. ``key`` names the config key in errors."""
    file = Path(path.removeprefix("file://")).expanduser().resolve()
    if not file.is_file():
        raise RewardFunctionError(f"{key}={path!r}: no such file")
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:10]
    name = f"megarl_reward_{''.join(c if c.isalnum() else '_' for c in file.stem)}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise RewardFunctionError(f"{key}={path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise RewardFunctionError(
            f"{key}={path!r} failed to load: {type(exc).__name__}: {exc}"
        ) from exc
    return module


def _load_module(dotted: str, key: str = PATH_KEY) -> ModuleType:
    try:
        return importlib.import_module(dotted)
    except ImportError as exc:
        raise RewardFunctionError(f"{key}={dotted!r} cannot be imported: {exc}") from exc


def load_object(path: str, name: str | None, key: str) -> Any:
    """``name`` from the file or module ``path`` (as ``custom_reward_function.path`` is read);
    ``key`` names the config key in errors."""
    if path.startswith("pkg://"):
        module = _load_module(path.removeprefix("pkg://").replace("/", "."), key)
    elif _is_file_path(path):
        module = _load_file(path, key)
    else:
        module = _load_module(path, key)
    found = getattr(module, name or "", None)
    if found is None:
        raise RewardFunctionError(f"{key}={path!r} has nothing named {name!r}")
    return found


def load_scorer(spec: ScorerSpec) -> Callable[..., Any]:
    """The function ``spec`` names, called as ``fn(data_source=, solution_str=, ground_truth=,
    extra_info=, **reward_kwargs)``."""
    if spec.path is None:
        from megarl.reward.scorers import default_compute_score

        return default_compute_score
    if spec.path.startswith("pkg://"):
        module = _load_module(spec.path.removeprefix("pkg://").replace("/", "."))
    elif _is_file_path(spec.path):
        module = _load_file(spec.path)
    else:
        module = _load_module(spec.path)
    fn = getattr(module, spec.name, None)
    if not callable(fn):
        raise RewardFunctionError(
            f"custom_reward_function.name={spec.name!r}: {spec.path!r} has no function of that name"
        )
    return fn
