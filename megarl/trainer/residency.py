"""The trainer's side of :mod:`megarl.planner.residency`: move every model's state and the
rollout engine to a phase's declared residency, and record what was applied.

``enter(run, phase)`` is the only place the trainer offloads, reloads, sleeps or wakes; the
memory planner sums the same declaration, and ``run.residency_log`` (what each model and the
engine report after the move) lets a test hold the two together.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.planner.residency import (
    EngineResidency,
    ModelResidency,
    Residency,
    residency,
    sleep_level,
)


def enter(run: Any, phase: str, *, step: int | None = None) -> None:
    """Move ``run``'s models and engine to ``phase``'s residency (collective: every rank).

    ``step``: the step in flight (its sync decides vLLM's sleep level: 2 when the step's sync
    replaces the weights, 1 when ``trainer.skip_weight_sync_steps`` keeps them); None before the
    first step (the first wake always syncs). Everything leaving the device moves first.
    """
    _close_phase(run)
    want = residency(run.cfg, phase)
    models = _models(run)
    for role, target in want.models.items():  # out first
        current = applied_model(models[role])
        _place(models[role], _meet(current, target))
    asleep = want.engine is not None and not (want.engine.weights or want.engine.kv_cache)
    if asleep and run.engine_residency != want.engine:
        run.last_sleep_level = sleep_level(run.cfg, step)
        free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
        run.engine.sleep(level=run.last_sleep_level)
        if torch.cuda.is_available():
            run.sleep_freed = torch.cuda.mem_get_info()[0] - free
        run.engine_residency = want.engine
    for role, target in want.models.items():  # then in
        _place(models[role], target)
    if want.engine is not None and run.engine_residency != want.engine:
        tags = [
            tag
            for tag, now, wanted in (
                ("weights", run.engine_residency.weights, want.engine.weights),
                ("kv_cache", run.engine_residency.kv_cache, want.engine.kv_cache),
            )
            if wanted and not now
        ]
        run.engine.wake_up(tags)
        run.engine_residency = want.engine
    run.residency_log.append((phase, applied(run)))
    run.current_phase = phase


def _close_phase(run: Any) -> None:
    """On CUDA: the device-memory peak of the phase that ends (``run.phase_peaks``, the most
    over the run; ``megarl plan`` predicts the same phases), then a fresh peak for the next."""
    if not torch.cuda.is_available() or run.current_phase is None:
        return
    free, total = torch.cuda.mem_get_info()
    for key, value in (("peak", torch.cuda.max_memory_allocated()), ("used", total - free)):
        name = (key, run.current_phase)
        run.phase_peaks[name] = max(run.phase_peaks.get(name, 0), value)
    torch.cuda.reset_peak_memory_stats()


def phase_peak_metrics(run: Any) -> dict[str, float]:
    """CUDA only, for every phase measured so far: ``memory/peak_gib/<phase>`` (PyTorch's
    allocator peak, vLLM's pool included where it allocates through it) and
    ``memory/used_gib/<phase>`` (the device's used memory at the phase's end, every allocator);
    ``rollout/sleep_freed_gib`` (device memory vLLM's last sleep returned); and
    ``rollout/sleep_level``, the level vLLM last slept at."""
    _close_phase(run)
    out = {f"memory/{k}_gib/{p}": b / 2**30 for (k, p), b in run.phase_peaks.items()}
    if run.sleep_freed is not None:
        out["rollout/sleep_freed_gib"] = run.sleep_freed / 2**30
    if run.last_sleep_level is not None:
        out["rollout/sleep_level"] = float(run.last_sleep_level)
    return out


def settle(model: Any, cfg: Any, role: str) -> None:
    """Right after ``model`` (actor, critic or ref) is built: its ``setup`` residency, before the
    next model is built (the setup peak holds one model's full state, not all of them)."""
    _place(model, residency(cfg, "setup").models[role])


def applied(run: Any) -> Residency:
    """What the run's models and engine hold now, as they report it."""
    models = {role: applied_model(m) for role, m in _models(run).items()}
    return Residency(models, run.engine_residency)


def applied_model(model: Any) -> ModelResidency:
    """What ``model`` (a TrainableModel, or the reference's BuiltModel) reports on the device."""
    return ModelResidency(*model.residency)


def _models(run: Any) -> dict[str, Any]:
    out = {"actor": run.actor}
    if run.critic is not None:
        out["critic"] = run.critic
    if run.ref is not None and not getattr(run.ref, "shares_actor", False):
        out["ref"] = run.ref  # (LoRA's reference is the actor's chunks: no state of its own)
    if getattr(run, "teacher", None) is not None:
        out["teacher"] = run.teacher
    return out


def _meet(a: ModelResidency, b: ModelResidency) -> ModelResidency:
    """On the device in both (what stays while the rest leaves)."""
    return ModelResidency(a.params and b.params, a.grads and b.grads, a.optimizer and b.optimizer)


def _place(model: Any, target: ModelResidency) -> None:
    model.place(params=target.params, grads=target.grads, optimizer=target.optimizer)


def settle_engine(engine: Any, cfg: Any) -> EngineResidency | None:
    """Right after the engine started (vLLM claimed its pool, which nothing needs until the first
    generate): its ``setup`` residency, asleep at level 2 with ``free_cache_engine`` (no host
    copy; the first wake syncs the actor's weights in). None: the actor generates."""
    target = residency(cfg, "setup").engine
    if target is not None and not (target.weights or target.kv_cache):
        engine.sleep(level=sleep_level(cfg, None))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # setup's peak: from here (vLLM's start is generate's)
    return target
