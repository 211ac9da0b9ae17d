"""Parallel equivalence of the actor update: every layout computes what the math says.

A fixed batch (tokens, advantages, old and reference log-probs) goes through one actor update —
2 mini-batches, each of ≥ 2 micro-batches per rank, entropy bonus and KL loss on, clip-higher
and dual-clip active on some tokens — at (TP,PP,DP) = (1,1,1), (2,1,1), (1,2,1), (1,1,2),
(2,1,2) with the distributed optimizer, (2,2,1) and (1,2,1) with VPP 2, and (1,2,1) with the
layers split 1 + 3 over the stages (``num_layers_in_first_pipeline_stage``). The reference is
written in one process (``tests/trainer/_update_reference.py``) from ``transformers``' model and
``megarl.algo``'s functions: a plain loop over the mini-batches, each one forward over the whole
mini-batch, its loss, backward and an optimizer step. Compared: (a) SGD with lr 1 (the weight
change is the reduced gradient) and the grad norm, (b) AdamW with Megatron's no-decay groups
(biases and 1-D parameters) and clipping, (c) ``actor/pg_loss``, ``pg_clipfrac``, ``ppo_kl``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_torchrun
from tests.trainer._update_reference import (
    ADAM_EPS,
    _actor_outputs,
    reference_critic_update,
    reference_update,
    right_padded,
)

WORKER = Path(__file__).with_name("_update_worker.py")
pytestmark = pytest.mark.multirank

N_PROMPTS, N = 4, 4
TOPK = 5
"""The distillation cases' teacher top-k."""
DISTILL_CASES = [
    {
        "name": name, "loss_agg_mode": "token-mean", "dynamic": False,
        "optimizers": ["sgd"], "distillation": distillation, "responses_per_mini_batch": 16,
        "layouts": ["tp2_pp1_vpp1_dp1", "tp1_pp2_vpp1_dp1_packed",
                    "tp1_pp1_vpp1_cp2_dp1_packed", "tp2_pp2_vpp1_dp1_packed_sp"],
    }
    for name, distillation in (
        ("distill-topk", {"loss_mode": "forward_kl_topk", "use_task_rewards": False,
                          "log_prob_min_clamp": -7.0}),
        ("distill-k3-task", {"loss_mode": "k3", "use_task_rewards": True,
                             "distillation_loss_coef": 0.5, "loss_max_clamp": 0.3}),
        ("distill-k1-pg", {"loss_mode": "k1", "use_task_rewards": False,
                           "use_policy_gradient": True}),
    )
]  # fmt: skip
"""On-policy distillation (issue 57): the teacher's scores of the batch (sampled-token log-probs,
and a top-k of ids over the whole vocabulary with their log-probs), the student's loss at TP 2, PP
2, CP 2 and TP 2 × PP 2 (SGD, lr 1, one mini-batch of all 16 responses: the weight change is the
gradient at the initial weights). forward_kl_topk (the
student's log-probs at the ids: vocab-parallel at TP 2) with a floor that bites; k3 with a clamp
that bites, combined with the task's loss; k1 through the policy gradient."""
SPEC = {
    "responses_per_mini_batch": 8,  # 2 prompts × 4: two mini-batches
    "micro_batch_size": 2,  # per DP rank: 4 (DP 1) or 2 (DP 2) micro-batches
    "max_token_len": 30,  # dynamic case: micro-batches packed to 30 tokens
    "entropy_coeff": 0.01,
    "kl_loss_coef": 0.05,
    "temperature": 0.8,
    "clip": {
        "clip_ratio": 0.2,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
        "clip_ratio_c": 3.0,
    },
    "cases": [
        {"name": "token-mean", "loss_agg_mode": "token-mean", "dynamic": False},
        {
            "name": "seq-mean-token-mean-dyn",
            "loss_agg_mode": "seq-mean-token-mean",
            "dynamic": True,
        },
        # Dr.GRPO: the normaliser is the constant response length the trainer passes (setup's
        # policy_update), never a micro-batch's padded width (which differs per micro-batch, DP
        # share and step). SGD only: the gradient is what the normaliser changes.
        {
            "name": "seq-mean-token-sum-norm",
            "loss_agg_mode": "seq-mean-token-sum-norm",
            "loss_scale_factor": 16.0,
            "dynamic": False,
            "optimizers": ["sgd"],
        },
        # Multi-turn responses (issue 43): a tool turn inside each response of 3+ tokens,
        # response_mask 0 there, the advantages computed on that mask; at TP 2, PP 2 and DP 2
        # (packed rows: the DP shares' token counts exclude the tool tokens). With
        # seq-mean-token-mean the three layouts agreed with each other to 1e-12 but mini-batch 2's
        # ppo_kl differed from the float64 reference by 4.1e-6 (limit 1e-6) at all three alike
        # (after an lr-1 SGD step from weights 1.9e-6 apart: Megatron's fp32 RoPE), so token-mean.
        {
            "name": "multi-turn",
            "loss_agg_mode": "token-mean",
            "dynamic": False,
            "optimizers": ["sgd"],
            "multi_turn": True,
            "layouts": ["tp2_pp1_vpp1_dp1", "tp1_pp2_vpp1_dp1_packed", "tp1_pp1_vpp1_dp2_packed"],
        },
        *DISTILL_CASES,
    ],
    # Megatron's uneven layer split (issue 56): PP 2 packed again, stage 0 holding 1 of the 4
    # layers and stage 1 the other 3 (``..._first1``), the token-mean case and the critic.
    "uneven": {"split": {"num_layers_in_first_pipeline_stage": 1}, "cases": ["token-mean"]},
}
MOE_CASES = [
    {
        "name": "moe",
        "loss_agg_mode": "token-mean",
        "dynamic": False,
        "optimizers": ["sgd", "adamw"],
    },
    # The routers' load-balancing and z losses on (Megatron's, per micro-batch over its tokens
    # without padding, token-weighted over the mini-batch: megarl.models.runner).
    {
        "name": "moe-aux",
        "loss_agg_mode": "token-mean",
        "dynamic": False,
        "optimizers": ["sgd"],
        "moe": {"moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01},
    },
    # The SGD update with bf16 parameters (fp32 main weights and gradient reduction) on one
    # mini-batch of all 16 responses, lr 100: the weight change, 100 × the gradient, then stands
    # well above a bf16 ulp of the weights (~1e-4).
    {
        "name": "moe-bf16",
        "responses_per_mini_batch": 16,
        "loss_agg_mode": "token-mean",
        "dynamic": False,
        "optimizers": ["sgd"],
        "bf16": True,
        "lr": 100.0,
        "worlds": [2],
    },
]
"""GRPO updates of the tiny Qwen3-MoE at EP 2 (world 2), PP 2 × EP 2 and TP 2 × EP 2 with sequence
parallelism (world 4)."""
MOE_LAYOUT_KEYS = {
    2: ["moe_tp1_pp1_ep2_dp2"],
    4: ["moe_tp1_pp2_ep2_dp2_distopt_packed", "moe_tp2_pp1_ep2_dp2_sp"],
}
LAYOUT_KEYS = {
    1: ["tp1_pp1_vpp1_dp1"],
    2: [
        "tp2_pp1_vpp1_dp1",
        "tp1_pp2_vpp1_dp1_packed",
        "tp1_pp1_vpp1_dp2_packed",
        "tp1_pp2_vpp2_dp1",
        "tp1_pp1_vpp1_cp2_dp1_packed",
        "tp1_pp2_vpp1_dp1_packed_first1",
    ],
    4: [
        "tp2_pp1_vpp1_dp2_distopt_sp",
        "tp2_pp2_vpp1_dp1_packed_sp",
        "tp2_pp1_vpp1_cp2_dp1_packed_sp",
    ],
}
"""Right-padded and packed rows (``_packed``, :mod:`megarl.models.packing`), context parallelism
(``_cp2``) packed only, sequence parallelism (``_sp``) at every world-4 layout."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny model, the fixed batch (with old/ref log-probs that make the clips bite)."""
    from transformers import AutoModelForCausalLM

    from megarl.algo import compute_advantage
    from megarl.models.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp("update")
    model = make_tiny_model(tmp / "qwen2", family="qwen2", seed=21)
    moe_model = make_tiny_model(tmp / "qwen3_moe", family="qwen3_moe", num_layers=2, seed=22)
    g = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(5, 900, (int(n),), generator=g).tolist()
        for n in torch.randint(3, 7, (N_PROMPTS,), generator=g)
    ]
    prompt_ids, all_prompts, responses = [], [], []
    for p, prompt in enumerate(prompts):
        for _ in range(N):
            length = int(torch.randint(1, 11, (1,), generator=g))
            all_prompts.append(prompt)
            responses.append(torch.randint(5, 900, (length,), generator=g).tolist())
            prompt_ids.append(p)
    b = len(responses)
    width = max(map(len, responses))
    ids, plen, lens = right_padded(all_prompts, responses)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64)
    with torch.no_grad():
        logp, _, mask = _actor_outputs(hf, ids, plen, lens, width, SPEC["temperature"])
    logp, mask = logp.float(), mask.float()
    # Old log-probs off by up to ±1.5 nats (ratios far outside 1 ± 0.28, some past the dual clip
    # c = 3), reference log-probs off by ~0.1.
    noise = torch.randn(b, width, generator=g) * 0.5
    noise[::3] *= 3.0
    old = (logp + noise) * mask
    ref = (logp + 0.1 * torch.randn(b, width, generator=g)) * mask
    scores = torch.rand(b, generator=g)
    rewards = torch.zeros(b, width)
    rewards[torch.arange(b), (lens - plen) - 1] = scores
    adv, _ = compute_advantage(
        "grpo",
        token_level_rewards=rewards,
        response_mask=mask,
        index=torch.tensor(prompt_ids),
        norm_adv_by_std_in_grpo=True,
    )
    # A teacher: its sampled-token log-probs ~0.5 nats from the student's, and its top-K at
    # every position: distinct ids anywhere in the vocabulary (both TP shards), holding 80 % of
    # its probability.
    teacher = (logp + 0.5 * torch.randn(b, width, generator=g)) * mask
    vocab = hf.config.vocab_size
    topk_ids = torch.stack([torch.randperm(vocab, generator=g)[:TOPK] for _ in range(b * width)])
    topk_ids = topk_ids.view(b, width, TOPK)
    topk_lp = torch.log(0.8 * torch.softmax(2 * torch.randn(b, width, TOPK, generator=g), -1))
    topk_lp = topk_lp.sort(-1, descending=True).values  # by rank, as a teacher's top-k comes
    values = torch.randn(b, width, generator=g) * mask
    returns = (values + torch.randn(b, width, generator=g)) * mask  # value clipping bites
    # Multi-turn: tokens [L/3, 2L/3) of each response of L >= 3 tokens are a tool turn's.
    token_masks = []
    for r in responses:
        own = [1] * len(r)
        for k in range(len(r) // 3, 2 * len(r) // 3):
            own[k] = 0
        token_masks.append(own)
    mt_mask = mask.clone()
    for i, own in enumerate(token_masks):
        mt_mask[i, : len(own)] *= torch.tensor(own, dtype=mask.dtype)
    mt_adv, _ = compute_advantage(
        "grpo",
        token_level_rewards=rewards,
        response_mask=mt_mask,
        index=torch.tensor(prompt_ids),
        norm_adv_by_std_in_grpo=True,
    )
    data = {
        "values": values, "returns": returns,
        "prompts": all_prompts, "responses": responses, "prompt_ids": prompt_ids,
        "advantages": adv, "old_log_probs": old, "ref_log_probs": ref,
        "ids": ids, "plen": plen, "lens": lens, "mask": mask,
        "token_masks": token_masks, "mt_mask": mt_mask, "mt_advantages": mt_adv,
        "teacher_log_probs": teacher, "teacher_topk_log_probs": topk_lp * mask[..., None],
        "teacher_topk_ids": topk_ids * mask[..., None].long(),
    }  # fmt: skip
    torch.save(data, tmp / "batch.pt")
    spec = {**SPEC, "model": str(model), "batch": str(tmp / "batch.pt"), "tmp": str(tmp)}
    spec["moe_model"], spec["moe_cases"] = str(moe_model), MOE_CASES
    spec["adam_eps"] = ADAM_EPS
    spec["value_head_seed"] = 5
    spec["cliprange_value"] = 0.2
    (tmp / "spec.json").write_text(json.dumps(spec))
    return spec, data


@pytest.fixture(scope="module")
def references(setup):
    spec, data = setup
    return {
        (case["name"], opt): reference_update(spec, data, case, opt)
        for case in SPEC["cases"]
        for opt in case.get("optimizers", ("sgd", "adamw"))
    }


@pytest.fixture(scope="module")
def moe_references(setup):
    spec, data = setup
    return {
        (case["name"], opt): reference_update(spec, data, case, opt, spec["moe_model"])
        for case in MOE_CASES
        for opt in case["optimizers"]
    }


def _results(setup, world: int) -> dict:
    spec, _ = setup
    out = Path(spec["tmp"]) / f"update_ws{world}.pt"
    if not out.exists():
        run_torchrun(WORKER, world, [str(Path(spec["tmp"]) / "spec.json")], timeout=1500)
    return torch.load(out, weights_only=False)


FP32_WEIGHTS, FP32_METRICS = 3e-5, 5e-6
"""fp32 against the float64 reference after two updates: measured 1.0-1.6e-5 on weights and
~2e-6 on metrics at every layout, (1,1,1) included (rounding, not parallelism)."""


LIKE_FP32_METRICS = 2e-6
"""The distributed optimizer (fp32) against fp32 at (1,1,1): mini-batch 2's metrics follow one
AdamW step whose weights differ by ~2e-6 (rounding); measured 6.7e-7 and 9.4e-7 when the loss
was scaled by the sequence count, 8.7e-7 and 1.2e-6 by the token count (the runner's contract
since MoE: the routers' losses are token-weighted)."""


def _compare(got: dict, ref_weights: dict, ref_metrics: dict) -> tuple[float, float, float]:
    weights = max(float((got["weights"][n] - w).abs().max()) for n, w in ref_weights.items())
    keys = ["pg_loss", "pg_clipfrac", "ppo_kl"]
    keys += [k for k in ref_metrics if k.startswith("distillation/")]
    metrics = max(abs(got["metrics"][f"actor/{key}"] - ref_metrics[key]) for key in keys)
    norm = abs(got["metrics"]["actor/grad_norm"] / ref_metrics["grad_norm"] - 1)
    return weights, metrics, norm


@pytest.mark.parametrize("world", [1, 2, 4])
def test_update_equals_single_process_reference(setup, references, world):
    results = _results(setup, world)
    fp32_base = _results(setup, 1) if world == 4 else results
    rows, failures = [], []
    for layout in LAYOUT_KEYS[world]:
        for case in SPEC["cases"]:
            for opt in case.get("optimizers", ("sgd", "adamw")):
                if layout not in case.get("layouts", [layout]):
                    continue
                if layout.endswith("_first1") and case["name"] not in SPEC["uneven"]["cases"]:
                    continue
                got = results.get(f"{layout}/{case['name']}/{opt}")
                if got is None:
                    assert "vpp2" in layout and case["dynamic"], f"missing {layout}/{case['name']}"
                    continue
                where = f"{layout} {case['name']} {opt} ({got['dtype']})"
                if layout.endswith("_first1"):  # the split applied: stage 0 holds 1 layer of 4
                    assert got["stage_layers"] == [[1], [3]], (where, got["stage_layers"])
                weights, metrics, norm = _compare(got, *references[(case["name"], opt)])
                rows.append(f"{where}: weights {weights:.2e} metrics {metrics:.2e}")
                if case.get("distillation"):  # one step from the initial weights: the gradient
                    bad = weights > 1e-6 or metrics > 1e-6  # measured <= 5.7e-7 and 1.3e-7
                elif got["dtype"] == "torch.float64":
                    bad = weights > 1e-5 or metrics > 1e-6
                else:  # the distributed optimizer: fp32 only
                    bad = weights > FP32_WEIGHTS or metrics > FP32_METRICS
                    like = fp32_base[f"tp1_pp1_vpp1_dp1/{case['name']}/adamw_fp32"]
                    same = {n: like["weights"][n] for n in references[(case["name"], opt)][0]}
                    w32, m32, _ = _compare(got, same, {
                        k: like["metrics"][f"actor/{k}"]
                        for k in ("pg_loss", "pg_clipfrac", "ppo_kl", "grad_norm")
                    })  # fmt: skip
                    rows.append(f"{where} vs fp32 at (1,1,1): weights {w32:.2e} metrics {m32:.2e}")
                    bad = bad or w32 > 1e-5 or m32 > LIKE_FP32_METRICS
                if bad:
                    failures.append(rows[-1])
                if opt == "sgd" and norm > 1e-5:
                    failures.append(f"{where}: grad norm relative difference {norm:.2e}")
                if not got["replicas_identical"]:
                    failures.append(f"{where}: DP replicas differ")
    print("\n".join(rows))
    assert len(rows) >= len(LAYOUT_KEYS[world]) * 2
    assert not failures, "\n".join(failures + ["--- all:"] + rows)


def test_critic_update_equals_single_process_reference(setup):
    """PPO's critic update at (1,1,1) (SGD, lr 1, float64) equals the plain single-process one
    on the same batch: every weight, the head included, and ``vf_loss``; the other layouts (packed
    and CP 2 among them) equal (1,1,1)'s (the next test)."""
    spec, data = setup
    got = _results(setup, 1)[f"{LAYOUT_KEYS[1][0]}/critic"]
    want, vf_loss = reference_critic_update(spec, data)
    assert set(got["weights"]) == set(want)
    for name, w in want.items():
        # float64 on both sides, as the actor's (1e-5: Megatron's RoPE frequencies are fp32)
        assert float((got["weights"][name] - w).abs().max()) <= 1e-5, name
    assert got["metrics"]["critic/vf_loss"] == pytest.approx(vf_loss, rel=1e-6)
    assert float((want["score.weight"] - got["before_head"]).abs().max()) > 1e-3  # it moved


@pytest.mark.parametrize("world", [2, 4])
def test_critic_update_is_the_same_at_every_layout(setup, world):
    """The critic's SGD update (lr 1, float64: the weight change is the reduced gradient) and
    its metrics at every layout of the world, packed and at CP 2 included, equal (1,1,1)'s
    right-padded one (whose values and gradients tests/models and the critic SP test check)."""
    base = _results(setup, 1)[f"{LAYOUT_KEYS[1][0]}/critic"]
    results = _results(setup, world)
    for layout in LAYOUT_KEYS[world]:
        got = results[f"{layout}/critic"]
        assert set(got["weights"]) == set(base["weights"])
        for name, w in base["weights"].items():
            # float64 updates, compared as the fp32 copies the worker returns: 1e-7 is a few
            # fp32 ulps of these weights; a wrong gradient moves them by ~its size (lr 1)
            assert float((got["weights"][name] - w).abs().max()) <= 1e-7, (layout, name)
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm"):
            assert got["metrics"][key] == pytest.approx(base["metrics"][key], rel=1e-6), (
                layout,
                key,
            )


@pytest.mark.parametrize("world", [2, 4])
def test_moe_update_equals_single_process_reference(setup, moe_references, world):
    """The tiny Qwen3-MoE's GRPO update at EP 2 and PP 2 × EP 2 (distributed optimizer) equals
    the single-process reference: weights, the loss metrics, the grad norm (experts' gradients
    counted once across the expert-parallel ranks), and with the routers' losses on, their
    gradients and ``actor/moe_aux_loss`` / ``actor/moe_z_loss``."""
    results = _results(setup, world)
    rows, failures = [], []
    for layout in MOE_LAYOUT_KEYS[world]:
        for case in MOE_CASES:
            if "bf16" in case:
                continue  # test_moe_bf16_update_follows_the_reference
            for opt in case["optimizers"]:
                got = results[f"{layout}/{case['name']}/{opt}"]
                ref_weights, ref_metrics = moe_references[(case["name"], opt)]
                where = f"{layout} {case['name']} {opt} ({got['dtype']})"
                weights, metrics, norm = _compare(got, ref_weights, ref_metrics)
                aux = max(
                    (abs(got["metrics"][f"actor/{k}"] - ref_metrics[k]) for k in ref_metrics
                     if k.startswith("moe_")),
                    default=0.0,
                )  # fmt: skip
                rows.append(
                    f"{where}: weights {weights:.2e} metrics {metrics:.2e} grad norm {norm:.2e} "
                    f"router losses {aux:.2e}"
                )
                exact = got["dtype"] == "torch.float64"
                if weights > (1e-5 if exact else FP32_WEIGHTS) or max(metrics, aux) > (
                    1e-6 if exact else FP32_METRICS
                ):
                    failures.append(rows[-1])
                if opt == "sgd" and norm > 1e-5:
                    failures.append(f"{where}: grad norm relative difference {norm:.2e}")
                if not got["replicas_identical"]:
                    failures.append(f"{where}: DP replicas differ")
                if "moe" in case:  # the losses are on, and they are not negligible
                    assert ref_metrics["moe_aux_loss"] > 0.5 and ref_metrics["moe_z_loss"] > 0
                    assert {"actor/moe_aux_loss", "actor/moe_z_loss"} <= set(got["metrics"])
                else:
                    assert "actor/moe_aux_loss" not in got["metrics"], where
    print("\n".join(rows))
    assert len(rows) == 3 * len(MOE_LAYOUT_KEYS[world])
    assert not failures, "\n".join(failures + ["--- all:"] + rows)


def test_moe_bf16_update_follows_the_reference(setup, moe_references):
    """The SGD update (lr 100, one mini-batch) at EP 2 with bf16 parameters: the weight change —
    100 × the gradient, computed in bf16, reduced and applied in fp32 — points where the float64
    reference's (lr 1) does and is 100 times as long (bf16's rounding of activations and of each
    weight is noise against it), and ``actor/pg_loss`` is the reference's within bf16's log-prob
    error."""
    from safetensors.torch import load_file

    spec, _ = setup
    results = _results(setup, 2)
    bf16 = results[f"{MOE_LAYOUT_KEYS[2][0]}/moe-bf16/sgd"]
    assert bf16["dtype"] == "torch.bfloat16"
    ref_weights, ref_metrics = moe_references[("moe-bf16", "sgd")]
    start = {}
    for f in sorted(Path(spec["moe_model"]).glob("*.safetensors")):
        start.update({k: v.float() for k, v in load_file(f).items()})
    names = sorted(ref_weights)
    ref_step = torch.cat([(ref_weights[n] - start[n]).flatten() for n in names])
    bf16_step = torch.cat([(bf16["weights"][n] - start[n]).flatten() for n in names])
    cosine = float(torch.nn.functional.cosine_similarity(ref_step, bf16_step, dim=0))
    ratio = float(bf16_step.norm() / ref_step.norm())
    loss = abs(bf16["metrics"]["actor/pg_loss"] - ref_metrics["pg_loss"])
    print(f"bf16 MoE step: cosine {cosine:.5f}, length ratio {ratio:.2f}, pg_loss {loss:.2e}")
    # Measured: cosine 0.949, ratio 104, pg_loss 6e-3. Not closer: bf16 log-probs (~0.03 off at
    # log-probs ~ -7) flip clip decisions of tokens near the clip bounds, which this batch is
    # built to have. A step of the wrong length (a gradient counted twice) fails the ratio.
    assert cosine > 0.9 and abs(ratio / 100 - 1) < 0.15 and loss < 2e-2, (cosine, ratio, loss)
    assert bf16["replicas_identical"] and bf16["metrics"]["actor/skipped_steps"] == 0


def test_the_router_losses_move_the_router(setup, moe_references):
    """The reference's router losses matter to the update: with them on, the router weights move
    differently (else the MoE test above would not see a missing or mis-scaled aux gradient)."""
    off, _ = moe_references[("moe", "sgd")]
    on, _ = moe_references[("moe-aux", "sgd")]
    gate = [n for n in off if n.endswith("mlp.gate.weight")]
    assert gate and max(float((off[n] - on[n]).abs().max()) for n in gate) > 1e-4


def test_the_clips_are_active(setup, references):
    """The batch exercises clip-higher and dual-clip (else the test above proves less)."""
    _, ref_metrics = references[("token-mean", "sgd")]
    assert 0.05 < ref_metrics["pg_clipfrac"] < 0.95


def test_bf16_first_step_is_the_loaded_weights_plus_the_update(setup):
    """Step 1 of the bf16 run, replayed by hand in float64 (torch's AdamW formula on the reduced
    gradient, from the loaded bf16 weights): the optimizer's fp32 main weights equal the replay,
    and the bf16 weights are exactly their rounding. Main weights cloned before the load would
    start from the random initialisation instead."""
    r = _results(setup, 1)["bf16"]["bf16_step1"]
    assert r["steps"] >= 2 and r["largest_update"] > 1.5e-6, r  # lr 1e-6: both steps moved
    # Each weight within one fp32 ulp per step plus 1e-5 of its update (the worker's allowance);
    # lr 1e-6 is ~8 ulps of a weight of 1 and hundreds of a typical one, so a missing, doubled
    # or misdirected update, or another starting point, fails.
    assert r["main_diff_allowed"] <= 1.0 and r["bf16_is_rounded_main"], r


def test_bf16_second_step_loss_is_close_to_fp32(setup):
    """Two bf16 updates on the fixed batch (positive advantages, so that the loss is not a small
    difference of large terms), old log-probs recomputed by the model itself before each
    (decoupled, as the trainer does): step 2's loss — pg_loss − entropy_coeff·entropy +
    kl_loss_coef·kl_loss, averaged over its mini-batches — within 2e-2 (relative) of fp32's."""
    spec, _ = setup
    results = _results(setup, 1)["bf16"]

    def loss(m: dict) -> float:
        return (
            m["actor/pg_loss"]
            - spec["entropy_coeff"] * m["actor/entropy"]
            + spec["kl_loss_coef"] * m["actor/kl_loss"]
        )

    fp32, bf16 = loss(results["fp32"][1]), loss(results["bf16"][1])
    assert abs(fp32) > 0.1 and abs(bf16 - fp32) <= 2e-2 * abs(fp32), (bf16, fp32)
    assert results["bf16"][1]["actor/skipped_steps"] == 0
