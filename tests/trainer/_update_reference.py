"""The single-process references of the update-equivalence tests
(``tests/trainer/test_update_equivalence.py``, ``test_lora_update.py``): the actor's and the
critic's update written in one process from ``transformers``' model (float64) and
``megarl.algo``'s functions, a plain loop over the mini-batches."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

ADAM_EPS = 1e-5
"""Adam's first step moves a weight by lr·g/(|g| + eps), which turns rounding noise in gradients
near eps into weight differences: with eps 1e-8, single elements of 32768 moved by ~1e-4
(HF vs Megatron); with 1e-6, fp32 at TP2·DP2 with the distributed optimizer vs fp32 at (1,1,1)
differed by 1.2e-5. eps 1e-5 keeps the comparison well conditioned and still exercises the
decay groups (lr·wd·w = 1e-4·w), bias correction and clipping."""


def _positions(
    plen: torch.Tensor, lens: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.arange(width)[None]
    mask = k < (lens - plen)[:, None]
    return (plen[:, None] - 1 + k).clamp(min=0), mask


def right_padded(prompts: list[list[int]], responses: list[list[int]]):
    """Token ids ``[b, s]`` of each prompt followed by its response, right-padded with 0, and the
    prompt and whole lengths ``[b]``."""
    seq = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    ids = torch.zeros(len(responses), seq, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
    plen = torch.tensor([len(p) for p in prompts])
    return ids, plen, plen + torch.tensor([len(r) for r in responses])


def _actor_outputs(hf, ids, plen, lens, width, temperature, router=None, at_ids=None):
    """Log-prob and entropy of every response token under ``hf`` at ``temperature``; a MoE
    model's router logits per layer (``[B·S, E]``) go into the list ``router`` when given; with
    ``at_ids`` ``[B, R, K]`` also the log-probs at those ids at each response position."""
    out = hf(ids, output_router_logits=True) if router is not None else hf(ids)
    if router is not None:
        router.extend(out.router_logits)
    logits = out.logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    pos, mask = _positions(plen, lens, width)
    pos = pos.clamp(max=ids.shape[1] - 2)
    targets = ids.gather(1, pos + 1)
    at_pos = logp.gather(1, pos[..., None].expand(-1, -1, logp.shape[-1]))
    token_logp = at_pos.gather(2, targets[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1).gather(1, pos)
    if at_ids is not None:  # and which of them are among the model's own top K there
        own = at_pos.topk(at_ids.shape[-1], dim=-1).indices
        in_own = (at_ids[..., :, None] == own[..., None, :]).any(-1).double()
        return token_logp * mask, entropy * mask, mask.float(), at_pos.gather(2, at_ids), in_own
    return token_logp * mask, entropy * mask, mask.float()


LOCAL_COUNTS = {
    "rollout_is_weights": None,
    "global_token_count": None,
    "global_seq_count": None,
    "seq_token_counts": None,
}
"""The reference holds the whole mini-batch: its own token and sequence counts (None: the loss
counts them) are the global ones."""


def _router_losses(router: list, lens: torch.Tensor, seq: int, micro: int) -> dict:
    """The routers' auxiliary losses of one mini-batch as Megatron defines them, from the Switch
    Transformer / ST-MoE formulas: per micro-batch (``micro`` consecutive sequences) and layer,
    over the micro-batch's T tokens without padding, load balancing E/(k·T²)·Σ_e P_e·N_e (P_e the
    summed softmax probability of expert e, N_e the tokens routing to it among their top k) and
    z-loss mean_t logsumexp(logits_t)²; each micro-batch weighted by T / (the mini-batch's
    tokens); summed over layers (the objective) and averaged over them (the metric)."""
    valid = (torch.arange(seq)[None] < lens[:, None]).reshape(-1)
    rows = torch.arange(len(lens)).repeat_interleave(seq)
    total, k = float(lens.sum()), 2  # the tiny MoE's top-k
    out = {"aux": torch.zeros((), dtype=torch.float64), "z": torch.zeros((), dtype=torch.float64)}
    for logits in router:
        for start in range(0, len(lens), micro):
            pick = valid & (rows >= start) & (rows < start + micro)
            lg = logits[pick].double()
            t, e = lg.shape
            probs = torch.softmax(lg, dim=-1)
            chosen = torch.zeros_like(probs).scatter(1, probs.topk(k, dim=1).indices, 1.0)
            aux = e / (k * t * t) * (probs.sum(0) * chosen.sum(0)).sum()
            z = (torch.logsumexp(lg, dim=-1) ** 2).mean()
            out["aux"] = out["aux"] + t / total * aux
            out["z"] = out["z"] + t / total * z
    return out


def reference_update(spec: dict, data: dict, case: dict, optimizer: str, model: str = ""):
    """The update as one process computes it: per mini-batch, full forward, loss, step."""
    from transformers import AutoModelForCausalLM

    from megarl.algo import agg_loss, compute_policy_loss, kl_penalty
    from megarl.algo.distillation import combined_loss

    # float64: the comparison then measures megarl's fp32 error, not the sum of two fp32
    # implementations' errors (HF's sdpa attention and Megatron's local spec round differently).
    # A MoE model with the eager experts: transformers' grouped GEMM refuses float64.
    moe = {"experts_implementation": "eager"} if model else {}
    hf = AutoModelForCausalLM.from_pretrained(model or spec["model"], dtype=torch.float64, **moe)
    coeffs = case.get("moe", {})
    named = dict(hf.named_parameters())
    if optimizer == "sgd":
        opt = torch.optim.SGD(named.values(), lr=1.0)
    else:
        decay = [p for n, p in named.items() if p.ndim >= 2 and not n.endswith(".bias")]
        no_decay = [p for n, p in named.items() if not (p.ndim >= 2 and not n.endswith(".bias"))]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=1e-3, betas=(0.9, 0.999), eps=ADAM_EPS,
        )  # fmt: skip
    mode, width = case["loss_agg_mode"], data["mask"].shape[1]
    scale = {"loss_scale_factor": case.get("loss_scale_factor")}
    sums = {"pg_loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0, "grad_norm": 0.0}
    sums.update({"moe_aux_loss": 0.0, "moe_z_loss": 0.0} if coeffs else {})
    per_mini = case.get("responses_per_mini_batch", spec["responses_per_mini_batch"])
    minis = torch.arange(len(data["responses"])).split(per_mini)
    for rows in minis:
        router: list | None = [] if coeffs else None
        ids = data["ids"][rows]
        distill = case.get("distillation")
        logp, entropy, mask, *at = _actor_outputs(
            hf, ids, data["plen"][rows], data["lens"][rows], width, spec["temperature"], router,
            data["teacher_topk_ids"][rows] if distill else None,
        )  # fmt: skip
        advantages = data["advantages"][rows]
        if case.get("multi_turn"):  # the model's tokens only
            mask, advantages = data["mt_mask"][rows].double(), data["mt_advantages"][rows]
        old = data["old_log_probs"][rows].double()
        pg, pg_metrics = compute_policy_loss(
            "vanilla", old_log_prob=old, log_prob=logp,
            advantages=advantages.double(), response_mask=mask, loss_agg_mode=mode,
            **spec["clip"], **scale, **LOCAL_COUNTS,
        )  # fmt: skip
        ref = data["ref_log_probs"][rows].double()
        kl = agg_loss(kl_penalty(logp, ref, "low_var_kl"), mask, mode, **scale)
        ent = agg_loss(entropy, mask, mode, **scale)
        loss = pg - spec["entropy_coeff"] * ent + spec["kl_loss_coef"] * kl
        if distill:
            share, tokens = _distillation_share(distill, spec, logp, old, mask, at[0], data, rows)
            loss = combined_loss(
                loss,
                share,
                use_task_rewards=distill["use_task_rewards"],
                distillation_loss_coef=distill.get("distillation_loss_coef", 1.0),
            )
            sums["distillation/loss"] = sums.get("distillation/loss", 0.0) + float(share)
            divergence = float((tokens.detach() * mask).sum() / mask.sum())
            sums["distillation/divergence"] = sums.get("distillation/divergence", 0.0) + divergence
            for key, value in _distillation_metrics(distill, logp, mask, *at, data, rows).items():
                sums[key] = sums.get(key, 0.0) + value
        if coeffs:
            terms = _router_losses(
                router, data["lens"][rows], ids.shape[1], spec["micro_batch_size"]
            )
            loss = loss + coeffs["moe_aux_loss_coeff"] * terms["aux"]
            loss = loss + coeffs["moe_z_loss_coeff"] * terms["z"]
            sums["moe_aux_loss"] += float(terms["aux"].detach()) / len(router)
            sums["moe_z_loss"] += float(terms["z"].detach()) / len(router)
        opt.zero_grad()
        loss.backward()
        norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in named.values()))
        if optimizer == "adamw":
            torch.nn.utils.clip_grad_norm_(named.values(), 1.0)
        opt.step()
        sums["pg_loss"] += float(pg.detach())
        sums["pg_clipfrac"] += float(pg_metrics["pg_clipfrac"])
        sums["ppo_kl"] += float(pg_metrics["ppo_kl"])
        sums["grad_norm"] += norm
    means = {k: v / len(minis) for k, v in sums.items()}
    if "overlapping" in means:  # the mean over the tokens where the top-k overlap
        a, b = means.pop("overlap_advantage"), means.pop("overlapping")
        means["distillation/overlap_token_advantage"] = a / b if b else 0.0
    return _checkpoint_names({n: p.detach().float().clone() for n, p in named.items()}), means


def _distillation_share(distill, spec, logp, old, mask, student_at, data, rows):
    """A mini-batch's distillation loss and its per-token divergences to the teacher: those
    aggregated (supervised), or the vanilla clipped loss with advantage = -divergence (policy
    gradient)."""
    from megarl.algo import agg_loss, compute_policy_loss
    from megarl.algo.distillation import distillation_token_losses

    tokens = distillation_token_losses(
        distill["loss_mode"], student_log_probs=logp,
        teacher_log_probs=data["teacher_log_probs"][rows].double(),
        student_topk_log_probs=student_at,
        teacher_topk_log_probs=data["teacher_topk_log_probs"][rows].double(),
        log_prob_min_clamp=distill.get("log_prob_min_clamp"),
        loss_max_clamp=distill.get("loss_max_clamp"),
    )  # fmt: skip
    if not distill.get("use_policy_gradient"):
        return agg_loss(tokens, mask, "token-mean"), tokens
    share, _ = compute_policy_loss(
        "vanilla", old_log_prob=old, log_prob=logp, advantages=-tokens.detach(),
        response_mask=mask, loss_agg_mode="token-mean", clip_ratio=0.2, clip_ratio_low=0.2,
        clip_ratio_high=0.2, clip_ratio_c=spec["clip"]["clip_ratio_c"], loss_scale_factor=None,
        **LOCAL_COUNTS,
    )  # fmt: skip
    return share, tokens


def _distillation_metrics(distill, logp, mask, student_at, in_own, data, rows) -> dict:
    """A mini-batch's distillation metrics besides the loss and the divergence, as token means
    written out here: the teacher's and the student's probability on the teacher's top-k (before
    any clamp), the share of the teacher's top-k among the student's own, the clamps' shares (the
    tokens whose loss loss_max_clamp cut; the student's top-k log-probs under the floor); and
    the two sums of the mean over the overlapping tokens of -sum_{k shared} q_k (log q_k -
    log p_k) (the log-probs floored first)."""
    from megarl.algo.distillation import distillation_token_losses

    n = mask.sum()

    def mean(values):
        return float((values * mask).sum() / n)

    teacher_at = data["teacher_topk_log_probs"][rows].double()
    out = {}
    if distill["loss_mode"] == "forward_kl_topk":
        out["distillation/student_mass"] = mean(student_at.exp().sum(-1))
        out["distillation/teacher_mass"] = mean(teacher_at.exp().sum(-1))
        out["distillation/overlap_ratio"] = mean(in_own.sum(-1) / in_own.shape[-1])
        s, t, floor = student_at.detach(), teacher_at, distill.get("log_prob_min_clamp")
        if floor is not None:
            out["distillation/log_prob_clamp_fraction"] = mean((s < floor).double().mean(-1))
            s, t = s.clamp_min(floor), t.clamp_min(floor)
        count = in_own.sum(-1)
        per_token = (-(t.exp() * (t - s)) * in_own).sum(-1) / count.clamp_min(1)
        out["overlap_advantage"] = mean(per_token * (count > 0))
        out["overlapping"] = mean((count > 0).double())
    clamp = distill.get("loss_max_clamp")
    if clamp is not None:
        raw = distillation_token_losses(
            distill["loss_mode"], student_log_probs=logp.detach(),
            teacher_log_probs=data["teacher_log_probs"][rows].double(),
        )  # fmt: skip
        out["distillation/loss_clamp_fraction"] = mean((raw.abs() > clamp).double())
    return out


def _checkpoint_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused in-memory experts (``experts.gate_up_proj [E, 2I, H]``, gate rows
    first, and ``experts.down_proj [E, H, I]``) under the checkpoint's per-expert names."""
    out = {}
    for name, t in weights.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith("mlp.experts") and leaf in ("gate_up_proj", "down_proj"):
            for e, w in enumerate(t):
                if leaf == "down_proj":
                    out[f"{prefix}.{e}.down_proj.weight"] = w
                else:
                    gate, up = w.chunk(2, dim=0)
                    out[f"{prefix}.{e}.gate_proj.weight"] = gate
                    out[f"{prefix}.{e}.up_proj.weight"] = up
        else:
            out[name] = t
    return out


def reference_critic_update(spec: dict, data: dict) -> tuple[dict, float]:
    """The critic's SGD update (lr 1) as one process computes it in float64: transformers'
    decoder, the value head megarl seeds (``ValueHead``'s draw), per mini-batch the clipped value
    loss over the whole mini-batch (token-mean), backward, step. Returns the weights (HF names,
    the head as ``score.weight``) and the mean ``vf_loss``."""
    from transformers import AutoModelForCausalLM

    from megarl.algo.value_loss import compute_value_loss
    from megarl.models.gpt import ValueHead

    hf = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float64)
    head = ValueHead(hf.config.hidden_size, torch.float64, seed=spec["value_head_seed"])
    params = {
        **{f"model.{n}": p for n, p in hf.model.named_parameters()},
        "score.weight": head.weight,
    }
    opt = torch.optim.SGD(params.values(), lr=1.0)
    width, losses = data["mask"].shape[1], []
    for rows in torch.arange(len(data["responses"])).split(spec["responses_per_mini_batch"]):
        ids, plen, lens = data["ids"][rows], data["plen"][rows], data["lens"][rows]
        hidden = hf.model(ids).last_hidden_state
        values = head(hidden)[0].squeeze(-1)  # [b, S]: the value of the state after each token
        pos, mask = _positions(plen, lens, width)
        vpreds = values.gather(1, pos.clamp(max=ids.shape[1] - 1)) * mask
        loss, _ = compute_value_loss(
            vpreds, data["returns"][rows].double(), data["values"][rows].double(), mask.double(),
            cliprange_value=spec["cliprange_value"], loss_agg_mode="token-mean",
        )  # fmt: skip
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    weights = {n: p.detach().float().clone() for n, p in params.items()}
    return _checkpoint_names(weights), sum(losses) / len(losses)


class _MergedLora:
    """An HF model run with LoRA as merged weights, ``W + scaling · B A`` recomputed from leaf
    adapter tensors at every call (``torch.func.functional_call``), so their gradients are the
    LoRA gradients: no ``peft``, and transformers' fused MoE experts (``gate_up_proj [E, 2I, H]``,
    gate rows first; ``down_proj [E, H, I]``) take per-expert adapters. ``adapters`` are PEFT
    names (``base_model.model.<module>.lora_A.weight``, per-expert modules
    ``mlp.experts.{e}.gate_proj``); the A of q/k/v (an expert's gate/up) must be one tensor, and
    is one leaf, as megarl's fused linear has one A."""

    def __init__(self, hf, adapters: dict[str, torch.Tensor], scaling: float) -> None:
        self.hf, self.scaling = hf, scaling
        self.params: dict[str, torch.Tensor] = {}  # leaf name -> tensor
        self.modules: dict[str, tuple[str, str]] = {}  # HF module -> (A leaf, B leaf)
        for key, b in adapters.items():
            if ".lora_B." not in key:
                continue
            module = key.removeprefix("base_model.model.").split(".lora_B.")[0]
            head, leaf = module.rsplit(".", 1)
            fused = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "fc1",
                     "up_proj": "fc1"}.get(leaf, leaf)  # fmt: skip
            a_leaf = f"{head}.{fused}.A"
            a = adapters[key.replace(".lora_B.", ".lora_A.")].double()
            if a_leaf in self.params:
                assert torch.equal(self.params[a_leaf].detach(), a), key  # one shared A
            else:
                self.params[a_leaf] = a.clone().requires_grad_()
            self.params[f"{module}.B"] = b.double().clone().requires_grad_()
            self.modules[module] = (a_leaf, f"{module}.B")
        self.base = {n: p.detach() for n, p in hf.named_parameters()}

    def _delta(self, module: str) -> torch.Tensor:
        a, b = self.modules[module]
        return self.params[b] @ self.params[a] * self.scaling

    def merged(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, w in self.base.items():
            head, leaf = name.rsplit(".", 1)
            if leaf == "weight" and head in self.modules:
                out[name] = w + self._delta(head)
            elif head.endswith("mlp.experts") and f"{head}.0.down_proj" in self.modules:
                n = w.shape[0]
                if leaf == "gate_up_proj":
                    deltas = [torch.cat([self._delta(f"{head}.{e}.gate_proj"),
                                         self._delta(f"{head}.{e}.up_proj")]) for e in range(n)]  # fmt: skip
                else:
                    deltas = [self._delta(f"{head}.{e}.down_proj") for e in range(n)]
                out[name] = w + torch.stack(deltas)
        return out

    def __call__(self, ids, **kwargs):
        return torch.func.functional_call(self.hf, self.merged(), (ids,), kwargs, strict=False)

    def peft_state(self) -> dict[str, torch.Tensor]:
        """The adapters in ``adapters``' PEFT names (each projection its fused linear's A)."""
        out = {}
        for module, (a, b) in self.modules.items():
            out[f"base_model.model.{module}.lora_A.weight"] = self.params[a].detach().clone()
            out[f"base_model.model.{module}.lora_B.weight"] = self.params[b].detach().clone()
        return out


def reference_lora_steps(model, params: list, spec: dict, data: dict, optimizer: dict) -> list:
    """GRPO actor mini-batch steps of ``model`` (a float64 LoRA model: only ``params``, each
    leaf once, train) on the fixed batch: per mini-batch the loss (vanilla policy loss, low-var
    KL to the batch's reference, entropy bonus; token-mean), backward, the gradient norm,
    clipping (``optimizer["clip"]`` > 0) and an SGD or AdamW step (``{"name", "lr", "clip"}``).
    Returns each mini-batch's gradient norm."""
    from megarl.algo import agg_loss, compute_policy_loss, kl_penalty

    if optimizer["name"] == "sgd":
        opt = torch.optim.SGD(params, lr=optimizer["lr"])
    else:
        opt = torch.optim.AdamW(params, lr=optimizer["lr"], betas=(0.9, 0.999), eps=ADAM_EPS,
                                weight_decay=0.1)  # fmt: skip
    width, norms = data["mask"].shape[1], []
    for rows in torch.arange(len(data["responses"])).split(spec["responses_per_mini_batch"]):
        logp, entropy, mask = _actor_outputs(model, data["ids"][rows], data["plen"][rows],
                                             data["lens"][rows], width, spec["temperature"])  # fmt: skip
        pg, _ = compute_policy_loss(
            "vanilla", old_log_prob=data["old_log_probs"][rows].double(), log_prob=logp,
            advantages=data["advantages"][rows].double(), response_mask=mask,
            loss_agg_mode="token-mean", loss_scale_factor=None, **spec["clip"], **LOCAL_COUNTS,
        )  # fmt: skip
        kl = agg_loss(kl_penalty(logp, data["ref_log_probs"][rows].double(), "low_var_kl"),
                      mask, "token-mean")  # fmt: skip
        ent = agg_loss(entropy, mask, "token-mean")
        loss = pg - spec["entropy_coeff"] * ent + spec["kl_loss_coef"] * kl
        opt.zero_grad()
        loss.backward()
        norms.append(math.sqrt(sum(float((p.grad**2).sum()) for p in params)))
        if optimizer["clip"] > 0:
            torch.nn.utils.clip_grad_norm_(params, optimizer["clip"])
        opt.step()
    return norms


def reference_lora_update(
    spec: dict, data: dict, model: str, adapters: dict, scaling: float, optimizer: dict
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """A GRPO actor update over LoRA adapters only, in float64 (any dense or MoE model of
    transformers; merged-weight LoRA, :class:`_MergedLora`): per mini-batch the whole
    mini-batch's loss, backward, the gradient norm (each leaf once), clipping (``clip`` > 0)
    and an SGD or AdamW step. ``optimizer``: ``{"name", "lr", "clip"}``. Returns the adapters
    after (PEFT names) and each mini-batch's gradient norm."""
    from transformers import AutoModelForCausalLM

    config = json.loads((Path(model) / "config.json").read_text())
    moe = {"experts_implementation": "eager"} if config.get("num_experts") else {}
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64, **moe)
    hf.requires_grad_(False)
    lora = _MergedLora(hf, adapters, scaling)
    params = list(lora.params.values())
    norms = reference_lora_steps(lora, params, spec, data, optimizer)
    return lora.peft_state(), norms
