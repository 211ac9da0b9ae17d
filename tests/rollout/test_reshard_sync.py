"""The resharding executor: in-process checks, then real ranks (fake engine, then real vLLM).

In-process (one rank, no process group): the strided Megatron → HF rewrite against
``hf_mapping`` for every partition kind and TP size; a full sync into a fake engine; the peak of
live bytes allocated during a sync against the plan's bound.

Multi-rank (``_reshard_worker.py``, one torchrun launch per suite):

- ``layouts`` (2 ranks, no vLLM): Megatron (TP, PP, VPP) ∈ {(1,1) DP 2, (2,1), (1,2), (1,2,2)}
  on Qwen2, (1,2) on a tied single-KV-head Qwen3, (2,1) on Qwen3, and Mixture-of-Experts:
  Qwen3-MoE at EP 2 and at PP 2, Mixtral at TP 2 × EP 2 (expert TP 1), and the tied Qwen3 at
  PP 2 split unevenly (3 + 1 layers, ``num_layers_in_last_pipeline_stage``): ownership equals
  Megatron's ``layer_offset``, the synced tensors equal the reference exactly, peak memory within bound;
  the same sliced for vLLM TP 2 (at PP 2 each rank receives only its slices of the other stage,
  point to point; unreceived elements are NaN), bytes received = plan = wire meter.
- ``vllm`` at 2 ranks: vLLM TP 1 ← Megatron (2,1), (1,2), (1,1); vLLM TP 2 ← (2,1), (1,2),
  (1,2,2), (1,1); vLLM TP 2 on the single-KV-head model (KV replication) ← (1,2); vLLM TP 2
  on Qwen3-MoE ← EP 2, TP 2 × EP 2 (expert TP 1), PP 2. At 4 ranks: vLLM TP 2 ← (2,2), (2,1),
  and Mixtral ← PP 2 × EP 2. Per case: perturb the actor, generate, sync (elements a rank did
  not receive set to NaN), generate the same prompts and seeds again; vLLM's log-probs vs the
  actor's runner at T = 0.7; bytes received per rank = plan = wire meter, ~1/vLLM TP of the
  other stages at PP 2 (point to point at 2 ranks, one broadcast per PP group at 4 ranks).
  At 2 ranks also ``lora.merge=false`` (vLLM TP 2 with LoRA layers): an adapter-only sync from
  PP 2, then base and adapters from TP 2 after ``sleep(2)``; and ``lora.merge=true`` on
  Qwen3-MoE at EP 2 with adapters on every expert (merged expert weights through the plan).

The engine-protocol conformance test runs in these launches too: on an ``ActorEngine`` in
``layouts`` and on the vLLM TP 1 engine in ``vllm`` (one check function for both engines).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megarl.config.model_dims import ModelDims
from megarl.models import hf_mapping as hm
from megarl.models.tiny import random_hf_state, tiny_hf_config
from megarl.parallel.layout import ParallelLayout
from megarl.rollout.reshard import make_reshard_plan, stream_buckets
from megarl.rollout.reshard.executor import slot_view, write_hf_from_shards
from tests.conftest import run_torchrun
from tests.rollout._engine_conformance import assert_conforms
from tests.rollout._reshard_worker import vllm_narrow
from tests.rollout._sync_meters import CopySink, LiveBytes

WORKER = Path(__file__).with_name("_reshard_worker.py")
LOGPROB_TOL = 1e-4
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def tiny_dims(family="qwen2", tp=1, **kw) -> ModelDims:
    return ModelDims.from_hf_config(tiny_hf_config(family, **kw), tp_size=tp)


# --------------------------------------------------------------------------------------------
# In-process
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family,kv,tp",
    [("qwen2", 2, 1), ("qwen2", 2, 2), ("qwen2", 2, 4), ("qwen3", 1, 1), ("llama", 4, 4)],
)
def test_strided_rewrite_matches_hf_mapping(family, kv, tp):
    """write_hf_from_shards(stacked TP shards) == megatron_param_to_hf(tp_merge(shards)) for every
    parameter kind (qkv interleave incl. TP > KV groups, fc1, row, vocab padding, norms)."""
    dims = tiny_dims(family, tp=tp, num_key_value_heads=kv, num_layers=1)
    gen = torch.Generator().manual_seed(0)
    for name in hm.megatron_param_names(dims):
        full = torch.randn(hm.megatron_param_shape(name, dims), generator=gen)
        shards = [hm.tp_split(name, full, tp, r, dims) for r in range(tp)]
        if hm.tp_partition_kind(name) == "replicated":
            shards = shards[:1]
        want = hm.megatron_param_to_hf(name, hm.tp_merge(name, shards, dims), dims)
        got = {k: torch.full_like(v, float("nan")) for k, v in want.items()}
        write_hf_from_shards(name, torch.stack(shards), dims, got)
        for k in want:
            assert torch.equal(got[k], want[k]), (name, k)


@pytest.mark.parametrize(
    "family,kv,vocab,rollout_tp",
    [
        ("qwen2", 2, 1000, 2),
        ("qwen2", 2, 1000, 4),
        ("qwen2", 1, 65, 2),
        ("qwen2", 2, 65, 4),
        ("qwen2", 4, 1000, 4),
        ("qwen2_moe", 2, 1000, 2),  # experts and the gated shared expert
        ("mixtral", 2, 1000, 4),  # w1/w3/w2
    ],
)
def test_messages_carry_exactly_what_vllm_loads(family, kv, vocab, rollout_tp):
    """Per bucket and vLLM TP rank: pack the rank's pieces, unpack them into a NaN buffer; the
    parts vLLM's loaders copy (``vllm_narrow``, written from vLLM's code) are all there, and
    nothing else is (KV heads replicated at TP 4 over 2 or 1 heads; a padding-only vocab shard
    at vocab 65, TP 4)."""
    from megarl.rollout.reshard.executor import pack_pieces, piece_view, unpack_pieces

    dims = tiny_dims(family, num_key_value_heads=kv, vocab_size=vocab)
    plan = make_reshard_plan(
        dims, ParallelLayout(1, 2), rollout_tp, bucket_bytes=64 << 10, dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(0)
    for bucket in plan.buckets:
        flat = torch.randn(bucket.numel, generator=gen)
        for v in range(rollout_tp):
            message = torch.empty(bucket.message_numel(v))
            pack_pieces(flat, bucket.slices[v], message)
            got = torch.full_like(flat, float("nan"))
            unpack_pieces(message, bucket.slices[v], got)
            assert int((~got.isnan()).sum()) == message.numel()
            run = bucket.message_range(v)
            if run is not None:  # travels in place: the run is exactly the pieces
                assert torch.equal(flat[run[0] : run[1]], message)
            for slot in bucket.slots:
                want = vllm_narrow(slot.name, slot_view(flat, slot), dims, rollout_tp, v)
                loaded = vllm_narrow(slot.name, slot_view(got, slot), dims, rollout_tp, v)
                assert torch.equal(loaded, want), (slot.name, v)
            for piece in bucket.slices[v]:
                assert piece_view(got, piece).numel() == piece.numel > 0


def _single_rank(bucket_bytes: int, family="qwen2", **kw):
    dims = tiny_dims(family, **kw)
    hf = random_hf_state(dims, seed=3)
    full = hm.hf_to_megatron(hf, dims)
    plan = make_reshard_plan(
        dims, ParallelLayout(), 1, bucket_bytes=bucket_bytes, dtype=torch.float32
    )
    return dims, hf, full, plan


@pytest.mark.parametrize(
    "family,tied", [("qwen2", False), ("qwen2", True), ("qwen3_moe", False), ("mixtral", False)]
)
def test_single_rank_sync_delivers_the_hf_state(family, tied):
    dims, hf, full, plan = _single_rank(64 << 10, family, tie_word_embeddings=tied)
    sink = CopySink(plan)
    stats = stream_buckets(full, plan, sink)
    assert sorted(sink.dest) == sorted(hm.megatron_to_hf(full, dims))
    for name, tensor in sink.dest.items():
        assert torch.equal(tensor, hf[name]), name
    assert sink.calls == ["begin", *[len(b.slots) for b in plan.buckets], "finish"]
    assert stats.buckets == len(plan.buckets) > 5
    assert stats.bytes == plan.total_bytes and stats.gathered_bytes == 0


def test_dtype_mismatch_is_refused():
    _, _, full, plan = _single_rank(64 << 10)
    with pytest.raises(TypeError, match="plan was made for"):
        stream_buckets({k: v.double() for k, v in full.items()}, plan, CopySink(plan))


@pytest.mark.parametrize("bucket_kib", [16, 256, 4096])
def test_peak_extra_memory_within_bucket_bound(bucket_kib):
    """Live bytes allocated during a sync (a dispatch mode counting storages) peak at the
    largest bucket, within the plan's bound, far below the model; nothing is left behind."""
    _, _, full, plan = _single_rank(bucket_kib << 10, num_layers=8)
    sink = CopySink(plan)  # preallocated destinations: the engine's own memory
    with LiveBytes() as meter:
        stream_buckets(full, plan, sink)
    largest = max(b.nbytes for b in plan.buckets)
    print(
        f"\nbucket {bucket_kib} KiB: peak {meter.peak} B, bound {plan.peak_bytes} B, "
        f"model {plan.total_bytes} B"
    )
    assert meter.live == 0
    assert largest <= meter.peak <= plan.peak_bytes
    assert plan.peak_bytes <= max(plan.bucket_bytes, largest)
    if bucket_kib < 1024:
        assert meter.peak < plan.total_bytes / 4


class _DeferredSink(CopySink):
    """Keeps the views it is handed and copies them only when the update finishes, as vLLM does
    for a module it could not fill completely (padded vocabulary rows)."""

    def load_weight_chunk(self, named_tensors) -> None:
        self.kept.extend(named_tensors)
        self.calls.append(len(self.kept))

    def finish_weight_update(self) -> None:
        for name, tensor in self.kept:
            self.dest[name].copy_(tensor)
        self.kept.clear()


class _CountEmpty(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.empty.memory_format:
            self.sizes.append(int(torch.Size(args[0]).numel()))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("deferred", [False, True])
def test_bucket_buffers_reused_only_when_nobody_holds_them(deferred):
    """A buffer is reused for the next bucket (no fresh pages) unless the engine still holds
    views of it; an engine reading its views late still gets the right tensors."""
    _, hf, full, plan = _single_rank(16 << 10, num_layers=8)
    sink = _DeferredSink(plan) if deferred else CopySink(plan)
    with _CountEmpty() as counter:
        stream_buckets(full, plan, sink)
    for name, tensor in sink.dest.items():
        assert torch.equal(tensor, hf[name]), name
    buffers = len(counter.sizes)
    assert buffers == (len(plan.buckets) if deferred else 1), counter.sizes


def test_peak_meter_sees_a_leaky_engine():
    """The meter can fail: an engine that keeps every bucket alive drives the peak to the model
    size."""
    _, _, full, plan = _single_rank(16 << 10, num_layers=8)
    sink = CopySink(plan, retain=True)
    with LiveBytes() as meter:
        stream_buckets(full, plan, sink)
    assert meter.peak == plan.total_bytes > 4 * plan.peak_bytes


def test_consistency_helpers():
    from megarl.rollout.base import RolloutBatch, RolloutSample
    from megarl.rollout.consistency import (
        DIFF_MAX,
        DIFF_MEAN,
        batch_sequences,
        logprob_diff_metrics,
    )

    batch = RolloutBatch(
        [
            RolloutSample(0, 0, [5, 6, 7], [8, 9], [-1.0, -2.0], "length", prompt_id=0),
            RolloutSample(0, 1, [5, 6, 7], [10], [-0.5], "stop", prompt_id=0),
        ],
        n=2,
    )
    ids, plen, lens, lp, mask = batch_sequences(batch, pad_token_id=1)
    assert ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 10, 1]]
    assert plen.tolist() == [3, 3] and lens.tolist() == [5, 4]
    assert lp.tolist() == [[-1.0, -2.0], [-0.5, 0.0]] and mask.tolist() == [[1, 1], [1, 0]]
    actor = torch.tensor([[-1.1, -2.0], [-0.2, 99.0]])  # the padded entry is ignored
    got = logprob_diff_metrics(lp, actor, mask)
    assert got[DIFF_MEAN] == pytest.approx(0.4 / 3) and got[DIFF_MAX] == pytest.approx(0.3)
    assert logprob_diff_metrics(lp[:0], actor[:0], mask[:0]) == {DIFF_MEAN: 0.0, DIFF_MAX: 0.0}
    with pytest.raises(ValueError, match="shapes differ"):
        logprob_diff_metrics(lp, actor[:1], mask)
    from megarl.models.runner import micro_batching

    # micro-batches: largest size <= limit; with VPP a multiple of PP micro-batches (padding)
    assert micro_batching(6, 8) == (6, 6)
    assert micro_batching(6, 4) == (6, 3)
    assert micro_batching(6, 8, multiple=2) == (6, 3)
    assert micro_batching(7, 8, multiple=2) == (8, 4)
    assert micro_batching(5, 2, multiple=4) == (8, 2)


# --------------------------------------------------------------------------------------------
# Multi-rank
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    from megarl.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("reshard_models")
    make_tiny_model(root / "tiny", "qwen2", num_key_value_heads=2, seed=0)
    make_tiny_model(
        root / "special", "qwen3", num_key_value_heads=1, tie_word_embeddings=True, seed=1
    )
    make_tiny_model(root / "qwen3", "qwen3", num_key_value_heads=2, seed=2)
    make_tiny_model(root / "moe", "qwen3_moe", seed=3)
    make_tiny_model(root / "mixtral", "mixtral", seed=4)
    return root


@contextlib.contextmanager
def _env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _launch(models: Path, suite: str, world: int, timeout: int = 900) -> list[dict]:
    out = models / f"out_{suite}_{world}"
    out.mkdir(exist_ok=True)
    # vLLM torch.compiles a small log-prob helper on first use (~8 s per process); eager is
    # numerically the same.
    with _env(VLLM_LOGGING_LEVEL="WARNING", TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1"):
        run_torchrun(
            WORKER,
            world,
            ["--suite", suite, f"--models={models}", f"--out={out}"],
            timeout=timeout,
        )
    return [json.loads((out / f"{suite}_ws{world}_rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def layouts_run(models) -> list[dict]:
    return _launch(models, "layouts", 2)


LAYOUT_CASES = [
    "tiny_tp1_pp1_vpp1",
    "tiny_tp2_pp1_vpp1",
    "tiny_tp1_pp2_vpp1",
    "tiny_tp1_pp2_vpp2",
    "special_tp1_pp2_vpp1",
    "qwen3_tp2_pp1_vpp1",
    "moe_tp1_pp1_vpp1_ep2_etp1",
    "moe_tp1_pp2_vpp1",
    "mixtral_tp2_pp1_vpp1_ep2_etp1",
    "special_tp1_pp2_vpp1_last1",
]


def _fake_checks(result: dict, where: str) -> None:
    assert result["ownership_agrees"], where
    assert result["names_equal"], where
    assert result["max_diff"] == 0.0, where
    assert result["calls"] == result["planned_calls"], where
    assert result["leftover"] == 0, where
    assert result["peak"] <= result["bound"], where
    assert result["peak"] < result["model_bytes"] / 3, where


def _traffic_checks(t: dict, where: str) -> None:
    """Bytes received: plan = executor's count = wire meter; with PP > 1 the rank's slices of
    the other stages, ~1/rollout TP of them (norms whole, KV heads replicated, uneven vocab)."""
    assert t["stats"] == t["planned"] == t["wire"], where
    if t["unsliced"]:
        share = t["planned"]["pipeline"] / t["other_stages_hf_bytes"]
        assert abs(share * t["rollout_tp"] - 1) < 0.1, (where, share)
        assert abs(t["slice_bytes"] * t["rollout_tp"] / t["model_hf_bytes"] - 1) < 0.1, where
    else:
        assert t["planned"]["pipeline"] == 0, where
    # EP 2: the other EP rank's experts arrive whole by broadcast (half the experts)
    assert (t["planned"]["ep"] > 0) == ("_ep2_" in where), where


@pytest.mark.multirank
@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_layouts_fake_engine(layouts_run, case):
    """Plan ownership = Megatron's layer offsets; synced tensors = the reference HF state bit
    for bit; peak extra bytes within the plan's bound on every rank (two bucket sizes). Sliced
    for vLLM TP 2 (rank r is vLLM rank r: at PP 2 the two stages' ranks need different slices,
    sent point to point), with what a rank does not receive set to NaN: the parts vLLM's loader
    of that rank copies equal the reference, nothing else crossed stages, and the bytes received
    are the plan's (executor count and wire meter)."""
    for rank in layouts_run:
        for size in ("small", "large"):
            _fake_checks(rank[case][size], f"rank {rank['rank']} {case} {size}")
        c = rank[case]["sliced"]
        where = f"rank {rank['rank']} {case} sliced"
        assert c["narrowed_max_diff"] == 0.0, where
        assert c["received_elements"] == c["planned_elements"], where
        assert c["leftover"] == 0 and c["peak"] <= c["bound"], (where, c["peak"], c["bound"])
        _traffic_checks(c, where)
        if "_pp2_" in case:
            assert 0 < c["planned"]["pipeline"] < 0.6 * c["unsliced"], where
        if case.endswith("_last1"):  # the uneven split was built: 3 layers, then 1
            assert rank[f"{case}/layers"] == [[3], [1]][rank["rank"]], where


@pytest.fixture(scope="module")
def vllm_runs(models) -> dict[int, list[dict]]:
    return {}


def _vllm(vllm_runs, models, world) -> list[dict]:
    if world not in vllm_runs:
        vllm_runs[world] = _launch(models, "vllm", world, timeout=1500)
    return vllm_runs[world]


VLLM_CASES = [
    (2, "tiny_vtp1_tp2_pp1_vpp1"),
    (2, "tiny_vtp1_tp1_pp2_vpp1"),
    (2, "tiny_vtp1_tp1_pp1_vpp1"),
    (2, "tiny_vtp2_tp2_pp1_vpp1"),
    (2, "tiny_vtp2_tp1_pp2_vpp1"),
    (2, "tiny_vtp2_tp1_pp2_vpp2"),
    (2, "tiny_vtp2_tp1_pp1_vpp1"),
    (2, "special_vtp2_tp1_pp2_vpp1"),  # one KV head replicated by vLLM; tied embeddings
    (2, "moe_vtp2_tp1_pp1_vpp1_ep2_etp1"),  # Qwen3-MoE, experts broadcast over EP 2
    (2, "moe_vtp2_tp2_pp1_vpp1_ep2_etp1"),
    (2, "moe_vtp2_tp1_pp2_vpp1"),  # each expert's vLLM TP slices cross stages
    (4, "tiny_vtp2_tp2_pp2_vpp1"),
    (4, "tiny_vtp2_tp2_pp1_vpp1"),
    (4, "mixtral_vtp2_tp1_pp2_vpp1_ep2_etp1"),
]


@pytest.mark.vllm
@pytest.mark.multirank
@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed")
@pytest.mark.parametrize("world,case", VLLM_CASES)
def test_vllm_logprobs_match_actor_after_sync(vllm_runs, models, world, case):
    """After the sync vLLM's log-probs of its own samples (T=0.7) equal the actor's runner within
    1e-4 on every rank; before it they differ; the same prompts and seeds generated before and
    after the sync give other log-probs (the prefix cache was reset: stale prompt KV would break
    the match). The sync set every element a rank did not receive to NaN, and with PP > 1 a
    rank received only its vLLM TP rank's slices of the other stages: ~1/rollout TP of them,
    bytes as planned (executor count and wire meter)."""
    for rank in _vllm(vllm_runs, models, world):
        c = rank["cases"][case]
        where = f"rank {rank['rank']} {case}"
        _fake_checks(c["fake"], where)
        _traffic_checks(c["traffic"], where)
        assert c["after"]["rollout/logprob_diff_max"] <= LOGPROB_TOL, (where, c["after"])
        assert c["before"]["rollout/logprob_diff_mean"] > 1e-2, (where, c["before"])
        before, after = c["before_samples"], c["after_samples"]
        assert len(before) == len(after) == 6
        for b, a in zip(before, after, strict=True):
            assert b["logprobs"][0] != pytest.approx(a["logprobs"][0], abs=1e-6), where
        assert any(b["response"] != a["response"] for b, a in zip(before, after)), where
        assert c["buckets"] > 3


@pytest.mark.vllm
@pytest.mark.multirank
@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed")
def test_vllm_follows_lora_adapter_only_syncs(vllm_runs, models):
    """``lora.merge=false`` (vLLM TP 2 with LoRA layers): after an adapter-only sync from
    Megatron PP 2 (each stage's adapters gathered over PP; vLLM slices them per TP rank) and
    after a base-and-adapters sync from TP 2 (``sleep(2)`` dropped the base), vLLM's log-probs
    equal the actor's within 1e-4 on every rank; before the first sync they do not. Bytes: the
    adapters alone, then the plan's buckets plus the adapters."""
    ranks = _vllm(vllm_runs, models, 2)
    print(f"LoRA cases: {ranks[0]['timings']['lora_s']:.1f} s")
    for rank in ranks:
        pp2, tp2 = (rank["lora"][k] for k in ("lora_vtp2_tp1_pp2_vpp1", "lora_vtp2_tp2_pp1_vpp1"))
        for c in (pp2, tp2):
            assert c["after"]["rollout/logprob_diff_max"] <= LOGPROB_TOL, (rank["rank"], c)
        assert pp2["before"]["rollout/logprob_diff_mean"] > 1e-2, pp2["before"]
        assert pp2["sync_bytes"] == pp2["adapter_bytes"] < pp2["model_bytes"] / 5
        assert tp2["sync_bytes"] == tp2["model_bytes"] + tp2["adapter_bytes"]


@pytest.mark.vllm
@pytest.mark.multirank
@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed")
def test_vllm_follows_merged_moe_lora_syncs(vllm_runs, models):
    """``lora.merge=true`` on Qwen3-MoE at EP 2 (vLLM TP 2): random non-zero adapters on
    attention and every expert's fc1/fc2 over a perturbed base; after the sync (merged weights
    through the plan, each EP rank's experts broadcast) vLLM's log-probs equal the actor's
    (adapters on) within 1e-4 on every rank, and are far from the actor's with adapters off.
    Bytes: the plan's (the model's)."""
    ranks = _vllm(vllm_runs, models, 2)
    print(f"MoE LoRA merged case: {ranks[0]['timings']['lora_moe_s']:.1f} s")
    for rank in ranks:
        c = rank["lora_moe"]
        assert c["adapted_here"] == 4 * (2 + 2 * 4), c["adapted_here"]  # layers × (attn, 4 experts)
        assert c["after"]["rollout/logprob_diff_max"] <= LOGPROB_TOL, (rank["rank"], c["after"])
        assert c["adapters_off"]["rollout/logprob_diff_mean"] > 1e-2, c["adapters_off"]
        assert c["sync_bytes"] == c["planned_bytes"]


@pytest.mark.vllm
@pytest.mark.multirank
@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed")
@pytest.mark.parametrize("world", [2, 4])
def test_vllm_syncs_move_the_planned_buckets_and_timings_are_reported(vllm_runs, models, world):
    """Every sync into vLLM moved exactly the plan's buckets and bytes; timings are printed."""
    ranks = _vllm(vllm_runs, models, world)
    rank0 = ranks[0]
    syncs = {k: round(c["sync_s"], 3) for k, c in rank0["cases"].items()}
    starts = {k: round(v, 1) for k, v in rank0["timings"].items()}
    print(f"\nws{world}: total {rank0['total_s']:.0f} s, engine starts {starts}, syncs {syncs}")
    for rank in ranks:
        for key, case in rank["cases"].items():
            assert (case["buckets"], case["sync_bytes"]) == (
                case["planned_buckets"],
                case["planned_bytes"],
            ), key
            assert 0 < case["sync_s"] < rank["total_s"], key  # the executor's own clock
            t = case["traffic"]
            print(
                f"rank {rank['rank']} {key}: PP{t['pp_rank']} vLLM rank {t['rollout_rank']}: "
                f"received {t['wire']['pipeline']} B from other stages (planned "
                f"{t['planned']['pipeline']}, unsliced {t['unsliced']}) + {t['wire']['tp']} B "
                "in the TP all-gather"
            )


_VLLM_PARAM = {
    "marks": [
        pytest.mark.vllm,
        pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed"),
    ]
}


@pytest.mark.multirank
@pytest.mark.parametrize(
    "engine,case",
    [
        ("actor", "tiny_tp1_pp1_vpp1"),
        ("actor", "tiny_tp1_pp2_vpp1"),
        pytest.param("vllm", "tiny_vtp1_tp1_pp1_vpp1", **_VLLM_PARAM),
    ],
)
def test_engine_conformance(request, models, engine, case):
    """The rollout-engine protocol, the same test for ActorEngine (Megatron DP 2, and PP 2) and
    VLLMEngine (TP 1, rollout DP 2): attributes and method signatures, n responses per prompt
    prompt-major with prompt ids, seeds, EOS/stop, log-probs equal to the actor's, a sync
    visible in the next generation, call-order errors, sleep/wake, and generate_distributed's
    global prompt ids (see _engine_conformance.py)."""
    if engine == "actor":
        ranks = [rank[case]["conformance"] for rank in request.getfixturevalue("layouts_run")]
    else:
        runs = request.getfixturevalue("vllm_runs")
        ranks = [rank["conformance"] for rank in _vllm(runs, models, 2)]
    for r, rec in enumerate(ranks):
        assert_conforms(rec, f"{engine} {case} rank {r}")
    if case != "tiny_tp1_pp2_vpp1":  # two rollout replicas: each rank its own global prompts
        assert [rec["attributes"]["dp_size"] for rec in ranks] == [2, 2]
        assert ranks[0]["distributed_shard"] == [0, 1, 2]
        assert ranks[1]["distributed_shard"] == [3, 4]


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_sync_with_sleep_keeps_parameter_addresses(models):
    """bf16 on one GPU: generate, sleep, sync (wakes the weights), wake the KV cache, generate.
    vLLM's parameter storages keep their addresses (captured CUDA graphs stay valid) and the
    log-probs follow the actor (bf16 tolerance)."""
    (rank,) = _launch(models, "gpu", 1)
    assert rank["asleep"]
    assert rank["addresses_unchanged"] and rank["num_params"] > 0
    assert rank["after"]["rollout/logprob_diff_mean"] < 0.03, rank["after"]
    assert (
        rank["before"]["rollout/logprob_diff_mean"] > 3 * rank["after"]["rollout/logprob_diff_mean"]
    )


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_vllm_expert_parallel_logprobs_match_actor_after_sync(models):
    """vLLM expert parallelism (rollout.expert_parallel_size=2: whole experts, 4 per rank),
    synced from the actor at EP 2 and at PP 2 with everything unreceived NaN: vLLM's log-probs
    equal the actor's (fp32; 1e-3: vLLM's GPU kernels against Megatron's, a NaN fails)."""
    for rank in _launch(models, "gpu_ep", 2):
        for case in ("moe_vtp2_tp1_pp1_vpp1_ep2_etp1", "moe_vtp2_tp1_pp2_vpp1"):
            assert rank[case]["rollout/logprob_diff_max"] <= 1e-3, (rank["rank"], case)
