"""Checks of ``actor_rollout_ref.model.lora.*`` (LoRA adapters on the actor,
:mod:`megarl.models.lora`), each problem one line naming its key."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

from megarl.config import lora_modules as lm
from megarl.config.batch_plan import stages_weight_updates
from megarl.config.layout_checks import fmt_value
from megarl.config.model_dims import known_dims

__all__ = [
    "LORA_TARGETS",
    "check_lora",
    "check_lora_modules",
    "check_lora_moe",
    "lora_resume_mismatch",
]

Error = Callable[[str], None]

L = "actor_rollout_ref.model.lora"
LORA_TARGETS = lm.DEFAULT_TARGETS
"""verl's default ``target_modules`` (``megarl.models.lora.LORA_TARGETS``)."""
INIT_METHODS = ("xavier", "kaiming", "normal", "zero")
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def check_lora(cfg, error: Error) -> None:
    """Report what megarl cannot do with the LoRA settings through ``error``."""
    lora = cfg.actor_rollout_ref.model.lora
    if isinstance(lora.rank, bool) or lora.rank < 0:
        error(f"{L}.rank={fmt_value(lora.rank)} must be >= 0 (0: no adapters)")
        return
    if lora.rank == 0:
        return
    if lora.type != "lora":
        error(
            f"{L}.type={fmt_value(lora.type)} is not built; use lora (one adapter per fused linear)"
        )
    if isinstance(lora.alpha, bool) or lora.alpha == 0:
        error(f"{L}.alpha={fmt_value(lora.alpha)} scales every adapter's output by 0: the "
              "adapters could never change the policy (verl's default: 32)")  # fmt: skip
    for key in ("target_modules", "exclude_modules"):
        entries = getattr(lora, key)
        bad = [t for t in entries if lm.is_plain_name(t) and t not in lm.ADAPTABLE]
        if bad:
            error(f"{L}.{key} {bad} are not linears megarl adapts: {list(lm.ADAPTABLE)}, or "
                  "full-name patterns such as '*.layers.0.*'")  # fmt: skip
        for t in entries:
            if (why := lm.pattern_error(t)) is not None:
                error(f"{L}.{key} entry {t!r} is no valid pattern ({why})")
    if lora.exclude_modules and lora.target_modules:
        error(f"{L}.exclude_modules needs target_modules=[] (as verl: every linear but those)")
    for key in ("lora_A_init_method", "lora_B_init_method"):
        if getattr(lora, key) not in INIT_METHODS:
            error(f"{L}.{key}={fmt_value(getattr(lora, key))}: use one of {list(INIT_METHODS)}")
    if lora.dropout_position not in ("pre", "post"):
        error(f"{L}.dropout_position={fmt_value(lora.dropout_position)} must be pre or post")
    if not 0.0 <= lora.dropout < 1.0:
        error(f"{L}.dropout={fmt_value(lora.dropout)} must be in [0, 1)")
    if lora.adapter_path:
        _check_adapter_folder(lora, error)
    if lora.a2a_experimental:
        error(f"{L}.a2a_experimental=true is not built; use false")
    if lora.dtype is not None:
        error(f"{L}.dtype is not built: adapters take the actor's dtype; leave it null")
    if not lora.merge and stages_weight_updates(cfg):
        error(
            f"{L}.merge=false with vLLM on ranks of its own needs "
            "async_training.staleness_threshold <= 1 (staged weight updates carry no adapters); "
            f"set {L}.merge=true"
        )
    if cfg.actor_rollout_ref.actor.megatron.use_dist_checkpointing:
        # the adapters' checkpoints, PEFT exports and `megarl convert` name model.path as the
        # base they adapt; a base read from a Megatron checkpoint would be replaced by it there
        error(
            f"{L}.rank > 0 with actor_rollout_ref.actor.megatron.use_dist_checkpointing=true is not "
            "built: LoRA's base is actor_rollout_ref.model.path (convert the checkpoint to HF)"
        )


def check_lora_moe(cfg, shape, error: Error) -> None:
    """LoRA on a Mixture-of-Experts actor (``shape``: the model's, or None when unknown): expert
    adapters train and sync merged; adapter-only syncs (``merge=false``) would need vLLM's LoRA
    on fused MoE experts, which its CPU build lacks and megarl does not build."""
    lora = cfg.actor_rollout_ref.model.lora
    if lora.rank <= 0 or not shape or not shape.get("num_experts") or lora.merge:
        return
    error(
        f"{L}.merge=false on a Mixture-of-Experts model ({shape.source}) is not built (vLLM 0.32 "
        f"puts LoRA on fused MoE experts only with its Triton GPU kernels): set {L}.merge=true"
    )


def _check_adapter_folder(lora, error: Error) -> None:
    """``lora.adapter_path`` is a PEFT LoRA folder of this rank and alpha (its files' shapes:
    :func:`check_lora_modules`, which knows the model)."""
    folder = Path(lora.adapter_path).expanduser()
    where = f"{L}.adapter_path={lora.adapter_path}"
    if not (folder / PEFT_CONFIG).is_file():
        error(f"{where} holds no {PEFT_CONFIG} (a PEFT adapter folder)")
        return
    try:
        config = json.loads((folder / PEFT_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        error(f"{where}: {PEFT_CONFIG} does not parse as JSON ({exc})")
        return
    kind = config.get("peft_type") if isinstance(config, dict) else None
    if kind != "LORA":
        error(f"{where}: {PEFT_CONFIG} is not a PEFT LoRA adapter's (peft_type="
              f"{fmt_value(kind)}, expected LORA)")  # fmt: skip
        return
    if config.get("r") != lora.rank or float(config.get("lora_alpha", -1)) != float(lora.alpha):
        error(f"{where} holds an adapter of r={config.get('r')}, lora_alpha="
              f"{config.get('lora_alpha')}; set {L}.rank={config.get('r')} and "
              f"{L}.alpha={config.get('lora_alpha')} (now {lora.rank}, {lora.alpha})")  # fmt: skip
    if not (folder / PEFT_WEIGHTS).is_file():
        error(f"{where} holds no {PEFT_WEIGHTS} (PEFT's adapter weights)")


def check_lora_modules(cfg, shape, error: Error, warn: Error) -> None:
    """The linears ``target_modules``/``exclude_modules`` select on a model of ``shape`` (the
    model's, or None when unknown; :mod:`megarl.config.lora_modules`): none selected, a target
    entry selecting nothing (Bridge refuses both), a tied or adapter-only-synced output layer,
    and an ``adapter_path`` whose tensors do not fit; warnings for an exclude entry selecting
    nothing and a pattern whose ``.`` matched another character."""
    lora = cfg.actor_rollout_ref.model.lora
    if lora.rank <= 0 or not shape:
        return
    names = lm.linear_names(shape)
    if not names:
        return
    chosen = lm.targeted_names(names, lora.target_modules, lora.exclude_modules)
    entries = [("target_modules", e) for e in lora.target_modules]
    entries += [("exclude_modules", e) for e in lora.exclude_modules]
    if any(
        lm.is_plain_name(e) and e not in lm.ADAPTABLE or lm.pattern_error(e) for _, e in entries
    ):
        return  # said by check_lora
    for key, entry in entries:
        if lm.unmatched_entries(names, [entry]):
            say = error if key == "target_modules" else warn
            say(f"{L}.{key} entry {entry!r} matches no linear of {shape.source} (entries match a "
                "linear's name or its whole path, '*' any text: '*.layers.1.*')")  # fmt: skip
        elif surprises := lm.dot_surprises(names, entry):
            warn(f"{L}.{key} entry {entry!r} also matches {surprises[0]} ({len(surprises)} in "
                 "all): its '.' matches any character, as in verl (write '\\.' for a dot)")  # fmt: skip
    if not chosen:
        error(f"{L}: target_modules={list(lora.target_modules)}, exclude_modules="
              f"{list(lora.exclude_modules)} leave no linear of {shape.source} to adapt")  # fmt: skip
        return
    if lm.OUTPUT_LAYER in chosen:
        _check_output_layer(cfg, shape, error)
    folder = Path(lora.adapter_path or "").expanduser()
    if lora.adapter_path and (folder / PEFT_CONFIG).is_file() and (folder / PEFT_WEIGHTS).is_file():
        _check_adapter_shapes(lora, shape, error)


def _check_output_layer(cfg, shape, error: Error) -> None:
    lora = cfg.actor_rollout_ref.model.lora
    if shape.get("tie_word_embeddings"):
        error(f"{L} adapts output_layer, whose weight {shape.source} ties to the embeddings "
              f"(tie_word_embeddings=true): not built; add output_layer to {L}.exclude_modules")  # fmt: skip
    elif not lora.merge:
        error(f"{L} adapts output_layer with {L}.merge=false: vLLM 0.32 puts no LoRA on lm_head "
              f"for every model (Qwen2 has none); set {L}.merge=true or add output_layer to "
              f"{L}.exclude_modules")  # fmt: skip


def _check_adapter_shapes(lora, shape, error: Error) -> None:
    """Every tensor of ``adapter_model.safetensors`` has this model's width (read from the
    file's header: no torch), so an adapter of another base is named here, not by torch."""
    path = Path(lora.adapter_path).expanduser() / PEFT_WEIGHTS
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        error(f"{L}.adapter_path: {path} is no safetensors file ({exc})")
        return
    for key, info in header.items():
        want = _peft_shape(key, lora.rank, shape)
        if want is not None and isinstance(info, dict) and tuple(info.get("shape", ())) != want:
            error(f"{L}.adapter_path: {key} in {path} has shape {info.get('shape')}, the model "
                  f"({shape.source}) needs {list(want)}: an adapter of another base model")  # fmt: skip
            return


def _peft_shape(key: str, rank: int, shape) -> tuple[int, int] | None:
    """``[r, in]`` (``lora_A``) or ``[out, r]`` (``lora_B``) of a PEFT key on this model, or
    None when a width is unknown (or the key is not a per-projection adapter)."""
    module, _, which = key.removeprefix(PEFT_PREFIX).partition(".lora_")
    leaf = module.rsplit(".", 1)[-1]
    h, heads, groups = (shape.get(k) for k in ("hidden_size", "num_attention_heads",
                                                 "num_query_groups"))  # fmt: skip
    d = shape.get("head_dim") or (h // heads if h and heads else None)
    ffn = shape.get("moe_ffn_hidden_size" if ".experts." in module else "ffn_hidden_size")
    if "shared_expert" in module:
        ffn = None
    q, kv = (heads * d if heads and d else None), (groups * d if groups and d else None)
    widths = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, ffn), "up_proj": (h, ffn), "down_proj": (ffn, h),
              "lm_head": (h, shape.get("vocab_size"))}  # fmt: skip
    if leaf not in widths:
        return None
    in_f, out_f = widths[leaf]
    if which.startswith("A"):
        return (rank, in_f) if in_f else None
    return (out_f, rank) if out_f else None


def lora_resume_mismatch(saved: dict, lora, *, ckpt) -> str | None:
    """One line when the checkpoint's LoRA settings (``megarl_meta.json``'s ``lora``, or none)
    do not fit ``actor_rollout_ref.model.lora``: another rank, other adapted linears, adapters
    where the config trains full weights or the reverse."""
    was = saved.get("lora")
    rank = max(0, lora.rank)
    if not was and not rank:
        return None
    if not was or not rank:
        holds = f"LoRA adapters of rank {was['rank']}" if was else "full weights (no LoRA)"
        return (f"cannot resume: checkpoint {ckpt} holds {holds} but {L}.rank={lora.rank}; "
                "resume it with its settings or set trainer.resume_mode=disable")  # fmt: skip
    names = lm.linear_names(known_dims(saved.get("hf_config") or {}))
    then = lm.targeted_names(names, was.get("target_modules", ()), was.get("exclude_modules", ()))
    now = lm.targeted_names(names, lora.target_modules, lora.exclude_modules)
    if int(was["rank"]) != rank:
        return (f"cannot resume: checkpoint {ckpt} holds LoRA adapters of rank {was['rank']} but "
                f"{L}.rank={lora.rank}; set {L}.rank={was['rank']} or "
                "trainer.resume_mode=disable")  # fmt: skip
    if then != now:
        return (f"cannot resume: checkpoint {ckpt} holds adapters on "
                f"target_modules={list(was.get('target_modules', ()))}, exclude_modules="
                f"{list(was.get('exclude_modules', ()))}; {L} now selects other linears "
                f"({len(now)} against {len(then)}): set them as saved or "
                "trainer.resume_mode=disable")  # fmt: skip
    return None


def lora_enabled(cfg) -> bool:
    """The actor trains LoRA adapters (``actor_rollout_ref.model.lora.rank`` > 0): the reference
    is then the actor with its adapters off, not a model of its own."""
    return cfg.actor_rollout_ref.model.lora.rank > 0
