"""Warm-start a tiny checkpoint to speak in chat turns and tool calls (a few seconds of
supervised steps), so that tests and the tool task see real tool calls from real vLLM.

A random tiny model never writes ``<tool_call>...</tool_call>``; a few hundred full-batch Adam
steps on a handful of conversations (loss on the assistant turns only, each ending on the
end-of-turn token) make it do so reliably. The end-of-turn token then becomes the checkpoint's
EOS (``config.json`` and ``generation_config.json``), so an engine stops each model turn there,
as an instruct model's generation config makes it stop.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["assistant_token_mask", "backward_by_length", "warm_start_chat"]


def assistant_token_mask(
    tokenizer: Any, messages: list[dict[str, Any]], end_of_turn: int
) -> tuple[list[int], list[int]]:
    """The conversation's ids (chat template, no generation prompt) and 1/0 per id: 1 on each
    assistant turn's tokens up to and including its ``end_of_turn`` token."""

    def ids(msgs: list[dict[str, Any]], gen: bool) -> list[int]:
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    full = ids(messages, False)
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(ids(messages[:i], True))
        end = len(ids(messages[: i + 1], False))
        span = full[start:end]
        stop = len(span) - 1 - span[::-1].index(end_of_turn) if end_of_turn in span else len(span)
        for k in range(start, start + stop + 1):
            mask[k] = 1
    return full, mask


def backward_by_length(
    model: Any, input_ids: Any, labels: Any, lengths: Sequence[int], pick: Sequence[int]
) -> float:
    """Backward of the mean loss over the labelled tokens of rows ``pick`` (right-padded
    ``input_ids`` / ``labels``, -100 where unlabelled; ``lengths`` per row): rows of one length
    run together, unpadded, each group's loss weighted by its share of the labelled tokens, so
    the gradient is one padded batch's. Returns the loss."""
    groups: dict[int, list[int]] = {}
    for r in pick:
        groups.setdefault(lengths[r], []).append(r)
    counts = {n: int((labels[g, 1:n] != -100).sum()) for n, g in groups.items()}
    total = sum(counts.values())
    loss = 0.0
    for n, group in groups.items():
        part = model(input_ids=input_ids[group, :n], labels=labels[group, :n]).loss
        part = part * (counts[n] / total)
        part.backward()
        loss += float(part.detach())
    return loss


def warm_start_chat(
    model_dir: str | Path,
    conversations: Sequence[list[dict[str, Any]]],
    *,
    steps: int = 300,
    lr: float = 3e-3,
    seed: int = 0,
    end_of_turn_token: str = "<|im_end|>",
    batch_size: int | None = None,
    threads: int | None = None,
) -> float:
    """Train ``model_dir`` in place on ``conversations`` (fp32 Adam) and make
    ``end_of_turn_token`` its first EOS id. Returns the last step's loss (mean over assistant
    tokens).

    ``batch_size``: step ``s`` takes conversations ``s*batch_size ...`` in order, cycling (None:
    all of them every step); ``threads``: torch threads while training (1 is fastest for a tiny model on shared cores;
    None keeps torch's)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    eot = tokenizer.convert_tokens_to_ids(end_of_turn_token)
    rows = [assistant_token_mask(tokenizer, c, eot) for c in conversations]
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id or 0
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for r, (ids, mask) in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        labels[r, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    size = batch_size or len(rows)
    lengths = [len(ids) for ids, _ in rows]
    loss = 0.0
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads or old_threads)
    try:
        for step in range(steps):
            pick = [(step * size + k) % len(rows) for k in range(size)]
            optimizer.zero_grad()
            loss = backward_by_length(model, input_ids, labels, lengths, pick)
            optimizer.step()
    finally:
        torch.set_num_threads(old_threads)
    model.eval()
    model.save_pretrained(str(model_dir))
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        cfg = json.loads(path.read_text())
        old = cfg.get("eos_token_id")
        old = old if isinstance(old, list) else [] if old is None else [old]
        cfg["eos_token_id"] = [eot, *[i for i in old if i != eot]]
        path.write_text(json.dumps(cfg, indent=2) + "\n")
    return loss
