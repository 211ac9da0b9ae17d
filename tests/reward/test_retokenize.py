"""A reward model with its own chat template gets the conversation re-rendered (verl 0.9.1's
reward loop): the raw prompt messages plus the decoded response, EOS text removed."""

from __future__ import annotations

import copy

import pytest

from megarl.reward.retokenize import reward_model_input_ids, reward_model_text

RM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }}{% endif %}{% endfor %}"
)
MESSAGES = [{"role": "user", "content": "what is 3 plus 4 ?"}]


@pytest.fixture(scope="module")
def rm_tokenizer(tokenizer):
    rm = copy.deepcopy(tokenizer)
    rm.chat_template = RM_TEMPLATE
    return rm


def test_response_is_rendered_with_the_reward_models_template(tokenizer, rm_tokenizer):
    response = [*tokenizer.encode("the answer is 7 ."), tokenizer.eos_token_id]
    text = reward_model_text(MESSAGES, response, tokenizer, rm_tokenizer)
    # the actor's ChatML markers are gone; the EOS text is removed; the template's BOS is
    # stripped (vLLM's tokenisation would add it back: the tokenizer decides)
    assert text == "[INST] what is 3 plus 4 ? [/INST] the answer is 7 ."
    ids = reward_model_input_ids(MESSAGES, response, tokenizer, rm_tokenizer)
    assert ids == rm_tokenizer(text, add_special_tokens=True)["input_ids"]
    assert rm_tokenizer.decode(ids) == text


def test_a_string_prompt_is_one_user_message_and_max_length_cuts_on_the_right(
    tokenizer, rm_tokenizer
):
    response = tokenizer.encode("seven")  # truncated: no EOS
    full = reward_model_input_ids("what is 3 plus 4 ?", response, tokenizer, rm_tokenizer)
    assert rm_tokenizer.decode(full) == "[INST] what is 3 plus 4 ? [/INST] seven"
    cut = reward_model_input_ids("what is 3 plus 4 ?", response, tokenizer, rm_tokenizer, 5)
    assert cut == full[:5]


def test_same_template_gives_the_assistant_turn_closed(tokenizer):
    response = [*tokenizer.encode("7"), tokenizer.eos_token_id]
    text = reward_model_text(MESSAGES, response, tokenizer, tokenizer)
    assert text == (
        "<|im_start|>user\nwhat is 3 plus 4 ?<|im_end|>\n<|im_start|>assistant\n7<|im_end|>\n"
    )
