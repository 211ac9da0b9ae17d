"""The VL actor's training passes on image prompts (test_vision_language.py): the batch, the
single-process transformers reference of the GRPO update, and the worker's cases.

The batch: 4 prompts × 2 responses, right-padded. Prompt 0 has a 56×112 image (8 tokens, two
attention windows), prompt 1 is text only, prompt 2 has two images (28×28, 56×56) and prompt 3
one 28×56 image. Mini-batch 1 (responses 0-3) therefore has a micro-batch without images at
micro-batch size 2 (and at DP 2 a rank whose whole share is text).

The update: ``megarl.trainer.update.update_policy`` (GRPO: vanilla clipped loss with
clip-higher and dual clip, token-mean, entropy bonus, low-var KL loss), 2 mini-batches, AdamW
with Megatron's no-decay groups and clipping, float64; the reference computes the same loss
per mini-batch on ``*ForConditionalGeneration`` in float64 with ``torch.optim.AdamW``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

IMAGES = {0: [(56, 112)], 1: [], 2: [(28, 28), (56, 56)], 3: [(28, 56)]}
"""(height, width) of each prompt's images."""
RESPONSES_PER_PROMPT = 2
SETTINGS = {
    "responses_per_mini_batch": 4,
    "micro_batch_size": 2,
    "entropy_coeff": 0.01,
    "kl_loss_coef": 0.05,
    "temperature": 0.8,
    "clip": {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
             "clip_ratio_c": 3.0},
    "lr": 1e-3, "weight_decay": 0.1, "adam_eps": 1e-5, "clip_grad": 1.0,
}  # fmt: skip


def _prompt(k: int) -> list[dict]:
    items = [{"type": "image"} for _ in IMAGES[k]]
    text = {"type": "text", "text": ["count the", "one two three", "which is larger", "what"][k]}
    return [{"role": "user", "content": [*items, text]}]


def make_training_batch(path: Path) -> dict:
    """The batch's tensors (as plain tensors: ``ImageRows`` fields per row), transformers' fp32
    log-probs and entropies of the response tokens, and old / reference log-probs and GRPO
    advantages that make the clips bite."""
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from megarl.algo import compute_advantage
    from megarl.models.vl_inputs import ImageRows
    from tests.trainer._update_reference import right_padded

    rng = np.random.default_rng(1)
    processor = AutoImageProcessor.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    g = torch.Generator().manual_seed(3)
    prompts, rows_inputs, responses, prompt_ids = [], [], [], []
    for k, sizes in IMAGES.items():
        text = tok.apply_chat_template(_prompt(k), add_generation_prompt=True, tokenize=False)
        inputs = None
        if sizes:
            images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
                      for h, w in sizes]  # fmt: skip
            out = processor(images=images, return_tensors="pt")
            inputs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
            parts = text.split("<|image_pad|>")
            widened = [int(grid.prod()) // 4 for grid in out["image_grid_thw"]]
            text = parts[0] + "".join("<|image_pad|>" * n + p for n, p in zip(widened, parts[1:],
                                                                              strict=True))  # fmt: skip
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for _ in range(RESPONSES_PER_PROMPT):
            prompts.append(ids)
            rows_inputs.append(inputs)
            length = int(torch.randint(2, 7, (1,), generator=g))
            responses.append(torch.randint(5, 900, (length,), generator=g).tolist())
            prompt_ids.append(k)
    images = ImageRows.from_rows(rows_inputs, width=processor_width(rows_inputs))
    b, width = len(responses), max(map(len, responses))
    ids, plen, lens = right_padded(prompts, responses)
    data = {"prompts": prompts, "responses": responses, "prompt_ids": prompt_ids, "ids": ids,
            "plen": plen, "lens": lens, "pixel_values": images.pixel_values,
            "image_grid_thw": images.image_grid_thw, "images_per_row": images.images_per_row,
            "image_token_id": tok.convert_tokens_to_ids("<|image_pad|>")}  # fmt: skip
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logp, entropy, mask = hf_actor_outputs(hf, data, torch.arange(b), width, 1.0)
        data["hf_log_probs"], data["hf_entropy"] = logp, entropy
        logp = hf_actor_outputs(hf, data, torch.arange(b), width, SETTINGS["temperature"])[0]
    noise = torch.randn(b, width, generator=g) * 0.5
    noise[::3] *= 3.0  # some ratios past the dual clip
    data["old_log_probs"] = (logp + noise) * mask
    data["ref_log_probs"] = (logp + 0.1 * torch.randn(b, width, generator=g)) * mask
    rewards = torch.zeros(b, width)
    rewards[torch.arange(b), lens - plen - 1] = torch.rand(b, generator=g)
    data["advantages"], _ = compute_advantage(
        "grpo", token_level_rewards=rewards, response_mask=mask,
        index=torch.tensor(prompt_ids), norm_adv_by_std_in_grpo=True,
    )  # fmt: skip
    data["mask"] = mask
    return data


def processor_width(rows_inputs: list) -> int:
    return next(r["pixel_values"].shape[1] for r in rows_inputs if r)


def image_rows(data: dict):
    from megarl.models.vl_inputs import ImageRows

    return ImageRows(data["pixel_values"], data["image_grid_thw"], data["images_per_row"])


def hf_actor_outputs(hf, data: dict, rows: torch.Tensor, width: int, temperature: float):
    """Log-prob and entropy ``[b, width]`` of every response token of ``rows`` (their images
    along) under transformers' VL model ``hf``, 0 past each response; and the response mask."""
    ids, plen, lens = data["ids"][rows], data["plen"][rows], data["lens"][rows]
    ids = ids[:, : int(lens.max())]
    images = image_rows(data)[rows]
    attention = (torch.arange(ids.shape[1])[None] < lens[:, None]).long()
    dtype = next(hf.parameters()).dtype
    logits = hf(input_ids=ids, attention_mask=attention,
                mm_token_type_ids=(ids == data["image_token_id"]).int(),
                pixel_values=images.pixel_values.to(dtype),
                image_grid_thw=images.image_grid_thw).logits  # fmt: skip
    logp = torch.log_softmax(logits / temperature, dim=-1)
    k = torch.arange(width)[None]
    mask = k < (lens - plen)[:, None]
    pos = (plen[:, None] - 1 + k).clamp(0, ids.shape[1] - 2)
    at_pos = logp.gather(1, pos[..., None].expand(-1, -1, logp.shape[-1]))
    token = at_pos.gather(2, ids.gather(1, pos + 1)[..., None]).squeeze(-1)
    entropy = -(at_pos.exp() * at_pos).sum(-1)
    return token * mask, entropy * mask, mask.to(dtype)


def hf_names(name: str) -> str:
    """transformers 5's module name of a parameter under the checkpoint's (hub) name."""
    for nested, hub in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if name.startswith(nested):
            return hub + name.removeprefix(nested)
    return name


def reference_update(path: str, data: dict, *, frozen: bool) -> tuple[dict, dict]:
    """The GRPO update as one process computes it in float64: per mini-batch, one forward of its
    rows with their images, the loss, backward, clip, AdamW step. ``frozen``: the vision tower
    has no gradient and is not in the optimizer. Returns the weights (hub names) and metrics."""
    from transformers import AutoModelForImageTextToText

    from megarl.algo import agg_loss, compute_policy_loss, kl_penalty

    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float64)
    if frozen:
        hf.model.visual.requires_grad_(False)
    named = {n: p for n, p in hf.named_parameters() if p.requires_grad}
    decay = [p for n, p in named.items() if p.ndim >= 2 and not n.endswith(".bias")]
    no_decay = [p for n, p in named.items() if not (p.ndim >= 2 and not n.endswith(".bias"))]
    s = SETTINGS
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s["weight_decay"]},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=s["lr"], betas=(0.9, 0.999), eps=s["adam_eps"],
    )  # fmt: skip
    width = data["mask"].shape[1]
    counts = {"rollout_is_weights": None, "global_token_count": None, "global_seq_count": None,
              "seq_token_counts": None}  # fmt: skip
    sums = {"pg_loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0, "grad_norm": 0.0}
    minis = torch.arange(len(data["responses"])).split(s["responses_per_mini_batch"])
    for rows in minis:
        logp, entropy, mask = hf_actor_outputs(hf, data, rows, width, s["temperature"])
        pg, metrics = compute_policy_loss(
            "vanilla", old_log_prob=data["old_log_probs"][rows].double(), log_prob=logp,
            advantages=data["advantages"][rows].double(), response_mask=mask,
            loss_agg_mode="token-mean", loss_scale_factor=None, **s["clip"], **counts,
        )  # fmt: skip
        kl = agg_loss(kl_penalty(logp, data["ref_log_probs"][rows].double(), "low_var_kl"), mask,
                      "token-mean")  # fmt: skip
        loss = pg - s["entropy_coeff"] * agg_loss(entropy, mask, "token-mean")
        loss = loss + s["kl_loss_coef"] * kl
        opt.zero_grad()
        loss.backward()
        sums["grad_norm"] += math.sqrt(sum(float((p.grad**2).sum()) for p in named.values()))
        torch.nn.utils.clip_grad_norm_(named.values(), s["clip_grad"])
        opt.step()
        sums["pg_loss"] += float(pg.detach())
        sums["pg_clipfrac"] += float(metrics["pg_clipfrac"])
        sums["ppo_kl"] += float(metrics["ppo_kl"])
    weights = {hf_names(n): p.detach().clone() for n, p in hf.named_parameters()}
    return weights, {k: v / len(minis) for k, v in sums.items()}


# -- the worker's side (inside the 2-rank launch) ------------------------------------------------


def step_batch(data: dict):
    """The batch as the trainer holds it (:class:`~megarl.trainer.batch.StepBatch`)."""
    from megarl.trainer.batch import rollout_batch

    batch = rollout_batch(data["prompts"], data["responses"],
                          [[0.0] * len(r) for r in data["responses"]], data["prompt_ids"],
                          [False] * len(data["responses"]), pad_token_id=0)  # fmt: skip
    batch.images = image_rows(data)
    for name in ("advantages", "old_log_probs", "ref_log_probs"):
        setattr(batch, name, data[name])
    return batch


def log_prob_case(path: str, data: dict, layout) -> dict:
    """fp32 old log-probs and entropies through the runner (``global_log_probs``: each DP rank
    its share, micro-batches of 2), and at DP 1 once more with explicit micro-batches that take
    the rows out of order; the largest differences from transformers'."""
    from megarl.models import vision_language as vl
    from megarl.models.runner import SequenceBatch, compute_log_probs
    from megarl.models.vl_inputs import IMAGES
    from megarl.trainer.passes import global_log_probs

    model = vl.build_vision_language_model(path, layout)
    batch = step_batch(data)
    vocab = model.language.dims.vocab_size
    logp, entropy, _ = global_log_probs(model.language.chunks, batch, vocab_size=vocab,
                                        temperature=1.0, micro_batches=2)  # fmt: skip
    out = {"log_prob_diff": float((logp - data["hf_log_probs"]).abs().max()),
           "entropy_diff": float((entropy - data["hf_entropy"]).abs().max())}  # fmt: skip
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_world_size() == 1:
        seqs = SequenceBatch(batch.input_ids, batch.prompt_lengths, batch.lengths,
                             extra={IMAGES: batch.images})  # fmt: skip
        order = [torch.tensor([5, 0, 3]), torch.tensor([7, 2]), torch.tensor([4, 1, 6])]
        got = compute_log_probs(model.language.chunks, seqs, vocab_size=vocab,
                                micro_batches=order)  # fmt: skip
        w = got.log_probs.shape[1]
        diff = got.log_probs - data["hf_log_probs"][:, :w]
        out["shuffled_log_prob_diff"] = float(diff.abs().max())
    return out


def update_case(path: str, data: dict, layout, *, frozen: bool) -> dict:
    """The GRPO update (float64) through ``update_policy``; every weight afterwards in hub names
    (rank 0 of the first stage's tower), the metrics, and whether the tower's replicas (over TP
    and DP) are bit-identical."""
    import torch.distributed as dist

    from megarl.models import vision_language as vl
    from megarl.models.trainable import OptimizerSettings, TrainableModel
    from megarl.trainer.update import PolicyUpdate, update_policy
    from tests.trainer._update_worker import _enter_weight_read, _hf_weights

    s = SETTINGS
    model = vl.build_vision_language_model(path, layout, dtype=torch.float64,
                                           freeze_vision_tower=frozen)  # fmt: skip
    actor = TrainableModel(model.language, OptimizerSettings(
        lr=s["lr"], weight_decay=s["weight_decay"], eps=s["adam_eps"], clip_grad=s["clip_grad"],
        grad_reduce_in_fp32=False, use_distributed_optimizer=False, ddp_bucket_size=20_000,
    ))  # fmt: skip
    in_optimizer = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
    tower_in_optimizer = model.vision is not None and any(
        id(p) in in_optimizer for p in model.vision.parameters()
    )
    update = PolicyUpdate(
        responses_per_mini_batch=s["responses_per_mini_batch"],
        micro_batch_size=s["micro_batch_size"], entropy_coeff=s["entropy_coeff"],
        use_kl_loss=True, kl_loss_coef=s["kl_loss_coef"], kl_loss_type="low_var_kl",
        temperature=s["temperature"], balance=False, policy_loss_kwargs=s["clip"],
    )  # fmt: skip
    vocab = model.language.dims.vocab_size
    metrics = update_policy(actor, step_batch(data), update, vocab_size=vocab, seed=0,
                            step=1).metrics  # fmt: skip
    _enter_weight_read(actor)
    weights = _hf_weights(actor.chunks, model.language.dims)
    tower = {} if model.vision is None else {
        f"visual.{n}": t.detach().clone() for n, t in model.vision.state_dict().items()
    }  # fmt: skip
    towers: list = [None] * dist.get_world_size()
    dist.all_gather_object(towers, tower)
    held = [t for t in towers if t]
    identical = all(torch.equal(t[n], held[0][n]) for t in held for n in held[0])
    flags: list = [None] * dist.get_world_size()
    dist.all_gather_object(flags, tower_in_optimizer)
    weights.update(held[0])
    return {"weights": weights, "metrics": metrics, "tower_replicas_identical": identical,
            "tower_in_optimizer": [f for f, t in zip(flags, towers, strict=True) if t]}  # fmt: skip
