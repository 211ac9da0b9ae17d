"""A reward model's input: the conversation re-rendered with the reward model's own chat template.

A reward model's tokenizer and chat template may differ from the actor's, so its input is built
from text, as verl 0.9.1's reward loop does for a discriminative reward model
(``RewardLoopWorker._preprocess_reward_inputs``): the response decoded with the actor's
tokenizer, appended to the prompt's messages, rendered by the reward model's template and
tokenised by its tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megarl.data.tokenize import as_messages

__all__ = ["reward_model_input_ids", "reward_model_text"]


def reward_model_text(
    raw_prompt: Any, response_ids: Sequence[int], actor_tokenizer: Any, rm_tokenizer: Any
) -> str:
    """The conversation rendered by the reward model's chat template, with a leading BOS text
    removed.

    The response's valid token ids are decoded with the *actor's* tokenizer (special tokens
    kept) and every occurrence of the actor's EOS text removed; the prompt's raw chat messages (a
    plain-string prompt: one user message) get the response as an ``assistant`` message, and the
    *reward model's* template renders them (``add_generation_prompt=False``).
    """
    response = actor_tokenizer.decode(list(response_ids))
    if actor_tokenizer.eos_token:
        response = response.replace(actor_tokenizer.eos_token, "")
    chat = [
        *as_messages(raw_prompt, "reward model input"),
        {"role": "assistant", "content": response},
    ]
    text = rm_tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
    bos = rm_tokenizer.bos_token
    return text[len(bos) :] if bos and text.startswith(bos) else text


def reward_model_input_ids(
    raw_prompt: Any,
    response_ids: Sequence[int],
    actor_tokenizer: Any,
    rm_tokenizer: Any,
    max_length: int | None = None,
) -> list[int]:
    """The reward model's token ids for one (prompt, response).

    :func:`reward_model_text` tokenised by the reward model's tokenizer adding its special
    tokens: one BOS either way (verl strips the BOS text because vLLM's tokenisation adds it
    back). verl 0.9.1 serves the reward model with vLLM, which has no length option here;
    ``max_length`` (``reward_model.max_length``, from verl's earlier HF reward-model worker) cuts
    a longer input on the right.
    """
    text = reward_model_text(raw_prompt, response_ids, actor_tokenizer, rm_tokenizer)
    ids = list(rm_tokenizer(text, add_special_tokens=True)["input_ids"])
    return ids[:max_length] if max_length is not None else ids
