"""The teachers a distillation run scores with, read from ``distillation.teacher_models``.

verl 0.9.1's rule: a section of one entry is the single teacher (verl's default
``teacher_model``), which takes every sample and the whole pool
(``distillation.nnodes × n_gpus_per_node``); a section of several is that many routed teachers
less the default entry ``teacher_model`` (which Hydra's defaults always put there), each taking
the samples whose ``distillation.teacher_key`` field equals its ``key`` and
``num_replicas × TP × DP × PP`` GPUs of the pool, in the order the section lists them. The
checks are :mod:`megarl.config.distillation_checks`'; this reads a config they passed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_TEACHER", "TeacherSpec", "megatron_teacher_layout", "teachers"]

DEFAULT_TEACHER = "teacher_model"
"""verl's single teacher's name (left out when several are given)."""


@dataclass(frozen=True)
class TeacherSpec:
    """One teacher as the run uses it."""

    name: str
    """Its name under ``teacher_models``."""
    key: str | None
    """The ``teacher_key`` value routed to it; None: the single teacher, which takes every sample."""
    model_path: str | None
    inference: dict[str, Any]
    """Its ``inference.*`` (a copy)."""
    ranks: int
    """The pool's GPUs it serves on (0 for megarl's Megatron teacher, on the training ranks)."""

    @property
    def engine(self) -> str | None:
        return self.inference.get("name")

    @property
    def tp(self) -> int:
        return _int(self.inference.get("tensor_model_parallel_size"), 1) or 1

    @property
    def pp(self) -> int:
        return _int(self.inference.get("pipeline_model_parallel_size"), 1) or 1


def _int(value: Any, default: int | None = None) -> int | None:
    if value is None:
        return default
    try:
        return int(str(value).strip())
    except ValueError:
        return default


def _per_replica(inference: dict) -> int:
    size = 1
    for dim in ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size"):
        size *= max(_int(inference.get(dim), 1) or 1, 1)
    return size


def teachers(cfg) -> list[TeacherSpec]:
    """The run's teachers in pool order (none with distillation off)."""
    d = cfg.distillation
    models = d.teacher_models if isinstance(d.teacher_models, dict) else {}
    if not d.enabled or not models:
        return []
    entries = [(n, e) for n, e in models.items() if isinstance(e, dict)]
    single = len(models) == 1
    if not single:
        entries = [(n, e) for n, e in entries if n != DEFAULT_TEACHER]
    pool = max(d.nnodes, 0) * max(d.n_gpus_per_node, 0)
    out = []
    for name, entry in entries:
        inference = dict(entry.get("inference") or {})
        if inference.get("name") == "megatron":
            ranks = 0
        elif single:
            ranks = pool
        else:
            ranks = max(_int(entry.get("num_replicas"), 0) or 0, 0) * _per_replica(inference)
        key = None if single else str(entry.get("key"))
        out.append(TeacherSpec(name, key, entry.get("model_path") or None, inference, ranks))
    return out


def megatron_teacher_layout(cfg):
    """The Megatron teacher's own layout, ``inference.tensor_model_parallel_size`` ×
    ``pipeline_model_parallel_size`` (CP 1, no VPP or SP: a forward), or None when it is the
    actor's TP × PP (the teacher then runs at the actor's whole layout) or there is no Megatron
    teacher."""
    from megarl.parallel.layout import ParallelLayout

    found = teachers(cfg)
    if len(found) != 1 or found[0].engine != "megatron":
        return None
    meg = cfg.actor_rollout_ref.actor.megatron
    tp, pp = found[0].tp, found[0].pp
    if (tp, pp) == (meg.tensor_model_parallel_size, meg.pipeline_model_parallel_size):
        return None
    return ParallelLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
