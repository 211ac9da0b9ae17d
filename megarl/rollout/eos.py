"""The token ids that end a response (a model's ``generation_config.json`` / ``config.json``
``eos_token_id``, else its tokenizer's), as :class:`megarl.rollout.vllm_engine.VLLMEngine`
and the trainer read them. Re-exported by ``vllm_engine``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def read_eos_token_ids(model_path: str | Path) -> list[int]:
    """EOS ids of an HF checkpoint: ``generation_config.json`` first, then ``config.json``.

    vLLM learns the primary EOS from the tokenizer, which is skipped here (prompts are token ids),
    so the adapter passes these as stop tokens itself.
    """
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = Path(model_path) / name
        if not path.exists():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        for i in [value] if isinstance(value, int) else value or []:
            if i not in ids:
                ids.append(int(i))
    return ids


def tokenizer_eos_token_id(tokenizer_path: str | Path) -> int | None:
    """The EOS id of the HF tokenizer saved at ``tokenizer_path``; None when there is none.

    Only a saved tokenizer counts: transformers 5 builds an empty tokenizer with a default EOS
    (``<|endoftext|>`` -> 0 for Qwen2) from a bare ``config.json``, so the directory must hold
    tokenizer files and the EOS token must be in the vocabulary.
    """
    directory = Path(tokenizer_path)
    if not any((directory / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError):
        return None
    eos = tokenizer.eos_token
    if eos is None or eos not in tokenizer.get_vocab():
        return None
    return int(tokenizer.convert_tokens_to_ids(eos))


def resolve_eos_token_ids(
    model_path: str | Path,
    tokenizer_path: str | Path | None = None,
    eos_token_ids: Sequence[int] | None = None,
) -> list[int]:
    """The ids that end a response: ``eos_token_ids`` when given, else the checkpoint's
    (:func:`read_eos_token_ids`), else the tokenizer's ``eos_token_id`` (as the trainer does for
    the actor engine).

    Raises ``ValueError`` when there is none: the engine starts with ``skip_tokenizer_init`` and
    ``generation_config="vllm"``, so vLLM would know no EOS and every response would silently
    run to ``max_tokens``.
    """
    ids = list(eos_token_ids) if eos_token_ids else read_eos_token_ids(model_path)
    if not ids:
        eos = tokenizer_eos_token_id(tokenizer_path or model_path)
        ids = [eos] if eos is not None else []
    if not ids:
        raise ValueError(
            f"no EOS token id for {model_path}: neither generation_config.json/config.json "
            f"(eos_token_id) nor the tokenizer at {tokenizer_path or model_path} names one; "
            "responses would never stop before max_tokens"
        )
    return ids
