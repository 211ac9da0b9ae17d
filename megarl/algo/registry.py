"""Name → function registries for the choices users make by config name.

`algorithm.adv_estimator` → `get_adv_estimator`, `actor.policy_loss.loss_mode` →
`get_policy_loss`, `algorithm.kl_penalty` / `actor.kl_loss_type` → `get_kl_estimator`; an unknown
name raises a ValueError listing every valid name. Advantage estimators and policy losses declare
their inputs when registered; `Registry.call` passes exactly those and refuses a call that lacks
one, and config validation (`megarl.config.algo_inputs`) checks them against what the trainer
supplies before a run starts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Registry:
    """A small name → callable table with a decorator for registering."""

    def __init__(self, kind: str, config_key: str, declares_inputs: bool = True) -> None:
        self.kind = kind
        self.config_key = config_key
        self.declares_inputs = declares_inputs
        self._table: dict[str, Callable[..., Any]] = {}
        self._inputs: dict[str, tuple[str, ...]] = {}

    def register(self, *names: str, inputs: tuple[str, ...] | None = None) -> Callable[[F], F]:
        """Decorator registering a function under one or more names, with the keyword inputs
        it takes (required where the registry `declares_inputs`)."""
        if self.declares_inputs and inputs is None:
            raise ValueError(f"a {self.kind} declares its inputs: register(..., inputs=(...))")

        def decorator(fn: F) -> F:
            for name in names:
                if name in self._table and self._table[name] is not fn:
                    raise ValueError(f"{self.kind} {name!r} is already registered")
                self._table[name] = fn
                if inputs is not None:
                    self._inputs[name] = tuple(inputs)
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

    def inputs(self, name: str) -> tuple[str, ...]:
        """The keyword inputs the function registered as `name` declared."""
        self.get(name)  # an unknown name lists the valid ones
        return self._inputs[name]

    def call(self, name: str, supplied: Mapping[str, Any]) -> Any:
        """Call `name`'s function with the inputs it declared, taken from `supplied` (the
        others are not its inputs); ValueError naming any declared input `supplied` lacks."""
        fn, needs = self.get(name), self.inputs(name)
        missing = [key for key in needs if key not in supplied]
        if missing:
            raise ValueError(
                f"{self.kind} {name!r} ({self.config_key}) needs {', '.join(missing)}, "
                "which the caller did not supply"
            )
        return fn(**{key: supplied[key] for key in needs})


ADV_ESTIMATORS = Registry("advantage estimator", "algorithm.adv_estimator")
POLICY_LOSSES = Registry("policy loss", "actor_rollout_ref.actor.policy_loss")
KL_ESTIMATORS = Registry(
    "KL estimator", "algorithm.kl_penalty / actor.kl_loss_type", declares_inputs=False
)


def get_adv_estimator(name: str) -> Callable[..., Any]:
    """Advantage estimator by `algorithm.adv_estimator` name (gae, grpo, rloo, ...)."""
    return ADV_ESTIMATORS.get(name)


def get_policy_loss(name: str) -> Callable[..., Any]:
    """Policy loss by `actor.policy_loss.loss_mode` name (vanilla, gpg, gspo, cispo, ...)."""
    return POLICY_LOSSES.get(name)


def get_kl_estimator(name: str) -> Callable[..., Any]:
    """KL estimator by name (kl/k1, abs, mse/k2, low_var_kl/k3, full; "+" = k2 gradient)."""
    return KL_ESTIMATORS.get(name)
