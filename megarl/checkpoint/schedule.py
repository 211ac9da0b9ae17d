"""Which learning-rate schedule a resumed run follows, and a warning naming what changed.

Megatron's ``OptimizerParamScheduler`` silently takes lr, warm-up and decay from the checkpoint
by default; megarl builds it with that switched off and decides here, per model, with verl's
``<role>.optim.use_checkpoint_opt_param_scheduler`` (default false: the config wins). The
optimizer hyperparameters that Megatron's optimizer load takes from the checkpoint's parameter
groups (Adam betas) follow the same policy. Every setting that differs between checkpoint and
config is named in one warning, with both values and the one in force.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SCHEDULE_KEYS: dict[str, str] = {
    "max_lr": "optim.lr",
    "min_lr": "optim.min_lr",
    "lr_warmup_steps": "optim.lr_warmup_steps",
    "lr_decay_steps": "trainer.total_training_steps",
    "lr_decay_style": "optim.lr_decay_style",
    "start_wd": "optim.weight_decay",
    "end_wd": "optim.weight_decay",
    "wd_incr_steps": "optim.weight_decay (increment steps)",
    "wd_incr_style": "optim.weight_decay (increment style)",
}
"""Scheduler state key → the config key that sets it (relative to the role)."""
GROUP_KEYS: dict[str, str] = {"betas": "optim.betas"}
"""Optimizer parameter-group key → config key (relative to the role)."""
GROUP_SCHEDULE_KEYS = ("max_lr", "min_lr")
"""Per-group schedule values Megatron's scheduler prefers to its own."""


def _config_key(prefix: str, relative: str) -> str:
    return relative if relative.startswith("trainer.") else f"{prefix}.{relative}"


def restore_scheduler(
    scheduler: Any,
    saved: dict,
    *,
    use_checkpoint: bool,
    prefix: str,
    warn: Callable[[str], None],
) -> list[str]:
    """Continue ``scheduler`` from ``saved`` (its ``state_dict()``) under the policy; returns the
    differing config keys (warned about)."""
    current = scheduler.state_dict()
    differing: dict[str, tuple[Any, Any]] = {}
    for key, relative in SCHEDULE_KEYS.items():
        if key in saved and saved[key] != current.get(key):
            differing.setdefault(_config_key(prefix, relative), (saved[key], current.get(key)))
    if differing:
        _warn(differing, use_checkpoint, prefix, "LR schedule", warn)
    if use_checkpoint:
        for key in SCHEDULE_KEYS:
            if key in saved:
                setattr(scheduler, key, saved[key])
    scheduler.num_steps = 0
    scheduler.step(increment=int(saved["num_steps"]))  # sets lr and weight decay of every group
    return list(differing)


def restore_group_hyperparameters(
    optimizer: Any,
    configured: list[dict],
    *,
    use_checkpoint: bool,
    prefix: str,
    warn: Callable[[str], None],
) -> list[str]:
    """After an optimizer load (which takes the checkpoint's parameter groups): keep them, or
    put back ``configured`` (the groups as built from the config, taken before the load).

    Besides Adam's betas this covers the per-group ``max_lr``/``min_lr`` that Megatron's
    scheduler reads before its own values (named by the schedule warning already).
    """
    groups = param_groups(optimizer)
    differing: dict[str, tuple[Any, Any]] = {}
    for have, want in zip(groups, configured, strict=True):
        for key, relative in GROUP_KEYS.items():
            if key in have and key in want and _normal(have[key]) != _normal(want[key]):
                differing.setdefault(f"{prefix}.{relative}", (_normal(have[key]), want[key]))
    if differing:
        _warn(differing, use_checkpoint, prefix, "optimizer", warn)
    if not use_checkpoint:
        for have, want in zip(groups, configured, strict=True):
            for key in (*GROUP_KEYS, *GROUP_SCHEDULE_KEYS):
                if key in want:
                    have[key] = want[key]
    return list(differing)


def param_groups(optimizer: Any) -> list[dict]:
    """The live parameter groups of Megatron's (chained) optimizer, in a fixed order."""
    return [
        group
        for leaf in getattr(optimizer, "chained_optimizers", [optimizer])
        for group in getattr(getattr(leaf, "optimizer", None), "param_groups", [])
    ]


def _normal(value: Any) -> Any:
    return tuple(float(v) for v in value) if isinstance(value, list | tuple) else value


def _warn(
    differing: dict[str, tuple[Any, Any]],
    use_checkpoint: bool,
    prefix: str,
    what: str,
    warn: Callable[[str], None],
) -> None:
    listed = "; ".join(
        f"{key}: checkpoint {old!r}, config {new!r}" for key, (old, new) in differing.items()
    )
    source = "checkpoint's" if use_checkpoint else "config's"
    other = "false" if use_checkpoint else "true"
    warn(
        f"resume: the {what} settings differ from the checkpoint's ({listed}); using the "
        f"{source} ({prefix}.optim.use_checkpoint_opt_param_scheduler={other} for the other)"
    )
