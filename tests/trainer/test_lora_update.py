"""A GRPO actor update with LoRA equals a single-process reference at TP 2, PP 2, DP 2 (the
distributed optimizer) and TP 2 with sequence parallelism (SGD: the update is the gradient, the
replicated factors' summed over TP by ``finalize_model_grads``); the base weights come out
bit-identical; the reference policy (the actor's chunks with adapters off) is the base model.

The reference is HF transformers + ``peft`` in float64, loaded with the worker's initial adapters
(random non-zero A and B, so both get gradients from the first mini-batch), with the shared A of
each fused Megatron linear tied across q/k/v (gate/up) — one parameter, whose gradient is the
sum, as Megatron's fused adapter has — then the plain loop of ``test_update_equivalence``:
per mini-batch, full forward, verl's loss, backward, optimizer step, over the adapters only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_torchrun
from tests.trainer._update_reference import (
    _actor_outputs,
    reference_lora_steps,
    reference_lora_update,
)
from tests.trainer.test_update_equivalence import (
    SPEC,
    setup,  # noqa: F401 - the fixed batch and tiny model, a fixture shared with that module
)

WORKER = Path(__file__).with_name("_lora_update_worker.py")
pytestmark = pytest.mark.multirank

LORA = {"rank": 4, "alpha": 0.8, "a_init": "xavier", "b_init": "normal", "seed": 9}
SGD_LR = 0.5
SGD_CLIP = 0.02
"""The MoE ``sgd_clip`` case's ``clip_grad``: below every mini-batch's gradient norm."""


@pytest.fixture(scope="module")
def lora_results(setup):  # noqa: F811
    spec, _ = setup
    spec = {**spec, "lora": LORA, "sgd_lr": SGD_LR, "sgd_clip": SGD_CLIP, "tmp": spec["tmp"]}
    path = Path(spec["tmp"]) / "lora_spec.json"
    path.write_text(json.dumps(spec))
    run_torchrun(WORKER, 2, [str(path)])
    return torch.load(Path(spec["tmp"]) / "lora_update.pt", weights_only=False)


def _peft_model(base: str, adapters: dict[str, torch.Tensor], tmp: Path):
    """HF float64 + peft with ``adapters`` (PEFT names), A tied within each fused linear."""
    from peft import PeftModel
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder = tmp / "initial_adapter"
    folder.mkdir(exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in adapters.items()}, folder / "adapter_model.safetensors"
    )
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in adapters})
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA["rank"],
        "lora_alpha": LORA["alpha"], "lora_dropout": 0.0, "target_modules": targets,
        "bias": "none"}))  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
    model = PeftModel.from_pretrained(hf, str(folder), is_trainable=True)
    model.double()
    for layer in model.base_model.model.model.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")),
                              (layer.mlp, ("gate_proj", "up_proj"))):  # fmt: skip
            shared = getattr(parent, names[0]).lora_A["default"].weight
            for n in names[1:]:
                getattr(parent, n).lora_A["default"].weight = shared
    return model


def _reference(spec: dict, data: dict, before: dict, optimizer: str):
    model = _peft_model(spec["model"], before, Path(spec["tmp"]))
    params = [p for p in model.parameters() if p.requires_grad]  # unique (tied A once)
    settings = {"name": optimizer, "lr": SGD_LR if optimizer == "sgd" else 1e-3,
                "clip": 1.0 if optimizer == "adamw" else 0.0}  # fmt: skip
    norms = reference_lora_steps(model, params, SPEC, data, settings)
    model.grad_norm = sum(norms) / len(norms)  # the trainer's metric: the mini-batches' mean
    return (
        {
            n.replace(".default.weight", ".weight"): p.detach().clone()
            for n, p in model.named_parameters()
            if "lora_" in n
        }
        | _tied_names(model)
        | {"grad_norm": torch.tensor(model.grad_norm)}
    )


def _tied_names(model) -> dict[str, torch.Tensor]:
    """named_parameters lists a tied A once: every projection's A under its own name."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            out[f"{name}.lora_A.weight"] = module.lora_A["default"].weight.detach().clone()
    return out


LAYOUTS = [
    "tp2_pp1/sgd",
    "tp2_pp1/adamw",
    "tp1_pp2/sgd",
    "tp1_pp2/adamw",
    "tp1_pp1_dp2_distopt/adamw",
    "tp2_pp1_sp/sgd",
]


def test_lora_update_equals_single_process_reference(setup, lora_results):  # noqa: F811
    spec, data = setup
    first = lora_results["tp2_pp1/sgd"]["before"]
    for key in LAYOUTS:  # every layout starts from the same adapters
        r = lora_results[key]
        assert all(torch.equal(r["before"][n].double(), first[n]) for n in first), key
    refs = {opt: _reference(spec, data, first, opt) for opt in ("sgd", "adamw")}
    for key in LAYOUTS:
        r, ref = lora_results[key], refs[key.split("/")[1]]
        # as test_update_equivalence: float64 within 1e-5 (Megatron's float64 path keeps some
        # fp32 arithmetic), the distributed optimizer's fp32 within 3e-5
        tol = 1e-5 if r["dtype"] == "torch.float64" else 3e-5
        names = set(ref) - {"grad_norm"}
        assert set(r["after"]) == names, key
        moved = max(float((ref[n] - first[n]).abs().max()) for n in names)
        assert moved > 1e-4, key  # the update did move the adapters
        worst = max(float((r["after"][n].double() - ref[n]).abs().max()) for n in names)
        print(f"{key}: adapters moved {moved:.2e}, max difference {worst:.2e}")
        assert worst <= tol, (key, worst)
        norm = float(ref["grad_norm"])  # each replicated factor once (TP, SP, DP)
        assert abs(r["metrics"]["actor/grad_norm"] / norm - 1) <= 1e-5, (key, norm)


def test_base_weights_bit_identical_and_only_adapters_stepped(setup, lora_results):  # noqa: F811
    from safetensors.torch import load_file

    spec, _ = setup
    original = load_file(str(Path(spec["model"]) / "model.safetensors"))
    for key in LAYOUTS:
        r = lora_results[key]
        dtype = getattr(torch, r["dtype"].removeprefix("torch."))
        for name, w in r["base"].items():
            # fp32 file -> model dtype -> float for the result: exact both ways
            assert torch.equal(w, original[name].to(dtype).float()), (key, name)
        assert r["optimizer_numel"] <= r["trainable_local"] < r["base_numel_local"] / 10, key


def test_reference_policy_is_the_base_model(setup, lora_results):  # noqa: F811
    """``BaseModelView``'s log-probs (adapters off, random non-zero adapters on) = HF base."""
    from transformers import AutoModelForCausalLM

    spec, data = setup
    hf = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float64)
    with torch.no_grad():
        logp, _, mask = _actor_outputs(hf, data["ids"], data["plen"], data["lens"],
                                       data["mask"].shape[1], SPEC["temperature"])  # fmt: skip
    for key in LAYOUTS:
        got = lora_results[key]["ref_log_probs"].double()
        tol = 1e-5 if lora_results[key]["dtype"] == "torch.float64" else 1e-4
        assert float(((got - logp) * mask).abs().max()) <= tol, key


def test_forward_only_passes_run_without_dropout(lora_results):
    """``lora.dropout`` acts in updates only: with dropout 0.5 the actor's old-log-prob pass
    (forward only, sequence parallelism on) gives the dropout-free log-probs exactly, twice, as
    verl's ``compute_log_prob`` in eval mode; an adapter in train mode does drop; the chunks are
    back in train mode after the pass."""
    for key in ("tp2_pp1_sp/sgd", "moe_tp2_ep2_sp/sgd"):
        r = lora_results[key]
        assert r["dropout_forward_only_diff"] == 0.0, key
        assert r["dropout_train_mode_drops"] and r["chunks_back_in_train_mode"], key


MOE_LAYOUTS = {
    "moe_tp1_ep2/sgd": {"name": "sgd", "lr": SGD_LR, "clip": 0.0},
    "moe_tp1_ep2/sgd_clip": {"name": "sgd", "lr": SGD_LR, "clip": SGD_CLIP},
    "moe_tp1_ep2_distopt/adamw": {"name": "adamw", "lr": 1e-3, "clip": 1.0},
    "moe_tp2_ep2_sp/sgd": {"name": "sgd", "lr": SGD_LR, "clip": 0.0},
    "moe_tp1_pp2/sgd": {"name": "sgd", "lr": SGD_LR, "clip": 0.0},
}
"""The tiny Qwen3-MoE at TP 1 × EP 2 (DP 2, expert-DP 1), at TP 2 × EP 2 (expert TP 1) with
sequence parallelism and at PP 2 (EP 1), with adapters on attention and every expert's fc1/fc2:
the worker's case -> the reference's optimizer."""


@pytest.fixture(scope="module")
def moe_references(setup, lora_results):  # noqa: F811
    spec, data = setup
    first = lora_results["moe_tp1_ep2/sgd"]["before"]
    scaling = LORA["alpha"] / LORA["rank"]
    return {
        key: reference_lora_update(SPEC, data, spec["moe_model"], first, scaling, opt)
        for key, opt in MOE_LAYOUTS.items()
    }


def test_moe_lora_update_equals_single_process_reference(setup, lora_results, moe_references):  # noqa: F811
    """Adapters on attention and every expert's linears (each EP rank its 4 experts'): the
    update equals the float64 single-process one (merged-weight LoRA on transformers'
    Qwen3-MoE, no peft), adapters only; expert adapters are reduced over the expert-data-parallel
    group (here 1 rank: reducing them over DP, as a dense parameter, would mix two ranks'
    different experts); the grad norm counts each expert adapter once (and the clipped SGD
    step, scaled by clip / norm, shows it is the norm clipping uses)."""
    first = lora_results["moe_tp1_ep2/sgd"]["before"]
    assert any(".mlp.experts.7.down_proj.lora_A" in n for n in first)  # EP rank 1's experts
    for key, (ref, norms) in moe_references.items():
        r = lora_results[key]
        assert set(r["before"]) == set(first) and all(
            torch.equal(r["before"][n], first[n]) for n in first
        ), key
        assert set(r["after"]) == set(ref), key
        tol = 1e-5 if r["dtype"] == "torch.float64" else 3e-5
        moved = max(float((ref[n] - first[n]).abs().max()) for n in ref)
        experts_moved = max(float((ref[n] - first[n]).abs().max()) for n in ref if ".experts." in n)
        worst = max(float((r["after"][n].double() - ref[n]).abs().max()) for n in ref)
        norm = sum(norms) / len(norms)
        got_norm = r["metrics"]["actor/grad_norm"]
        print(f"{key}: adapters moved {moved:.2e} (experts {experts_moved:.2e}), max difference "
              f"{worst:.2e}; grad norm {got_norm:.6g} vs {norm:.6g}")  # fmt: skip
        assert experts_moved > 1e-4, key
        assert worst <= tol, (key, worst)
        assert abs(got_norm / norm - 1) <= (1e-6 if r["dtype"] == "torch.float64" else 1e-5), key
        if key.endswith("sgd_clip"):
            assert min(norms) > 2 * SGD_CLIP  # clipping bit in every mini-batch


def test_moe_base_weights_bit_identical_and_reference_policy(setup, lora_results):  # noqa: F811
    """Every base weight of the MoE model (experts of both EP ranks, router, attention) is
    bit-identical after the update; only adapters are stepped; adapters off = the HF base."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    spec, data = setup
    original = load_file(str(Path(spec["moe_model"]) / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(spec["moe_model"], dtype=torch.float64,
                                              experts_implementation="eager")  # fmt: skip
    with torch.no_grad():
        logp, _, mask = _actor_outputs(hf, data["ids"], data["plen"], data["lens"],
                                       data["mask"].shape[1], SPEC["temperature"])  # fmt: skip
    for key in MOE_LAYOUTS:
        r = lora_results[key]
        dtype = getattr(torch, r["dtype"].removeprefix("torch."))
        assert set(r["base"]) == set(original), key
        for name, w in r["base"].items():
            assert torch.equal(w, original[name].to(dtype).float()), (key, name)
        assert r["optimizer_numel"] <= r["trainable_local"] < r["base_numel_local"] / 10, key
        got = r["ref_log_probs"].double()
        tol = 1e-5 if r["dtype"] == "torch.float64" else 1e-4
        assert float(((got - logp) * mask).abs().max()) <= tol, key


def test_moe_lora_checkpoint_resumes_bit_identically_and_loads_at_another_ep(lora_results):
    """The trainer's save after step 1 at EP 2 (adapters only, expert adapters sharded over EP,
    and their distributed-optimizer state): a fresh actor at EP 2 (adapters of another seed)
    loads them bit-identically and its step 2 equals the uninterrupted run's bit for bit; at
    EP 1 (expert-DP 2) it loads them bit-identically and its step 2 agrees within fp32 rounding
    (an Adam step from fresh moments would move the adapters by ~lr = 1e-3 instead)."""
    main = lora_results["moe_tp1_ep2_distopt/adamw"]
    step2_moved = max(float((main["after_step2"][n] - main["after"][n]).abs().max())
                      for n in main["after"])  # fmt: skip
    assert step2_moved > 1e-4
    for ep in (2, 1):
        r = lora_results[f"moe_resumed_ep{ep}"]
        assert set(r["loaded"]) == set(main["after"])
        assert all(torch.equal(r["loaded"][n], main["after"][n]) for n in main["after"]), ep
        worst = max(float((r["after_step2"][n] - main["after_step2"][n]).abs().max())
                    for n in main["after"])  # fmt: skip
        print(f"resumed at EP {ep}: step 2 vs the uninterrupted run {worst:.3g}")
        assert worst == 0.0 if ep == 2 else worst <= 1e-6, (ep, worst)


def _moe_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_moe_peft_export_and_adapter_path(setup, lora_results):  # noqa: F811
    """The save's ``lora_adapter`` (per-expert PEFT names, written from both EP ranks) loaded by
    ``peft`` onto transformers' Qwen3-MoE (which converts it onto the fused experts) gives the
    logits of the saved adapters (merged-weight reference, float64), and so does the save's
    merged HF export; ``lora.adapter_path``: the folder loaded at EP 1 sets every adapter to the
    saved one exactly."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.trainer._update_reference import _MergedLora

    spec, data = setup
    saved = Path(spec["tmp"]) / "moe_lora_run" / "global_step_1" / "actor"
    after = lora_results["moe_tp1_ep2_distopt/adamw"]["after"]
    exported = load_file(str(saved / "lora_adapter" / "adapter_model.safetensors"))
    assert set(exported) == set(after)
    assert all(torch.equal(exported[n], after[n].float()) for n in after)
    ids = data["ids"]

    def base():
        return AutoModelForCausalLM.from_pretrained(spec["moe_model"], dtype=torch.float64,
                                                    experts_implementation="eager")  # fmt: skip

    scaling = LORA["alpha"] / LORA["rank"]
    want = _moe_logits(_MergedLora(base(), {k: v.double() for k, v in after.items()}, scaling),
                       ids)  # fmt: skip
    peft = PeftModel.from_pretrained(base(), str(saved / "lora_adapter"))
    got = _moe_logits(peft, ids)
    with peft.disable_adapter():
        off = _moe_logits(peft, ids)
    merged = AutoModelForCausalLM.from_pretrained(saved / "huggingface", dtype=torch.float64,
                                                  experts_implementation="eager")  # fmt: skip
    got_merged = _moe_logits(merged, ids)
    print(f"MoE PEFT export through peft vs reference {(got - want).abs().max():.3g}, merged HF "
          f"export {(got_merged - want).abs().max():.3g}, adapters off {(off - want).abs().max():.3g}")  # fmt: skip
    assert (got - want).abs().max() <= 1e-9
    assert (got_merged - want).abs().max() <= 1e-4  # an fp32 merge
    assert (off - want).abs().max() > 1e-3
    r = lora_results["moe_resumed_ep1"]
    assert r["from_peft_count"] == 2 * (2 + 2 * 8)  # layers × (attention + 8 experts' fc1, fc2)
    assert set(r["from_peft"]) == set(after)
    assert all(torch.equal(r["from_peft"][n], after[n]) for n in after)
