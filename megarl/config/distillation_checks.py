"""Checks of ``distillation.*`` (:mod:`megarl.config.schema_distill`), each problem one line
naming its key.

verl 0.9.1 checks the loss settings always (``DistillationLossConfig.__post_init__``) and the
teachers and their pool only when distillation is enabled (``DistillationConfig.__post_init__``);
so does megarl. megarl adds range checks verl leaves to a crash or a silent no-op (a clamp of the
wrong sign, a pool of size 0), and refuses in one line what it does not run yet: several
Megatron teachers, teachers of two engines, a vLLM teacher's replicas of DP or PP.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from megarl.config.layout_checks import fmt_value
from megarl.config.schema_distill import TEACHER_MODEL, TOPK_LOSS_MODES
from megarl.config.teachers import teachers as read_teachers
from megarl.config.verl_defaults import verl_tree

__all__ = [
    "MEGATRON_TEACHER",
    "check_distillation",
    "teacher_dims",
    "teacher_model_path",
]

Error = Callable[[str], None]

D = "distillation"
L = "distillation.distillation_loss"
MEGATRON_TEACHER = "megatron"
"""``inference.name`` of megarl's own teacher: a frozen Megatron model on the training ranks, at
its own TP × PP or the actor's layout (NeMo-RL's way; no pool of its own)."""
ENGINES = ("vllm", MEGATRON_TEACHER)
"""Teacher inference engines (verl also has sglang): vLLM on ranks of its own (the pool) or
megarl's own on the training ranks."""


def teacher_model_path(cfg) -> str | None:
    """The first teacher's ``model_path`` (None when distillation is off or none is given)."""
    found = read_teachers(cfg)
    return found[0].model_path if found else None


def teacher_dims(cfg, student, path: str | None = None):
    """The teacher's (``path``'s; default the first teacher's)
    :class:`~megarl.config.model_dims.ModelDims` from its ``config.json``; the student's
    ``student`` when that cannot be read (a plan of a config whose teacher is elsewhere)."""
    from megarl.config.model_dims import ModelDims, read_hf_config

    path = path or teacher_model_path(cfg)
    try:
        return ModelDims.from_hf_config(read_hf_config(path)) if path else student
    except (OSError, ValueError):
        return student


def _inference_keys() -> frozenset[str]:
    """Keys a teacher's ``inference`` section may hold: verl's rollout config's."""
    rollout = verl_tree()["actor_rollout_ref"]["rollout"]
    return frozenset(rollout) | frozenset(TEACHER_MODEL["inference"])


def _int(value: Any) -> int | None:
    """An int given as such or as text (``${...}`` in a free-form section resolve to text)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        return None


def check_distillation(cfg, error: Error, warn: Error, *, check_paths: bool = False) -> None:
    """Report every bad ``distillation.*`` value through ``error`` (verl's warnings: ``warn``);
    ``check_paths`` (``megarl train``): the Megatron teacher's directory must hold a model megarl
    builds (else only a warning, as for the actor's files)."""
    d = cfg.distillation
    loss = d.distillation_loss
    _check_loss(loss, error, warn)
    for key in ("n_gpus_per_node", "nnodes"):
        if getattr(d, key) < 0:
            error(f"{D}.{key}={getattr(d, key)} must be >= 0")
    if not d.teacher_key.strip():
        error(f"{D}.teacher_key is empty: name the sample field routing to teachers (data_source)")
    if not d.enabled:
        return
    _check_teachers(cfg, error)
    _check_built(cfg, error, error if check_paths else warn)


def _check_built(cfg, error: Error, file_problem: Error) -> None:
    """What of distillation megarl runs: one frozen Megatron teacher on the training ranks, or
    vLLM teachers (one, or several routed by ``teacher_key``) of TP replicas on a pool of their
    own."""
    d = cfg.distillation
    key = f"{D}.teacher_models"
    found = read_teachers(cfg)
    engines = {t.engine for t in found}
    if not engines <= set(ENGINES):  # the inference checks' to refuse
        return
    if len(engines) > 1:
        error(
            f"{key}: teachers served by both vllm and {MEGATRON_TEACHER} are not built; serve "
            "every teacher by one engine"
        )
        return
    if MEGATRON_TEACHER in engines and len(found) > 1:
        error(
            f"{key}: several {MEGATRON_TEACHER} teachers (routed by {D}.teacher_key) are not "
            "built; give one, or serve them by vllm on a pool of their own"
        )
        return
    for teacher in found:
        where = f"{key}.{teacher.name}"
        if teacher.engine == "vllm":
            for dim in ("data_parallel_size", "pipeline_model_parallel_size"):
                if (_int(teacher.inference.get(dim, 1)) or 1) > 1:
                    error(
                        f"{where}.inference.{dim}={teacher.inference.get(dim)}: a vLLM teacher "
                        "runs num_replicas replicas of TP only; use 1"
                    )
        else:
            _check_megatron_layout(cfg, teacher, f"{where}.inference", error)
            if d.nnodes:
                error(
                    f"{D}.nnodes={d.nnodes}: the Megatron teacher runs on the training ranks, "
                    "with no pool of its own; use 0"
                )
        path = teacher.model_path
        if path and _check_teacher_files(f"{where}.model_path", path, file_problem):
            _check_teacher_vocab(cfg, f"{where}.model_path", path, error)


def _check_megatron_layout(cfg, teacher, key: str, error: Error) -> None:
    """The Megatron teacher's own TP × PP (``inference.*``) divides the training ranks and its
    TP the teacher's attention heads (where its ``config.json`` reads)."""
    from megarl.config.model_dims import read_hf_config

    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    tp, pp = teacher.tp, teacher.pp
    if world % (tp * pp):
        error(
            f"{key}.tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} does "
            f"not divide the {world} training rank(s): the Megatron teacher runs on them at "
            "this TP x PP"
        )
        return
    try:
        hf = read_hf_config(teacher.model_path) if teacher.model_path else {}
    except (OSError, TypeError, ValueError):
        return
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = hf.get(name)
        if isinstance(heads, int) and heads % tp:
            error(
                f"{key}.tensor_model_parallel_size={tp} does not divide the teacher's {name} {heads}"
            )
            return


def _check_teacher_files(key: str, path: str, problem: Error) -> bool:
    """The teacher's directory holds a ``config.json`` of an architecture megarl builds."""
    from pathlib import Path

    from megarl.config.model_dims import ModelDims, read_hf_config

    where = Path(path).expanduser()
    if not (where / "config.json").is_file():
        state = "is a directory without a config.json" if where.is_dir() else "does not exist"
        problem(f"{key}={path!r} {state} (the teacher loads a local HF checkpoint)")
        return False
    try:
        ModelDims.from_hf_config(read_hf_config(where))
    except (OSError, ValueError) as exc:
        problem(f"{key}={path!r}: {exc}")
        return False
    return True


def _check_teacher_vocab(cfg, key: str, path: str, error: Error) -> None:
    """Teacher and student score the same token ids: the same vocabulary size (where both
    ``config.json`` files can be read; a missing path is the path checks' to report)."""
    from megarl.config.model_dims import read_hf_config

    try:
        teacher = read_hf_config(path)
        student = read_hf_config(cfg.actor_rollout_ref.model.path)
    except (OSError, TypeError, ValueError):
        return
    if teacher.get("vocab_size") != student.get("vocab_size"):
        error(
            f"{key}: the teacher's vocab_size {teacher.get('vocab_size')} is not the student's "
            f"{student.get('vocab_size')}; distillation scores the student's token ids"
        )
        return
    loss = cfg.distillation.distillation_loss
    vocab = student.get("vocab_size")
    if loss.loss_mode in TOPK_LOSS_MODES and isinstance(vocab, int) and (loss.topk or 0) > vocab:
        error(f"{L}.topk={loss.topk} is more than the vocabulary's {vocab} tokens")


def _check_loss(loss, error: Error, warn: Error) -> None:
    mode = loss.loss_mode
    if not loss.use_policy_gradient and mode in ("k1", "kl"):
        error(
            f"{L}.loss_mode={mode} with use_policy_gradient=false: k1's gradient does not depend "
            "on the teacher's log-probs; use use_policy_gradient=true, or k3 / forward_kl_topk"
        )
    if mode in TOPK_LOSS_MODES:
        if loss.topk is None or loss.topk < 1:
            error(f"{L}.topk={fmt_value(loss.topk)}: loss_mode={mode} needs a top-k of 1 or more")
        if loss.use_policy_gradient:
            warn(
                f"{L}.loss_mode={mode} with use_policy_gradient=true: the update uses only the "
                "sampled token's log-prob, so most of the top-k signal is unused"
            )
    elif loss.topk is not None and loss.topk < 1:
        error(f"{L}.topk={loss.topk} must be 1 or more (or null)")
    if not math.isfinite(loss.distillation_loss_coef) or loss.distillation_loss_coef < 0:
        error(f"{L}.distillation_loss_coef={loss.distillation_loss_coef} must be >= 0 and finite")
    if loss.loss_max_clamp is not None and not loss.loss_max_clamp > 0:
        error(
            f"{L}.loss_max_clamp={loss.loss_max_clamp} must be > 0 (the loss is clamped to [-c, c])"
        )
    if loss.log_prob_min_clamp is not None and not loss.log_prob_min_clamp < 0:
        error(
            f"{L}.log_prob_min_clamp={loss.log_prob_min_clamp} must be < 0 (a floor under "
            "log-probs, which are <= 0)"
        )
    for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        value = getattr(loss, key)
        if not value >= 0:
            error(f"{L}.{key}={value} must be >= 0")


def _check_teachers(cfg, error: Error) -> None:
    """verl's teacher checks (``_resolve_teacher_models``, ``validate_and_prepare_for_distillation``)."""
    d = cfg.distillation
    loss = d.distillation_loss
    pool = d.n_gpus_per_node * d.nnodes
    own = [t for t in read_teachers(cfg) if t.engine != MEGATRON_TEACHER]
    if not own:  # megarl's Megatron teacher: on the training ranks, no pool
        pool = 0
    if pool == 0 and own:
        error(
            f"{D}.nnodes={d.nnodes} x n_gpus_per_node={d.n_gpus_per_node} = 0: the teachers "
            "need GPUs of their own"
        )
    teachers = d.teacher_models  # always with verl's default teacher_model (schema_distill)
    single = len(teachers) == 1
    names = ["teacher_model"] if single else [n for n in teachers if n != "teacher_model"]
    seen: dict[str, str] = {}
    total = 0
    for name in names:
        key = f"{D}.teacher_models.{name}"
        entry = teachers[name]
        if not isinstance(entry, dict):
            error(
                f"{key}: expected a section (key, model_path, num_replicas, inference), got {entry!r}"
            )
            continue
        unknown = sorted(set(entry) - set(TEACHER_MODEL) - {"_target_"})
        if unknown:
            error(f"{key}.{unknown[0]}: unknown key; a teacher has {', '.join(TEACHER_MODEL)}")
        inference = entry.get("inference") or {}
        if not isinstance(inference, dict):
            error(f"{key}.inference: expected a section, got {inference!r}")
            continue
        bad = sorted(set(inference) - _inference_keys())
        if bad:
            error(f"{key}.inference.{bad[0]}: not a key of verl's rollout config")
        per_replica = _per_replica(key, inference, error)
        if per_replica is None:
            continue
        if not entry.get("model_path"):
            error(f"{key}.model_path must be set (the teacher's HF path)")
        if single and not own:
            replicas = 0
        elif single:
            if pool % per_replica:
                error(
                    f"{key}.inference: a replica of {per_replica} GPUs (TP x DP x PP) does not "
                    f"divide the teachers' pool {D}.nnodes x n_gpus_per_node = {pool}"
                )
            replicas = pool // per_replica
        else:
            replicas = _int(entry.get("num_replicas"))
            if replicas is None or replicas < 0:
                error(f"{key}.num_replicas={fmt_value(entry.get('num_replicas'))} must be >= 0")
                replicas = 0
            route = entry.get("key")
            if route is None:
                error(f"{key}.key must be set: the {D}.teacher_key value routed to this teacher")
            elif str(route) in seen:
                error(f"{key}.key={route}: also the key of teacher_models.{seen[str(route)]}")
            else:
                seen[str(route)] = name
        total += replicas * per_replica
        _check_inference(key, inference, loss, error)
    if not single and pool and total != pool:
        error(
            f"{D}.teacher_models: num_replicas x (TP x DP x PP) summed over the teachers = "
            f"{total}, not the pool {D}.nnodes x n_gpus_per_node = {pool}"
        )


def _per_replica(key: str, inference: dict, error: Error) -> int | None:
    size = 1
    for name in (
        "tensor_model_parallel_size",
        "data_parallel_size",
        "pipeline_model_parallel_size",
    ):
        value = _int(inference.get(name, 1))
        if value is None or value < 1:
            error(f"{key}.inference.{name}={fmt_value(inference.get(name))} must be >= 1")
            return None
        size *= value
    return size


def _check_inference(key: str, inference: dict, loss, error: Error) -> None:
    name = inference.get("name")
    if name not in ENGINES:
        error(
            f"{key}.inference.name={fmt_value(name)}: a teacher is served by {' or '.join(ENGINES)}"
        )
    prompt = _int(inference.get("prompt_length"))
    response = _int(inference.get("response_length"))
    given = inference.get("max_model_len")
    limit = None if given is None else _int(given)
    if None not in (limit, prompt, response) and prompt + response + 1 > limit:
        error(
            f"{key}.inference.max_model_len={limit} < prompt_length + response_length + 1 = "
            f"{prompt + response + 1}: the teacher scores the whole student sequence"
        )
    if loss.loss_mode in TOPK_LOSS_MODES and loss.topk is not None:
        kwargs = inference.get("engine_kwargs") or {}
        vllm = kwargs.get("vllm") if isinstance(kwargs, dict) else None
        given = vllm.get("max_logprobs") if isinstance(vllm, dict) else None
        max_logprobs = None if given is None else _int(given)
        if max_logprobs is not None and max_logprobs < loss.topk:
            error(
                f"{key}.inference.engine_kwargs.vllm.max_logprobs={max_logprobs} < "
                f"{L}.topk={loss.topk}: vLLM returns at most max_logprobs log-probs per token"
            )
