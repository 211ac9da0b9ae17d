"""The memory planner without processes: against the resharding plan, a hand calculation for
Qwen2.5-72B, ``megarl config validate`` and the command line's answers to bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.cli import main as cli_main
from megarl.commands import plan as plan_cli
from megarl.config import load_config, validate
from megarl.config.model_dims import ModelDims
from megarl.models.tiny import tiny_hf_config
from megarl.parallel.layout import ParallelLayout
from megarl.planner.fit_warning import gpu_memory_gib, memory_warnings
from megarl.planner.memory import GIB, OptimizerAssumptions, model_state, vllm_weight_bytes
from megarl.planner.memory_plan import (
    NCCL_COMMUNICATOR_BYTES,
    Cluster,
    nccl_communicators,
    plan_memory,
)
from megarl.planner.memory_search import search_layouts
from megarl.planner.model_presets import PRESETS
from megarl.planner.vllm_pool import CUDA_GRAPH_BYTES
from megarl.rollout.reshard.make_plan import make_reshard_plan

CFG_72B = str(Path(__file__).resolve().parents[2] / "configs" / "ppo_qwen2_5_72b.yaml")
MEG = "actor_rollout_ref.actor.megatron"
NO_OFFLOAD_TP1_PP1 = [
    f"{MEG}.tensor_model_parallel_size=1",
    f"{MEG}.pipeline_model_parallel_size=1",
    *(f"{m}.{k}=false" for m in (MEG, "critic.megatron")
      for k in ("param_offload", "grad_offload", "optimizer_offload")),
]  # fmt: skip


PPO_PHASES = ("setup", "generate", "reward", "old_log_prob", "ref", "values", "update_critic",
              "update_actor", "sync", "checkpoint")  # fmt: skip
"""A PPO run with a critic and a reference (KL in the reward) goes through every phase."""


def _dims_72b() -> ModelDims:
    return ModelDims.from_hf_config(PRESETS["qwen2.5-72b"])


@pytest.mark.parametrize(
    "hf",
    [
        tiny_hf_config("qwen2"),
        tiny_hf_config("llama", tie_word_embeddings=True, num_key_value_heads=1),
        tiny_hf_config("qwen3", vocab_size=1001),
        PRESETS["qwen2.5-72b"],
        PRESETS["qwen2.5-7b"],
    ],
    ids=["qwen2", "llama_tied_kv1", "qwen3_odd_vocab", "qwen2.5-72b", "qwen2.5-7b"],
)
@pytest.mark.parametrize("rollout_tp", [1, 2, 4])
def test_vllm_weight_bytes_equal_the_resharding_plans(hf, rollout_tp):
    dims = ModelDims.from_hf_config(hf)
    if dims.num_attention_heads % rollout_tp:
        pytest.skip("rollout TP does not divide the heads")
    reshard = make_reshard_plan(dims, ParallelLayout(), rollout_tp)
    assert vllm_weight_bytes(dims, rollout_tp, 2) == reshard.rollout_bytes_per_rank()


def test_qwen72b_actor_state_per_gpu_equals_the_hand_calculation():
    """TP 8, PP 4, DP 2, bf16, fp32 gradient buffers, distributed optimizer, TE FusedAdam.

    Hand calculation for one GPU of the last stage (20 layers + final norm + output layer),
    h=8192, F=29568, d=128, 64 query / 8 KV heads, vocabulary 152064 padded to 152576 (a
    multiple of 128·8), per TP rank:
      linear_qkv  (64 + 2·8)·128/8 × 8192 = 10,485,760  + bias 1,280
      linear_proj 8192 × 64·128/8         =  8,388,608
      linear_fc1  2·29568/8 × 8192        = 60,555,264
      linear_fc2  8192 × 29568/8          = 30,277,632
      two norms   2 × 8192                =     16,384
      one layer                           = 109,724,928;  20 layers = 2,194,498,560
      final norm 8,192 + output layer 152576/8 × 8192 = 156,237,824
      n = 2,350,744,576 elements.
    Every count is a multiple of 64 and n of lcm(2, 128): Megatron's buffer adds no padding.
    Bytes: params 2n (bf16) + gradient buffer 4n (fp32) + main params 4n/2 + Adam 8n/2 = 12n
    = 28,208,934,912 B = 26.27 GiB.
    """
    n = 20 * (10_485_760 + 1_280 + 8_388_608 + 60_555_264 + 30_277_632 + 16_384)
    n += 8_192 + 156_237_824
    assert n == 2_350_744_576
    state = model_state(_dims_72b(), ParallelLayout(8, 4), 64, "actor", OptimizerAssumptions())
    assert (state.params, state.grads, state.main_params, state.optimizer_states) == (
        2 * n,
        4 * n,
        2 * n,
        4 * n,
    )
    assert state.total == 12 * n == 28_208_934_912


def test_qwen72b_config_fits_and_tp1_pp1_without_offload_does_not():
    cluster = Cluster(8, 8, 80.0)
    dims = _dims_72b()
    assert plan_memory(load_config(CFG_72B), dims, cluster).fits
    cfg = load_config(CFG_72B, NO_OFFLOAD_TP1_PP1)
    plan = plan_memory(cfg, dims, cluster)
    assert not plan.fits
    update = next(p for p in plan.phases if p.name == "update_actor")
    assert update.total > 80 * GIB  # 72.7B parameters at 16 B/param over DP 64 alone: ~1.2 TB/64
    proposals = search_layouts(cfg, dims, cluster)
    assert proposals
    assert [p.key for p in proposals] == sorted(p.key for p in proposals)
    for p in proposals:
        assert p.plan.fits
        proposed = load_config(CFG_72B, [*NO_OFFLOAD_TP1_PP1, *p.overrides])
        assert plan_memory(proposed, dims, cluster).fits
        warnings = _validate(proposed, 64)
        assert not [w for w in warnings if w.startswith("memory:")], warnings


def _validate(cfg, world: int) -> list[str]:
    """What ``megarl config validate`` and each training rank warn: the config's checks, then
    the planner's fit."""
    return validate(cfg, world) + memory_warnings(cfg, world)


def test_validate_warns_when_a_config_does_not_fit():
    warnings = _validate(load_config(CFG_72B, NO_OFFLOAD_TP1_PP1), 64)
    memory = [w for w in warnings if w.startswith("memory:")]
    assert len(memory) == 1 and "does not fit on 79.2 GiB GPUs" in memory[0], warnings
    assert "update_actor" in memory[0]
    assert not [w for w in _validate(load_config(CFG_72B), 64) if w.startswith("memory:")]


def test_config_validate_prints_the_memory_warning(capsys):
    argv = ["config", "validate", "-c", CFG_72B, "--world-size", "64", *NO_OFFLOAD_TP1_PP1]
    assert cli_main(argv) == 0
    err = capsys.readouterr().err
    assert "warning: memory: does not fit on 79.2 GiB GPUs" in err and "update_actor" in err, err


def test_plan_cli_text_and_json(capsys):
    assert plan_cli.main(["--config", CFG_72B]) == 0
    out = capsys.readouterr().out
    for phase in PPO_PHASES:
        assert f"phase {phase}:" in out
    assert "verdict: FITS" in out and "host RAM per node" in out and "KV cache" in out
    assert plan_cli.main(["--config", CFG_72B, "--json", *NO_OFFLOAD_TP1_PP1]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False and data["proposals"]
    assert [p["name"] for p in data["phases"]] == list(PPO_PHASES)
    assert plan_cli.main(["--config", CFG_72B, "--gpu-memory", "40", "--nodes", "16"]) == 0
    assert "16 node(s) × 8 GPU(s) of 40 GiB" in capsys.readouterr().out


def _no_heads(tmp_path) -> str:
    cfg = tiny_hf_config("qwen2")
    del cfg["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        ([], "--config"),
        (["--config", CFG_72B, "--preset", "qwen9"], "unknown preset 'qwen9'"),
        (["--config", CFG_72B, "--model", "/no/such/model"], "/no/such/model"),
        (
            ["--config", CFG_72B, f"{MEG}.tensor_model_parallel_size=3"],
            "tensor_model_parallel_size",
        ),
        (["--config", CFG_72B, "--gpu-memory", "0"], "--gpu-memory"),
        (  # the config's own model allows PP 4; the preset planned (94 layers) does not
            ["--config", CFG_72B, "--preset", "qwen3-235b-a22b"],
            f"num_hidden_layers=94 is not divisible by {MEG}.pipeline_model_parallel_size=4",
        ),
        (["--config", "no/such.yaml"], "no/such.yaml"),
        (["reshard"], "--config, --model or --preset"),
        (["reshard", "--model", "/no/such/model"], "/no/such/model"),
        (["reshard", "--model", "NO_HEADS"], "num_attention_heads"),
        (["reshard", "--preset", "qwen2.5-7b", "--rollout-tp", "0"], "--rollout-tp"),
        (["reshard", "--preset", "qwen2.5-7b", "--tp", "-2"], "argument --tp: must be >= 1"),
        (["reshard", "--preset", "qwen9"], "unknown preset 'qwen9'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, names, tmp_path, capsys):
    argv = [_no_heads(tmp_path) if a == "NO_HEADS" else a for a in argv]
    assert plan_cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and names in lines[0], captured.err
    assert "Traceback" not in captured.err and captured.out == ""


OWN_RANKS = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=8"]
"""vLLM on a node of its own (8 rollout ranks)."""


@pytest.mark.parametrize(
    "overrides",
    [[], NO_OFFLOAD_TP1_PP1, ["actor_rollout_ref.rollout.free_cache_engine=false"],
     ["actor_rollout_ref.rollout.name=actor", "algorithm.use_kl_in_reward=false"], OWN_RANKS],
    ids=["offloads", "no_offloads", "vllm_awake", "actor_engine_no_ref", "vllm_own_ranks"],
)  # fmt: skip
def test_the_planner_sums_the_residency_schedule(overrides):
    """Each phase of the plan holds exactly the state the schedule the trainer applies keeps on
    the device (tests/trainer/test_trainer_runs.py holds the trainer to the same schedule; with
    vLLM on ranks of its own, tests/trainer/test_disaggregated.py), and with vLLM on ranks of its
    own one more phase: a rollout GPU, vLLM's pool and the bucket coming in over NCCL."""
    from megarl.config import critic_enabled, ref_used
    from megarl.planner.residency import schedule

    cfg = load_config(CFG_72B, overrides)
    dims = _dims_72b()
    plan = plan_memory(cfg, dims, Cluster(8, 8, 80.0))
    declared = schedule(cfg)
    phases = list(plan.phases)
    if overrides == OWN_RANKS:
        own = phases.pop()
        assert own.name == "rollout ranks"
        assert {t.name: t.nbytes for t in own.terms} == {
            "vLLM pool": int(0.5 * 80 * GIB), "bucket received": 1 << 30,
            "NCCL communicators": 3 * NCCL_COMMUNICATOR_BYTES}  # vLLM TP 8 (2), weights  # fmt: skip
    assert [p.name for p in phases] == list(declared)
    opt = OptimizerAssumptions(impl="transformer_engine", adam="fused")
    layout = ParallelLayout(
        cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size,
        cfg.actor_rollout_ref.actor.megatron.pipeline_model_parallel_size,
    )
    for phase in phases:
        terms = {t.name: t.nbytes for t in phase.terms}
        for role, on in declared[phase.name].models.items():
            state = model_state(dims, layout, 64, "ref" if role == "ref" else role, opt)
            assert terms.get(f"{role} params", 0) == (state.params if on.params else 0)
            assert terms.get(f"{role} gradient buffers", 0) == (state.grads if on.grads else 0)
            optimizer = state.main_params + state.optimizer_states if on.optimizer else 0
            assert terms.get(f"{role} fp32 main params + Adam moments", 0) == optimizer
        engine = declared[phase.name].engine
        if engine is None:
            assert not [n for n in terms if n.startswith("vLLM")]
        elif engine.kv_cache:
            assert terms["vLLM pool"] == int(0.5 * 80 * GIB)
        elif engine.weights:
            assert terms["vLLM weights (awake)"] == vllm_weight_bytes(dims, 8, 2)
            assert terms["vLLM CUDA graphs"] == plan.kv_cache["cuda_graph_bytes"]
        else:
            assert terms["vLLM asleep"] == 0
            assert terms["vLLM CUDA graphs"] == plan.kv_cache["cuda_graph_bytes"]
        comms = len(nccl_communicators(cfg, 64)) + (overrides == OWN_RANKS)  # + weights' group
        assert terms["NCCL communicators"] == comms * NCCL_COMMUNICATOR_BYTES > 0
    assert ("ref" in declared) == ref_used(cfg) and ("values" in declared) == critic_enabled(cfg)


def test_the_72b_setup_phase_holds_one_model_being_built():
    """vLLM sleeps from right after its start; each model moves to its setup residency right
    after it is built, so setup holds the largest model's params + grads + main params once."""
    cfg = load_config(CFG_72B)
    plan = plan_memory(cfg, _dims_72b(), Cluster(8, 8, 80.0))
    setup = next(p for p in plan.phases if p.name == "setup")
    opt = OptimizerAssumptions(impl="transformer_engine", adam="fused")
    built = {}
    for role in ("actor", "critic"):  # the reference (params only) is smaller
        state = model_state(_dims_72b(), ParallelLayout(8, 4), 64, role, opt)
        built[f"{role} while built"] = state.params + state.grads + state.main_params
    largest = max(built, key=built.get)
    assert {t.name: t.nbytes for t in setup.terms} == {
        "vLLM asleep": 0, "vLLM CUDA graphs": CUDA_GRAPH_BYTES, largest: built[largest],
        "NCCL communicators": 15 * NCCL_COMMUNICATOR_BYTES}  # fmt: skip
    assert plan.fits and setup.total < 20 * GIB + 15 * NCCL_COMMUNICATOR_BYTES + CUDA_GRAPH_BYTES


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_vllm_on_ranks_of_its_own_leaves_the_training_gpus_and_stages_in_host_memory(staleness):
    """The training GPUs of the 72B config hold no vLLM in any phase (its generate phase drops
    by the pool, 40 GiB); beyond one step off host memory holds each rollout rank's staged
    update (what its vLLM TP rank of 8 loads, in bf16) for the 8 rollout ranks of a node:
    about the whole model once; nothing colocated."""
    colocated = plan_memory(load_config(CFG_72B), _dims_72b(), Cluster(8, 8, 80.0))
    off = [*OWN_RANKS, f"async_training.staleness_threshold={staleness}"]
    own = plan_memory(load_config(CFG_72B, off), _dims_72b(), Cluster(8, 8, 80.0))
    generate = [{p.name: p.total for p in plan.phases}["generate"] for plan in (colocated, own)]
    # vLLM's pool and its TP group's two communicators leave; the weights' group comes (NCCL)
    comms = 2 - (staleness <= 1)
    assert generate[0] - generate[1] == int(0.5 * 80 * GIB) + comms * NCCL_COMMUNICATOR_BYTES

    def staged(plan) -> int:
        return {t.name: t.nbytes for t in plan.host_ram_per_node}[
            "weight updates staged on rollout ranks"
        ]

    part = vllm_weight_bytes(_dims_72b(), 8, 2)
    assert staged(own) == (8 * part if staleness > 1 else 0) and staged(colocated) == 0
    # at most one step off the buckets go GPU to GPU over NCCL: one more on each side's GPU
    terms = {p.name: {t.name: t.nbytes for t in p.terms} for p in own.phases}
    nccl = {"sync": "bucket sent to the rollout ranks", "rollout ranks": "bucket received"}
    for phase, term in nccl.items():
        assert terms[phase].get(term) == (1 << 30 if staleness <= 1 else None), (phase, term)
    assert staleness < 2 or 1 < staged(own) / vllm_weight_bytes(_dims_72b(), 1, 2) < 1.01


CFG_7B = str(Path(CFG_72B).with_name("grpo_qwen2_5_7b.yaml"))


def test_nccl_communicators_are_each_group_of_two_or_more_ranks():
    """The 7B config (8 GPUs, TP 4, vLLM TP 2 colocated), by hand: the world, Megatron's
    model-parallel (TP × PP), TP, DP, DP × CP, TP × CP groups (each an object of its own at CP
    1 too), the expert grid's at a dense model's EP 1 (expert TP = TP), the distributed
    optimizer's instance (the world), vLLM's TP group twice (torch's and PyNccl's); PP 2 adds PP
    and the embedding group (DP 1 then; both stages hold vLLM TP rank 0: no pair for the weight
    sync), CP 2 the CP group. Pairs of ranks: tests/planner/test_communicators.py, against
    connect_groups itself."""
    cfg = load_config(CFG_7B)
    assert nccl_communicators(cfg, 8) == {
        "world": 8, "model": 4, "tensor": 4, "data": 2, "data×context": 2, "tensor×context": 4,
        "expert tensor": 4, "expert tensor×expert": 4, "expert tensor×expert×pipeline": 4,
        "expert data": 2, "optimizer instance": 8, "vLLM TP": 2, "vLLM TP (PyNccl)": 2,
    }  # fmt: skip
    pp2 = load_config(CFG_7B, [f"{MEG}.pipeline_model_parallel_size=2"])
    assert nccl_communicators(pp2, 8) == {
        "world": 8, "model": 8, "tensor": 4, "pipeline": 2, "tensor×context": 4, "embedding": 2,
        "expert tensor": 4, "expert tensor×expert": 4, "expert tensor×expert×pipeline": 8,
        "optimizer instance": 8, "vLLM TP": 2, "vLLM TP (PyNccl)": 2,
    }  # fmt: skip
    cp2 = nccl_communicators(load_config(CFG_7B, [f"{MEG}.context_parallel_size=2"]), 8)
    assert {"context": 2, "data×context": 2, "tensor×context": 8}.items() <= cp2.items()
    assert "data" not in cp2  # DP 1 at TP 4 × CP 2 of 8
    plan = plan_memory(cfg, ModelDims.from_hf_config(PRESETS["qwen2.5-7b"]), Cluster(1, 8))
    for phase in plan.phases:
        assert {t.name: t.nbytes for t in phase.terms}["NCCL communicators"] == 6.5 * GIB


def test_a_sleeping_vllm_keeps_its_cuda_graphs():
    """vLLM 0.32's sleep frees weights and KV cache, not the CUDA graph pool (captured outside
    its sleep allocator): every phase with vLLM asleep carries it, none with enforce_eager."""
    dims = ModelDims.from_hf_config(PRESETS["qwen2.5-7b"])
    for eager, graphs in ((False, CUDA_GRAPH_BYTES), (True, 0)):
        cfg = load_config(CFG_7B, [f"actor_rollout_ref.rollout.enforce_eager={str(eager).lower()}"])
        plan = plan_memory(cfg, dims, Cluster(1, 8))
        asleep = [p for p in plan.phases if "vLLM asleep" in {t.name for t in p.terms}]
        assert {p.name for p in asleep} >= {"setup", "reward", "update_actor"}
        for phase in asleep:
            assert {t.name: t.nbytes for t in phase.terms}["vLLM CUDA graphs"] == graphs


def test_the_plan_takes_the_gpus_own_memory_where_cuda_runs():
    """No CUDA here: an H100's total as CUDA reports it (79.2 GiB, not 80), or the caller's;
    validation's warning names it (tests/planner/test_memory_gpu.py: on a GPU, its own)."""
    import torch

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory / GIB
        assert gpu_memory_gib() == gpu_memory_gib(50.0) == total
    else:
        assert gpu_memory_gib() == 79.2 and gpu_memory_gib(50.0) == 50.0
        assert Cluster(1, 8).usable_bytes == int(75.2 * GIB)


def test_the_7b_config_keeps_a_stated_margin():
    """The 7B config's generate phase is the peak at 70.9 GiB, 4.3 GiB under the 75.2 usable of
    an H100 (79.2 less the 4 GiB reserve), with NCCL's 13 communicators (6.5 GiB); at the earlier
    gpu_memory_utilization 0.6 it did not fit (78.8), as the config's comment says."""
    dims = ModelDims.from_hf_config(PRESETS["qwen2.5-7b"])
    plan = plan_memory(load_config(CFG_7B), dims, Cluster(1, 8))
    peak = max(plan.phases, key=lambda p: p.total)
    assert plan.fits and peak.name == "generate"
    assert round(peak.total / GIB, 1) == 70.9
    assert round((plan.cluster.usable_bytes - peak.total) / GIB, 1) == 4.3
    before = load_config(CFG_7B, ["actor_rollout_ref.rollout.gpu_memory_utilization=0.6"])
    assert not plan_memory(before, dims, Cluster(1, 8)).fits


def test_a_distillation_teacher_is_planned_at_its_own_shape(tmp_path):
    """megarl plan with a Megatron teacher (issue 57): a ``teacher`` phase after ``ref`` with its
    forward's activations, and the teacher's parameters in every phase at its own shape (its
    config.json: twice the student's layers here, so about twice the actor's layer bytes),
    counted as model_state counts a frozen model of that shape."""
    from megarl.models.tiny import make_tiny_model
    from megarl.planner.memory import model_state as state_of
    from megarl.planner.memory_plan import Cluster, _assumptions

    make_tiny_model(tmp_path / "teacher", "qwen2", num_layers=8)
    cfg = load_config(
        Path(CFG_72B).with_name("grpo_tiny_cpu.yaml"),
        ["distillation.enabled=true", "distillation.nnodes=0",
         f"+distillation.teacher_models.teacher_model.model_path={tmp_path / 'teacher'}",
         "distillation.teacher_models.teacher_model.inference.name=megatron"],
    )  # fmt: skip
    student = ModelDims.from_hf_config(tiny_hf_config("qwen2"))
    plan = plan_memory(cfg, student, Cluster(1, 2, 80.0))
    names = [p.name for p in plan.phases]
    assert names.index("teacher") == names.index("ref") + 1
    teacher_phase = plan.phases[names.index("teacher")]
    assert any(t.name.startswith("forward activations") for t in teacher_phase.terms)
    layout = cfg.actor_rollout_ref.actor.megatron.parallel_layout()
    want = state_of(ModelDims.from_hf_config(json.loads((tmp_path / "teacher" / "config.json").read_text())),
                    layout, 2, "ref", _assumptions(cfg, cfg.actor_rollout_ref.ref.megatron))  # fmt: skip
    for phase in plan.phases:
        (params,) = [t for t in phase.terms if t.name == "teacher params"]
        assert params.nbytes == want.params
    actor = next(t for t in plan.phases[0].terms if t.name == "actor params").nbytes
    assert params.nbytes > 1.3 * actor


def test_a_vllm_teachers_pool_is_planned_on_its_own_gpus(tmp_path):
    """megarl plan with verl's vLLM teacher (issue 57): a ``teacher ranks`` phase holding the
    teacher's weights per rank (its own shape: Qwen2.5-32B at TP 2, bf16) in its pool of
    ``inference.gpu_memory_utilization`` × G; at 0.4 of an 80 GiB GPU (verl's OPD example's
    setting) weights, a prefill and its prompt log-probs' logits leave no KV cache, at 0.6 they
    do; the training ranks' phases are as without a teacher."""
    from megarl.planner.memory_plan import Cluster

    (tmp_path / "teacher").mkdir()
    (tmp_path / "teacher" / "config.json").write_text(json.dumps(PRESETS["qwen2.5-32b"]))
    base = ["trainer.dtype=bf16", "distillation.enabled=true", "distillation.nnodes=1",
            "distillation.n_gpus_per_node=4",
            f"+distillation.teacher_models.teacher_model.model_path={tmp_path / 'teacher'}"]  # fmt: skip
    tiny = Path(CFG_72B).with_name("grpo_tiny_cpu.yaml")
    student = ModelDims.from_hf_config(tiny_hf_config("qwen2"))
    cluster = Cluster(1, 2, 80.0)

    def plan(util: float):
        util_key = "distillation.teacher_models.teacher_model.inference.gpu_memory_utilization"
        return plan_memory(load_config(tiny, [*base, f"{util_key}={util}"]), student, cluster)

    tight, roomy = plan(0.4), plan(0.6)
    teacher = {p.name: p for p in tight.phases}["teacher ranks"]
    weights = next(t for t in teacher.terms if t.name == "teacher's vLLM weights").nbytes
    dims = ModelDims.from_hf_config(PRESETS["qwen2.5-32b"])
    assert weights == vllm_weight_bytes(dims, 2, 2)
    assert 29 * GIB < weights < 32 * GIB  # ~32.8e9 parameters, bf16, halved by TP 2
    assert tight.teacher_gpus == 4 and tight.teacher_kv_bytes <= 0 and not tight.fits
    assert "teacher: no room left in its vLLM pool for the KV cache" in tight.reason()
    assert roomy.teacher_kv_bytes > 0 and roomy.fits, roomy.reason()
    without = plan_memory(load_config(tiny, ["trainer.dtype=bf16"]), student, cluster)
    assert [p.total for p in without.phases] == [p.total for p in roomy.phases[:-1]]
