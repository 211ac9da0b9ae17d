"""Which learning-rate schedule a resumed run follows, and a warning naming what changed.

Megatron's ``OptimizerParamScheduler`` silently takes lr, warm-up and decay from the checkpoint
by default; megarl builds it with that switched off and decides here, per model, with verl's
``<role>.optim.use_checkpoint_opt_param_scheduler`` (default false: the config wins). Either
way every setting whose value differs between checkpoint and config is named in one warning,
with both values and the one in force. The optimizer's own hyperparameters (Adam betas and
which Megatron's optimizer load takes from the checkpoint's parameter groups, follow
the same policy.
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
    loaded_groups: list[dict],
    configured: dict[str, Any],
    *,
    use_checkpoint: bool,
    prefix: str,
    warn: Callable[[str], None],
) -> list[str]:
    """After an optimizer load: keep the checkpoint's betas/eps or put the config's back."""
    differing: dict[str, tuple[Any, Any]] = {}
    for group in loaded_groups:
        for key, relative in GROUP_KEYS.items():
            want = configured.get(key)
            have = group.get(key)
            if want is None or have is None:
                continue
            if _normal(have) != _normal(want):
                differing.setdefault(f"{prefix}.{relative}", (_normal(have), _normal(want)))
    if differing:
        _warn(differing, use_checkpoint, prefix, "optimizer", warn)
    if not use_checkpoint:
        for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
            inner = getattr(leaf, "optimizer", None)
            for group in getattr(inner, "param_groups", []):
                for key in GROUP_KEYS:
                    if key in group and configured.get(key) is not None:
                        group[key] = configured[key]
    return list(differing)


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
