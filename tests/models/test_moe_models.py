"""Qwen3-MoE and Mixtral on Megatron (local spec, CPU): logits equal transformers' at
TP×PP×EP(×ETP) layouts with the alltoall and allgather dispatchers, HF export from every layout
is the source checkpoint bit for bit, and a dist checkpoint moves between expert layouts.

The multi-rank work runs inside the shared launch of each world size (``conftest.py``,
``_moe_checks.py``); these tests read its results.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.models._moe_checks import MOE_LAYOUTS, layout_key
from tests.models.conftest import MOE_MODELS

pytestmark = pytest.mark.multirank


def _tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(f, framework="pt") as handle:
            out.update({k: handle.get_tensor(k) for k in handle.keys()})  # noqa: SIM118
    return out


def _cases(world: int) -> list[str]:
    return [layout_key(*layout) for layout in MOE_LAYOUTS[world]]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_moe_logits_match_transformers(world, request):
    results = request.getfixturevalue(f"ws{world}")
    for key in _cases(world):
        for name in MOE_MODELS:
            diff = results[f"{key}/{name}"]["logit_diff"]
            assert diff <= 1e-4, (key, name, diff)


def test_moe_layouts_cover_ep_tp_pp_and_both_dispatchers():
    layouts = [layout for world in MOE_LAYOUTS.values() for layout in world]
    assert len(layouts) >= 6
    for position in range(3):  # tp, pp, ep each at 1 and 2
        assert {layout[position] for layout in layouts} == {1, 2}
    assert {layout[4] for layout in layouts} == {"alltoall", "allgather"}
    assert any(layout[2] > 1 and layout[0] > 1 for layout in layouts)  # EP beside TP (ETP 1)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_moe_export_is_bit_identical_to_the_source(world, request, spec):
    results = request.getfixturevalue(f"ws{world}")
    checked = 0
    for key in _cases(world):
        for name in MOE_MODELS:
            export = results[f"{key}/{name}"].get("export")
            if export is None:
                continue
            want = _tensors(Path(spec["moe_models"][name]))
            got = _tensors(Path(export))
            assert sorted(got) == sorted(want), (key, name)
            for tensor_name, tensor in want.items():
                assert torch.equal(got[tensor_name], tensor), (key, name, tensor_name)
            checked += 1
    assert checked >= len(MOE_MODELS)


def test_moe_checkpoint_moves_between_expert_layouts(ws2):
    assert ws2["moe/ckpt_ep2_to_tp2"]["weights_identical"]


def test_every_moe_case_ran(ws1, ws2, ws4):
    """Every layout of every launch ran every MoE family (a finite |Δlogit|; the tolerance is
    checked above); prints the numbers and the time the MoE cases add to each launch (shown
    with ``pytest -s``)."""
    for world, results in ((1, ws1), (2, ws2), (4, ws4)):
        for key in _cases(world):
            diffs = {n: results[f"{key}/{n}"]["logit_diff"] for n in MOE_MODELS}
            assert all(math.isfinite(d) for d in diffs.values()), (world, key, diffs)
            print(f"ws{world} {key}: " + ", ".join(f"{n} {d:.1e}" for n, d in diffs.items()))
        print(f"ws{world}: MoE cases took {results['moe/seconds']:.1f} s")


def test_routing_replay_routes_every_token_as_recorded(ws2, ws4):
    """R2's mechanism at EP 2 and at TP 2 (sequence parallel) x PP 2, in the shared launches
    (tests/models/_moe_checks.py::_routing_replay): after the routers moved, replay routes
    every token as recorded where routing afresh does not, its agreement count matches the top-k
    of the routers' logits recomputed from their inputs, and a replay at another micro-batching
    leaves log-probs as recorded. The expert load counted meanwhile (hooks on the routers,
    padding left out, sequence-parallel slices added up) equals the one computed from the
    recorded routing. On packed rows (THD) the record is the same for every real token and a
    replay gives the right-padded replay's log-probs."""
    for world, results in ((2, ws2), (4, ws4)):
        for key in (k for k in results if k.startswith("moe/replay_")):
            r = results[key]
            print(f"ws{world} {key}: {r}")
            assert r["router_calls"] > 0
            assert r["routed_as_recorded_without_replay"] < 0.95, (key, r)  # the routers moved
            assert r["replay_equals_recorded"], (key, r)
            assert r["agreement_counted"] == pytest.approx(r["agreement_seen"], abs=1e-12), r
            assert r["agreement_counted"] < 1.0, (key, r)
            assert r["logprob_diff_other_micro_batches"] <= 1e-5, (key, r)
            assert r["packed_routing_as_recorded"], (key, r)  # R2's record on packed rows
            assert r["packed_logprob_diff"] <= 1e-5, (key, r)
            assert r["packed_replay_logprob_diff"] <= 1e-5, (key, r)  # replayed on packed rows
            expected = r["expert_load_expected"]  # the same, from the recorded routing
            assert {k: r["expert_load"][k] for k in expected} == pytest.approx(expected, rel=1e-9)
            assert 0.0 <= r["expert_load"]["expert_load_idle"] < 1.0
    assert any(k.startswith("moe/replay_") for k in ws2) and any(
        k.startswith("moe/replay_") for k in ws4
    )


def _hf_router_losses(path: str, batch: dict) -> tuple[dict[int, torch.Tensor], dict]:
    """The reference, from transformers' Qwen3-MoE in float64: each micro-batch's load-balancing
    loss (Switch: E / (k T^2) * sum_i (sum_x p_xi) * (tokens routed to i), over its T real
    tokens) and z-loss (the mean of logsumexp^2 over them), weighted by T over the batch's real
    tokens, times the coefficients, summed over layers; the routers' gradients of that, and the
    two losses per layer, coefficient-free."""
    from transformers import AutoModelForCausalLM

    from tests.models._moe_checks import ROUTER_LOSS_COEFFS, ROUTER_LOSS_MICRO_BATCH

    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, experts_implementation="eager"
    )
    ids, lengths = batch["input_ids"], batch["lengths"]
    out = hf(ids, output_router_logits=True)
    b, s = ids.shape
    real = torch.arange(s)[None, :] < lengths[:, None]  # [b, s]
    k, total = hf.config.num_experts_per_tok, float(lengths.sum())
    loss = torch.zeros((), dtype=torch.float64)
    aux_sum = z_sum = 0.0
    for logits in out.router_logits:  # one [b * s, E] per layer, batch-major
        logits = logits.reshape(b, s, -1)
        for start in range(0, b, ROUTER_LOSS_MICRO_BATCH):
            rows = slice(start, start + ROUTER_LOSS_MICRO_BATCH)
            mb = logits[rows][real[rows]]  # [T, E]
            tokens = mb.shape[0]
            probs = torch.softmax(mb, dim=-1)
            routed = torch.zeros_like(probs).scatter(1, probs.topk(k, dim=-1).indices, 1.0)
            aux = mb.shape[1] / (k * tokens**2) * (probs.sum(0) * routed.sum(0)).sum()
            z = torch.logsumexp(mb, dim=-1).square().mean()
            loss = loss + tokens / total * (ROUTER_LOSS_COEFFS["moe_aux_loss_coeff"] * aux
                                            + ROUTER_LOSS_COEFFS["moe_z_loss_coeff"] * z)  # fmt: skip
            aux_sum += tokens / total * float(aux.detach())
            z_sum += tokens / total * float(z.detach())
    loss.backward()
    layers = len(out.router_logits)
    grads = {i: layer.mlp.gate.weight.grad for i, layer in enumerate(hf.model.layers)}
    return grads, {"moe_aux_loss": aux_sum / layers, "moe_z_loss": z_sum / layers}


def test_router_losses_have_their_full_strength_at_every_layout(spec, ws1, ws2, ws4):
    """The routers' load-balancing and z losses (Megatron's, in megarl's per-token loss mode)
    give every router the gradient of the batch's token-weighted losses at TP 1, TP 2 (sequence
    parallel: each rank routes a slice, the slices' real-token counts unequal), CP 2 (packed
    rows, each rank routing its chunks) and TP 2 x PP 2, as transformers' router logits give it;
    the reported losses are the same at each layout."""
    batch = torch.load(spec["moe_batch"])
    want, metrics = _hf_router_losses(spec["moe_models"]["qwen3_moe"], batch)
    seen = 0
    for world, results in ((1, ws1), (2, ws2), (4, ws4)):
        for key in (k for k in results if k.startswith("moe/router_losses_")):
            r = results[key]
            for rank, grads in enumerate(r["grads"]):
                for layer, got in grads.items():
                    diff = float((got - want[layer]).abs().max())
                    assert diff <= 1e-5 * float(want[layer].abs().max()), (key, rank, layer, diff)
                    seen += 1
            for name, value in metrics.items():
                assert r[name] == pytest.approx(value, rel=1e-5), (key, name)
            print(f"ws{world} {key}: aux {r['moe_aux_loss']:.6f} z {r['moe_z_loss']:.6f}")
    assert seen == 7 * len(want)  # every rank's: L at TP 1, 2 L at TP 2 and CP 2, 4 L / 2 at PP 2
