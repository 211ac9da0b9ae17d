"""The resharding plan under vLLM expert parallelism (each vLLM rank holds whole experts): pure,
checked without processes, Megatron or vLLM's engine (vLLM's placement function only)."""

from __future__ import annotations

import pytest
import torch

from megarl.commands import plan as plan_cli
from megarl.models import hf_mapping as hm
from megarl.models.tiny import tiny_hf_config
from megarl.parallel.layout import ParallelLayout
from megarl.rollout.reshard.make_plan import make_reshard_plan
from tests.rollout.test_reshard_plan import tiny_dims

EP_CASES = [(8, 1), (8, 2), (8, 4), (6, 4), (7, 3), (5, 5), (60, 8), (128, 8)]  # (E, vLLM TP)


def test_rollout_expert_range_is_vllms_linear_placement():
    """The placement rule equals vLLM's own ``determine_expert_map`` (default "linear"), uneven
    splits included: the same experts, in the same local order."""
    from megarl.rollout.reshard.vllm_layout import rollout_expert_range

    expert_map = pytest.importorskip("vllm.model_executor.layers.fused_moe.expert_map_manager")
    for experts, t in EP_CASES:
        for r in range(t):
            local, mapping, _ = expert_map.determine_expert_map(t, r, experts)
            held = list(range(experts)) if mapping is None else torch.nonzero(mapping >= 0)
            held = [int(e) for e in held]
            assert list(rollout_expert_range(experts, t, r)) == held, (experts, t, r)
            assert local == len(held)
            if mapping is not None:  # local ids follow the global order
                assert mapping[held].tolist() == list(range(local))


def _is_routed_expert(name: str) -> bool:
    return ".experts." in name  # Qwen2-MoE's "shared_expert." is not routed


def _ep_plans(family, layout, rollout_tp, num_experts=8, bucket_bytes=64 << 10):
    """The same model and layouts planned without and with vLLM expert parallelism."""
    tp, pp, ep, etp = layout
    dims = tiny_dims(family, tp=tp, num_experts=num_experts)
    lay = ParallelLayout(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    return [
        make_reshard_plan(dims, lay, rollout_tp, bucket_bytes=bucket_bytes, rollout_ep=on)
        for on in (False, True)
    ]


def _held_by_hand(name: str, num_experts: int, t: int) -> int:
    """The vLLM rank holding routed expert ``name``: ranks below E % t hold one more."""
    e = int(name.split(".experts.")[1].split(".")[0])
    base, rem = divmod(num_experts, t)
    big = rem * (base + 1)
    return e // (base + 1) if e < big else rem + (e - big) // base


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize(
    "layout,rollout_tp,num_experts",
    [((1, 2, 2, 1), 2, 8), ((1, 2, 1, 1), 4, 6), ((2, 1, 2, 2), 4, 8), ((1, 1, 1, 1), 4, 5)],
)
def test_rollout_ep_slices_cover_each_expert_once_whole(family, layout, rollout_tp, num_experts):
    """With vLLM EP the ranks' slices hold each routed expert tensor exactly once, whole, on the
    rank vLLM places it (counted by hand); every other tensor's slices, the buckets and the
    training side are those of the plan without EP."""
    base, ep = _ep_plans(family, layout, rollout_tp, num_experts)
    assert ep.rollout_ep and not base.rollout_ep
    assert [b.params for b in ep.buckets] == [b.params for b in base.buckets]
    experts = 0
    for b_base, b_ep in zip(base.buckets, ep.buckets):
        for slot in b_ep.slots:
            got = [(v, p) for v in range(rollout_tp) for p in b_ep.slices[v] if p.slot == slot]
            if not _is_routed_expert(slot.name):
                want = [
                    (v, p) for v in range(rollout_tp) for p in b_base.slices[v] if p.slot == slot
                ]
                assert got == want, slot.name
                continue
            experts += 1
            assert [(v, p.dim) for v, p in got] == [
                (_held_by_hand(slot.name, num_experts, rollout_tp), None)
            ], slot.name
            assert got[0][1].numel == slot.numel
    assert experts == 3 * num_experts * ep.dims.num_layers
    # the rule itself, by hand: expert 4 of 6 sits alone on rank 2 of 4
    from megarl.rollout.reshard.vllm_layout import rollout_shard_shape, rollout_slice

    d = tiny_dims("qwen3_moe", num_experts=6)
    w = "model.layers.0.mlp.experts.4.down_proj.weight"
    shape = hm.hf_param_shape(w, d)
    assert [rollout_slice(w, shape, d, 4, r, rollout_ep=True) for r in range(4)] == [
        (0, 0, 0),
        (0, 0, 0),
        None,
        (0, 0, 0),
    ]
    assert rollout_slice(w, shape, d, 4, 2) == (1, 16 * 2, 16 * 3)  # without EP: columns
    assert rollout_shard_shape(w, shape, d, 4, rollout_ep=True, rollout_rank=2) == shape
    assert rollout_shard_shape(w, shape, d, 4, rollout_ep=True, rollout_rank=1) == (
        0,
        shape[1],
    )
    router = "model.layers.0.mlp.gate.weight"
    assert rollout_slice(router, (6, d.hidden_size), d, 4, 1, rollout_ep=True) is None


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("rollout_tp,num_experts", [(2, 8), (4, 6)])
def test_rollout_ep_bytes_per_rank(family, rollout_tp, num_experts):
    """PP 2: per (stage, vLLM rank) the bytes received from the other stage and kept by vLLM
    are those without EP with each expert's 1/t slices replaced by the rank's whole experts
    (counted by hand); both agree with the pieces. Even splits move the same bytes, uneven
    ones more to the ranks holding an extra expert. Expert-only buckets travel unpacked."""
    base, ep = _ep_plans(family, (1, 2, 1, 1), rollout_tp, num_experts, bucket_bytes=1)
    d, t, item = ep.dims, rollout_tp, ep.itemsize
    expert = 3 * d.moe_ffn_hidden_size * d.hidden_size * item  # gate, up, down of one expert
    layers_per_stage = d.num_layers // 2
    base_, rem = divmod(num_experts, t)
    for v in range(t):
        held = base_ + (v < rem)
        per_layer = (held * t - num_experts) * expert // t  # whole experts minus 1/t of all
        for stage in range(2):
            got, before = ep.received(stage, v), base.received(stage, v)
            assert got.pipeline == before.pipeline + layers_per_stage * per_layer, (stage, v)
            assert got.tp_gather == before.tp_gather
            pieces = sum(p.numel for b in ep.buckets if b.pp_rank != stage for p in b.slices[v])
            assert got.pipeline == pieces * item
        kept, slices = ep.rollout_bytes_per_rank(v), ep.rollout_slice_bytes(v)
        assert kept == base.rollout_bytes_per_rank(v) + d.num_layers * per_layer
        assert slices == base.rollout_slice_bytes(v) + d.num_layers * per_layer
        assert (kept == base.rollout_bytes_per_rank(v)) == (num_experts % t == 0)
    assert ep.rollout_bytes_per_rank() == max(ep.rollout_bytes_per_rank(v) for v in range(t))
    assert base.rollout_bytes_per_rank() == base.rollout_bytes_per_rank(0)
    # a layer's experts alone in a bucket: one whole run per rank (in place), packed without EP
    for b_base, b_ep in zip(base.buckets, ep.buckets):
        if all(p.name.split(".mlp.")[-1].startswith("experts.") for p in b_ep.params):
            assert b_ep.pack_numel == 0 and b_base.pack_numel > 0
            assert all(b_ep.message_range(v) is not None for v in range(t))
    assert ep.peak_bytes < base.peak_bytes
    summary = ep.summary()
    assert f"-> vLLM TP={t} EP={t}" in summary
    assert "experts whole on their vLLM EP rank" in summary
    assert f"EP={t}" not in base.summary().split("-> vLLM")[1].splitlines()[0]


def test_rollout_ep_refusals(tmp_path, capsys):
    """vLLM EP on a dense model, or with fewer experts than vLLM ranks: one-line errors naming
    the sizes; ``megarl plan reshard --rollout-ep`` reports them as one line, exit 2."""
    import json

    with pytest.raises(ValueError, match="needs a MoE model; Qwen2ForCausalLM is dense"):
        make_reshard_plan(tiny_dims("qwen2"), ParallelLayout(), 2, rollout_ep=True)
    few = tiny_dims("qwen3_moe", num_experts=2)
    with pytest.raises(ValueError, match="vLLM EP=4 .* exceeds the model's 2 experts"):
        make_reshard_plan(few, ParallelLayout(), 4, rollout_ep=True)
    make_reshard_plan(few, ParallelLayout(), 2, rollout_ep=True)  # one expert per rank: fine
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config("qwen2")))
    argv = ["reshard", "--model", str(tmp_path), "--rollout-tp", "2", "--rollout-ep"]
    assert plan_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is dense" in err[0], err


def test_plan_cli_rollout_ep(tmp_path, capsys):
    """``--rollout-ep`` on a MoE config.json; from a config, ``rollout.expert_parallel_size``."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config("qwen3_moe")))
    args = ["reshard", "--model", str(tmp_path), "--pp", "2", "--rollout-tp", "2"]
    assert plan_cli.main([*args, "--rollout-ep"]) == 0
    assert "-> vLLM TP=2 EP=2" in capsys.readouterr().out
    assert plan_cli.main(args) == 0
    assert "EP=2" not in capsys.readouterr().out
    cfg = ["reshard", "--config", "configs/grpo_qwen3_30b_a3b.yaml"]
    assert plan_cli.main([*cfg, "actor_rollout_ref.rollout.expert_parallel_size=4"]) == 0
    assert "-> vLLM TP=4 EP=4" in capsys.readouterr().out


def test_executor_refuses_an_engine_of_the_other_expert_layout():
    """At PP > 1 a rank receives only its plan's expert slices: an engine whose expert layout
    differs would read rows never sent. At PP 1 (whole buckets) either layout loads."""
    from types import SimpleNamespace

    from megarl.rollout.reshard.executor import _check_sink

    engine = SimpleNamespace(tensor_parallel_size=2, tp_rank=0, expert_parallel=True)
    base, ep = _ep_plans("qwen3_moe", (1, 2, 1, 1), 2)
    _check_sink(engine, ep, 0)
    with pytest.raises(ValueError, match="expert_parallel=True, the plan was made for rollout_ep"):
        _check_sink(engine, base, 0)
    _check_sink(engine, _ep_plans("qwen3_moe", (1, 1, 1, 1), 2)[0], 0)
