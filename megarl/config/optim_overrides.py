"""``*.optim.override_optimizer_config``: Megatron ``OptimizerConfig`` fields a verl script sets
directly (verl applies them after building the config from ``optim.*``, so they win).

Each entry is honoured (:data:`HONOURED`, mapped onto the optimizer megarl builds), accepted at
the value that is megarl's behaviour anyway (:data:`ONLY`), or refused in one line naming the
values that work.
"""

from __future__ import annotations

from typing import Any

HONOURED: dict[str, str] = {
    "adam_beta1": "Adam beta1 (over optim.betas[0])",
    "adam_beta2": "Adam beta2 (over optim.betas[1])",
    "adam_eps": "Adam epsilon",
    "sgd_momentum": "SGD momentum",
    "clip_grad": "gradient-norm clip (over optim.clip_grad)",
}
"""Entries that change the optimizer megarl builds, with what they set."""

_FP32 = ("fp32", "float32", "torch.float32")
ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "decoupled_weight_decay": ((True,), "weight decay is decoupled (AdamW)"),
    "main_grads_dtype": (_FP32, "main gradients are fp32"),
    "main_params_dtype": (_FP32, "main params are fp32"),
    "exp_avg_dtype": (_FP32, "Adam moments are fp32"),
    "exp_avg_sq_dtype": (_FP32, "Adam moments are fp32"),
    "optimizer_cpu_offload": (
        (False,),
        (
            # Measured with Megatron-Core 0.16.1 under megarl's distributed optimizer (issue 56;
            # docs/verl-differences.md): a model-only load copies the weights into the model but
            # HybridDeviceOptimizer refreshes only fp32 copies it made itself (none: its params
            # are already the fp32 main shards), so the next step writes the stale ones back.
            "no CPU optimizer step: Megatron's hybrid CPU/GPU optimizer undoes a weights-only "
            "load at the next step (measured: weights moved by up to 1.18 at lr 0), cannot be "
            'built over fp32 parameters ("can\'t optimize a non-leaf Tensor") and cannot step '
            "without CUDA (KeyError); megatron.optimizer_offload=true moves the optimizer state "
            "to CPU between steps"
        ),
    ),
}
"""Entries accepted only at megarl's behaviour: (the values that work, why)."""

NO_EFFECT: dict[str, str] = {
    "use_precision_aware_optimizer": (
        "with the fp32 dtypes above (the only ones accepted) Megatron's precision-aware Adam "
        "keeps fp32 main params and moments, as megarl's does"
    ),
    "optimizer_offload_fraction": "read by Megatron only with optimizer_cpu_offload",
    "overlap_cpu_optimizer_d2h_h2d": "read by Megatron only with optimizer_cpu_offload",
    "use_torch_optimizer_for_cpu_offload": "read by Megatron only with optimizer_cpu_offload",
}
"""Entries accepted at any value, with no effect in megarl (why)."""


def override_problems(prefix: str, overrides: dict[str, Any]) -> list[str]:
    """One line per entry of ``overrides`` (at ``prefix``) megarl cannot apply, each naming the
    values or entries that work."""
    problems = []
    for name, value in overrides.items():
        key = f"{prefix}.{name}"
        if name in NO_EFFECT:
            continue
        if name in HONOURED:
            number = _number(value)
            if number is None or number < 0:
                problems.append(f"{key}={value!r} must be a number >= 0")
        elif name in ONLY:
            works, why = ONLY[name]
            if not any(type(value) is type(w) and value == w for w in works) and not (
                isinstance(value, str) and value in works
            ):
                shown = " or ".join(
                    str(w).lower() if isinstance(w, bool) else str(w) for w in works
                )
                problems.append(f"{key}={value!r}: {why}; use {shown}")
        else:
            problems.append(
                f"{key} is not applied by megarl; the entries it honours are "
                f"{', '.join(HONOURED)} (and {', '.join(ONLY)} at megarl's values; "
                f"{', '.join(NO_EFFECT)} at any)"
            )
    return problems


def _number(value: Any) -> float | None:
    """``value`` as a float (YAML reads ``1e-5`` as a string; verl's OmegaConf as a number)."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def honoured_overrides(overrides: dict[str, Any], betas: tuple[float, float]) -> dict[str, Any]:
    """The :class:`~megarl.models.trainable.OptimizerSettings` fields that ``overrides`` set:
    ``betas``, ``eps``, ``sgd_momentum``, ``clip_grad`` (only those given)."""
    out: dict[str, Any] = {}
    if "adam_beta1" in overrides or "adam_beta2" in overrides:
        out["betas"] = (
            float(overrides.get("adam_beta1", betas[0])),
            float(overrides.get("adam_beta2", betas[1])),
        )
    for name, field in (("adam_eps", "eps"), ("sgd_momentum", "sgd_momentum"),
                        ("clip_grad", "clip_grad")):  # fmt: skip
        if name in overrides:
            out[field] = float(overrides[name])
    return out
