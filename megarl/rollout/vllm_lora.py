"""vLLM's LoRA layers for adapter-only syncs (``actor_rollout_ref.model.lora.merge=false``):
the engine arguments that turn them on and the id the actor's adapter goes by (verl's)."""

from __future__ import annotations

from typing import Any

LORA_INT_ID = 123
"""vLLM id of the actor's adapter (``lora.merge=false``), verl's ``VLLM_LORA_INT_ID``."""
LORA_NAME = "123"
"""Its name (verl's ``VLLM_LORA_NAME``)."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM 0.32 accepts (``vllm.config.lora.MaxLoRARanks``)."""


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"lora.rank={rank} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


def adapter_engine_args(lora) -> dict[str, Any]:
    """:class:`VLLMEngine` arguments for ``actor_rollout_ref.model.lora``: adapter-only syncs
    (``rank`` > 0 with ``merge=false``) need vLLM's LoRA layers; otherwise none."""
    if lora.rank <= 0 or lora.merge:
        return {}
    return {"lora_rank": int(lora.rank), "fully_sharded_loras": bool(lora.fully_sharded_loras)}


def lora_engine_kwargs(lora_rank: int, fully_sharded_loras: bool = False) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for one adapter of rank ``lora_rank`` (none when 0)."""
    if lora_rank <= 0:
        return {}
    return {
        "enable_lora": True,
        "max_lora_rank": vllm_max_lora_rank(lora_rank),
        "max_loras": 1,
        "fully_sharded_loras": fully_sharded_loras,
    }
