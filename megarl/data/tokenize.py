"""Prompt tokenisation as verl does it, and ``max_prompt_length`` truncation.

A chat prompt (``{"role", "content"}`` messages; a plain string becomes one user message) is
rendered with the tokenizer's chat template to text (``add_generation_prompt=True``) and that
text tokenised with ``add_special_tokens=False``: a template that writes BOS itself (Llama 3)
gets exactly one BOS. With ``data.use_chat_template=false`` a plain-string prompt is tokenised as
it is (no template, no special tokens added).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "ChatTemplateMissing",
    "PromptTooLong",
    "as_messages",
    "is_blank_prompt",
    "render_prompts",
    "tokenize_prompts",
    "truncate",
]

TRUNCATION_MODES = ("error", "left", "right", "middle")


class PromptTooLong(ValueError):
    """A prompt exceeds ``data.max_prompt_length`` under ``data.truncation=error``."""


class ChatTemplateMissing(ValueError):
    """Chat prompts, but the tokenizer has no chat template."""


def as_messages(prompt: Any, where: str) -> list[dict[str, Any]]:
    """The chat messages of a prompt cell: a message list, or a string as one user message.
    A message without a ``role`` is refused naming ``where`` (the file and row)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, Sequence) and all(isinstance(m, dict) for m in prompt) and prompt:
        # parquet fills keys that other messages have with None: drop them again
        messages = [{k: v for k, v in m.items() if v is not None} for m in prompt]
        for i, message in enumerate(messages):
            if "role" not in message:
                raise ValueError(
                    f"{where}: message {i} of the prompt has no 'role' (chat messages are "
                    f"{{'role': ..., 'content': ...}}), got {message!r:.80}"
                )
        return messages
    raise ValueError(
        f"{where}: the prompt must be a list of chat messages or a string, got {prompt!r:.80}"
    )


def is_blank_prompt(prompt: Any) -> bool:
    """The prompt cell has no text: an empty or whitespace-only string, or chat messages whose
    every text content is (verl trains on it as it is)."""
    if isinstance(prompt, str):
        return not prompt.strip()
    if isinstance(prompt, Sequence) and prompt:
        contents = [m.get("content") for m in prompt if isinstance(m, dict)]
        return len(contents) == len(prompt) and all(
            isinstance(c, str | None) and not (c or "").strip() for c in contents
        )
    return False


def render_prompts(
    tokenizer: Any,
    prompts: Sequence[Any],
    wheres: Sequence[str],
    *,
    use_chat_template: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[str]:
    """The text each prompt is tokenised from (chat template applied unless told otherwise)."""
    if not use_chat_template:
        bad = [w for p, w in zip(prompts, wheres, strict=True) if not isinstance(p, str)]
        if bad:
            raise ValueError(
                f"{bad[0]}: a chat-message prompt needs data.use_chat_template=true "
                "(false tokenises plain-string prompts only)"
            )
        return list(prompts)
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ChatTemplateMissing(
            f"the tokenizer {name!r} has no chat template; give it one, or set "
            "data.use_chat_template=false to tokenise plain-string prompts as they are"
        )
    kwargs = dict(chat_template_kwargs or {})
    for key in ("tokenize", "return_dict", "return_tensors", "add_generation_prompt"):
        kwargs.pop(key, None)
    return [
        tokenizer.apply_chat_template(
            as_messages(p, w), add_generation_prompt=True, tokenize=False, **kwargs
        )
        for p, w in zip(prompts, wheres, strict=True)
    ]


def tokenize_prompts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of rendered prompt texts, without special tokens (one batched call)."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def truncate(ids: list[int], max_length: int, mode: str, where: str) -> list[int]:
    """``ids`` cut to ``max_length`` tokens by ``mode`` (verl's ``data.truncation``).

    ``left`` keeps the last tokens, ``right`` the first, ``middle`` the first ``max // 2`` and
    the last ``max - max // 2``; ``error`` raises :class:`PromptTooLong` naming the row.
    """
    if len(ids) <= max_length:
        return ids
    if mode == "left":
        return ids[-max_length:]
    if mode == "right":
        return ids[:max_length]
    if mode == "middle":
        head = max_length // 2
        tail = max_length - head
        return ids[:head] + (ids[-tail:] if tail else [])
    if mode == "error":
        raise PromptTooLong(
            f"{where}: the prompt has {len(ids)} tokens, more than data.max_prompt_length="
            f"{max_length} (data.truncation=error; set data.truncation=left|right|middle or "
            "data.filter_overlong_prompts=true)"
        )
    raise ValueError(f"data.truncation={mode!r} is not one of {', '.join(TRUNCATION_MODES)}")
