"""Name → function registries for the choices users make by config name.

`algorithm.adv_estimator` → `get_adv_estimator`, `actor.policy_loss` → `get_policy_loss`,
`algorithm.kl_penalty` / `actor.kl_loss_type` → `get_kl_estimator`. An unknown name raises a
ValueError that lists every valid name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Registry:
    """A small name → callable table with a decorator for registering."""

    def __init__(self, kind: str, config_key: str) -> None:
        self.kind = kind
        self.config_key = config_key
        self._table: dict[str, Callable[..., Any]] = {}
        self._parameters: frozenset[str] | None = None  # cache of `parameters()`

    def register(self, *names: str) -> Callable[[F], F]:
        """Decorator registering a function under one or more names."""

        def decorator(fn: F) -> F:
            for name in names:
                if name in self._table and self._table[name] is not fn:
                    raise ValueError(f"{self.kind} {name!r} is already registered")
                self._table[name] = fn
            self._parameters = None
            return fn

        return decorator

    def get(self, name: str) -> Callable[..., Any]:
        """The function registered as `name`; ValueError listing the valid names otherwise."""
        try:
            return self._table[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"unknown {self.kind} {name!r} ({self.config_key}); valid names: "
                + ", ".join(sorted(self._table))
            ) from None

    def names(self) -> list[str]:
        """All registered names, sorted."""
        return sorted(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def holds(self, fn: Callable[..., Any]) -> bool:
        """Whether `fn` is registered here (under any name)."""
        return any(registered is fn for registered in self._table.values())

    def parameters(self) -> frozenset[str]:
        """The union of the keyword parameters of every registered function."""
        if self._parameters is None:
            self._parameters = frozenset(
                name for fn in self._table.values() for name in _keyword_parameters(fn)
            )
        return self._parameters


ADV_ESTIMATORS = Registry("advantage estimator", "algorithm.adv_estimator")
POLICY_LOSSES = Registry("policy loss", "actor_rollout_ref.actor.policy_loss")
KL_ESTIMATORS = Registry("KL estimator", "algorithm.kl_penalty / actor.kl_loss_type")


def get_adv_estimator(name: str) -> Callable[..., Any]:
    """Advantage estimator by `algorithm.adv_estimator` name (gae, grpo, rloo, ...)."""
    return ADV_ESTIMATORS.get(name)


def get_policy_loss(name: str) -> Callable[..., Any]:
    """Policy loss by `actor.policy_loss.loss_mode` name (vanilla, gpg, gspo, cispo, ...)."""
    return POLICY_LOSSES.get(name)


def get_kl_estimator(name: str) -> Callable[..., Any]:
    """KL estimator by name (kl/k1, abs, mse/k2, low_var_kl/k3, full; "+" = k2 gradient)."""
    return KL_ESTIMATORS.get(name)


def _keyword_parameters(fn: Callable[..., Any]) -> list[str]:
    return [
        name
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]


def call_with_supported_kwargs(fn: Callable[..., Any], **kwargs: Any) -> Any:
    """Call `fn` with the keyword arguments it declares, dropping the others.

    Lets the trainer pass one set of inputs (values, index, gamma, ...) to whichever estimator or
    loss the config names: a name that some function of the same registry declares and `fn` does
    not is dropped. A name that no function of `fn`'s registries declares (for a function in no
    registry: that `fn` does not declare) is a mistake, e.g. a misspelt input, and raises
    ValueError naming it. A required parameter that is missing still raises TypeError.
    """
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    known = set(_keyword_parameters(fn))
    for registry in (ADV_ESTIMATORS, POLICY_LOSSES, KL_ESTIMATORS):
        if registry.holds(fn):
            known |= registry.parameters()
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(
            f"{getattr(fn, '__name__', fn)!s} got unknown input(s) {', '.join(unknown)}: no "
            "registered function of its kind takes them"
        )
    return fn(**{k: v for k, v in kwargs.items() if k in params})
