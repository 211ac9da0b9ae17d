"""verl keys whose value is megarl's behaviour anyway are accepted; those asking for something
megarl does not have are refused in one line naming the key and the values that work; the keys
megarl honours (``nccl_timeout``, ``optim.lr_decay_steps``, ``override_optimizer_config``) reach
what is built (:func:`megarl.trainer.setup.optimizer_settings`, ``build_run``'s timeout)."""

from __future__ import annotations

import pytest

from megarl.config import ConfigError, load_config, validate
from tests.config._bad_configs import GRPO

ARR = "actor_rollout_ref"
OVR = f"+{ARR}.actor.optim.override_optimizer_config"


def _problems(overrides: list[str]) -> list[str]:
    try:
        validate(load_config(GRPO, overrides), 2)
    except ConfigError as exc:
        return exc.problems
    return []


@pytest.mark.parametrize(
    "overrides",
    [
        ["model_engine=megatron"],
        [f"{ARR}.hybrid_engine=True"],
        [f"{ARR}.rollout.calculate_log_probs=True", f"{ARR}.rollout.calculate_log_probs=False"],
        [f"{ARR}.actor.use_torch_compile=False", f"{ARR}.ref.use_torch_compile=False"],
        [f"{ARR}.{r}.megatron.use_mbridge={v}" for r in ("actor", "ref") for v in ("True", "False")]
        + [f"critic.megatron.vanilla_mbridge={v}" for v in ("True", "False")],
        [f"{ARR}.model.use_fused_kernels=True", f"{ARR}.actor.use_fused_kernels=True",
         "critic.model.use_fused_kernels=False"],
        [f"{ARR}.actor.megatron.seed=42", f"{ARR}.ref.megatron.seed=42", "critic.megatron.seed=42"],
        ["trainer.seed=7", f"{ARR}.actor.megatron.seed=7"],
        [f"{ARR}.nccl_timeout=600", "critic.nccl_timeout=600"],
        [f"{ARR}.actor.optim.lr_decay_steps=100", "critic.optim.lr_decay_steps=50"],
        [f"{ARR}.actor.optim.{k}=fp32" for k in ("main_grads_dtype", "exp_avg_dtype")]
        + [f"critic.optim.{k}=False" for k in ("use_precision_aware_optimizer",
                                               "use_layer_wise_distributed_optimizer")]
        + [f"{ARR}.actor.optim.total_training_steps=-1", "critic.optim.lr_wsd_decay_steps=5",
           f"{ARR}.actor.optim.lr_wsd_decay_style=cosine",
           f"{ARR}.actor.optim.weight_decay_incr_style=constant",
           f"{ARR}.actor.checkpoint.async_save=False", f"{ARR}.ref.strategy=megatron"],
        ["trainer.dtype=bf16", f"{ARR}.actor.megatron.dtype=bfloat16", f"{ARR}.ref.megatron.dtype=bf16",
         "critic.megatron.use_megatron_fsdp=False",
         f"{ARR}.actor.megatron.override_mcore_model_config={{}}"],
        [f"{ARR}.actor.megatron.dtype=float32", "critic.megatron.dtype=fp32"],  # the config's fp32
        [f"{ARR}.actor.entropy_from_logits_with_chunking=True", f"{ARR}.ref.rollout_n=8",
         f"{ARR}.actor.megatron.entropy_from_logits_chunk_size=512", "critic.rollout_n=8",
         f"{ARR}.rollout.logprobs_mode=processed_logprobs", f"{ARR}.rollout.skip_tokenizer_init=True"],
        ["trainer.default_hdfs_dir=null", "trainer.del_local_ckpt_after_load=False",
         "trainer.val_only=False", f"{ARR}.model.external_lib=null", f"{ARR}.model.use_shm=False",
         "critic.model.custom_chat_template=null", f"{ARR}.model.enable_activation_offload=False",
         f"{ARR}.model.use_liger=False"],
        [f"{ARR}.rollout.{k}" for k in ("ignore_eos=False", "over_sample_rate=0",
         "data_parallel_size=1", "pipeline_model_parallel_size=1", "multi_stage_wake_up=False")],
        [f"{OVR}.adam_eps=1e-5", f"{OVR}.adam_beta2=0.95", f"{OVR}.use_precision_aware_optimizer=False",
         f"{OVR}.optimizer_cpu_offload=False", f"{OVR}.main_grads_dtype=fp32"],
        # verl's fully-async MoE script without its CPU optimizer: with fp32 dtypes the
        # precision-aware Adam is megarl's; the offload knobs act only with optimizer_cpu_offload
        [f"{OVR}.use_precision_aware_optimizer=True", f"{OVR}.optimizer_offload_fraction=1.",
         f"{OVR}.overlap_cpu_optimizer_d2h_h2d=True", "critic.optim.use_precision_aware_optimizer=True"],
    ],
)  # fmt: skip
def test_values_that_are_megarls_behaviour_validate(overrides):
    assert _problems(overrides) == []


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model_engine=dp", "model_engine=dp: megarl is the Megatron engine; use model_engine=megatron"),
        (f"{ARR}.hybrid_engine=False", f"{ARR}.hybrid_engine=false (verl's async recipes) needs the rollout's own ranks: set rollout.nnodes (or actor_rollout_ref.rollout.nnodes) > 0, or hybrid_engine=true"),
        (f"{ARR}.actor.megatron.seed=3", f"{ARR}.actor.megatron.seed=3: megarl seeds Megatron with trainer.seed (42); use 42, leave it unset, or set trainer.seed=3"),
        ("critic.megatron.seed=3", "critic.megatron.seed=3: megarl seeds Megatron with trainer.seed (42); use 42"),
        (f"{ARR}.nccl_timeout=0", f"{ARR}.nccl_timeout must be a positive number of seconds or null, got 0"),
        (f"critic.nccl_timeout=60 {ARR}.nccl_timeout=30", f"critic.nccl_timeout=60: megarl has one process-group timeout, {ARR}.nccl_timeout; leave critic.nccl_timeout unset or equal to it (30)"),
        (f"{ARR}.actor.optim.lr_decay_steps=0", f"{ARR}.actor.optim.lr_decay_steps must be a positive number or null, got 0"),
        (f"{OVR}.optimizer_cpu_offload=True", f"{OVR[1:]}.optimizer_cpu_offload=True: no CPU optimizer step: Megatron's hybrid CPU/GPU optimizer undoes a weights-only load at the next step (measured: weights moved by up to 1.18 at lr 0), cannot be built over fp32 parameters (\"can't optimize a non-leaf Tensor\") and cannot step without CUDA (KeyError); megatron.optimizer_offload=true moves the optimizer state to CPU between steps; use false"),
        (f"{OVR}.exp_avg_dtype=bf16", "exp_avg_dtype='bf16': Adam moments are fp32; use fp32 or float32 or torch.float32"),
        (f"{ARR}.actor.optim.exp_avg_dtype=bf16", f"{ARR}.actor.optim.exp_avg_dtype=bf16: main gradients and Adam moments are fp32; use fp32 or float32 or torch.float32"),
        ("critic.checkpoint.async_save=True", "critic.checkpoint.async_save=true: saves are synchronous; use false"),
        (f"{ARR}.rollout.ignore_eos=True", f"{ARR}.rollout.ignore_eos=true: training rollouts stop at EOS; use false"),
        (f"{ARR}.rollout.over_sample_rate=0.1", f"{ARR}.rollout.over_sample_rate=0.1: no over-sampling; use 0"),
        (f"{ARR}.rollout.data_parallel_size=2", f"{ARR}.rollout.data_parallel_size=2: each vLLM engine is one TP group"),
        (f"{ARR}.rollout.pipeline_model_parallel_size=2", f"{ARR}.rollout.pipeline_model_parallel_size=2: vLLM runs tensor-parallel only; use 1"),
        (f"{ARR}.rollout.multi_stage_wake_up=True", f"{ARR}.rollout.multi_stage_wake_up=true: vLLM wakes up in one stage; use false"),
        (f"{ARR}.actor.megatron.dtype=float16", f"{ARR}.actor.megatron.dtype=float16: megarl's dtype is trainer.dtype (fp32); use fp32 or float32 or torch.float32 or leave it unset"),
        (f"{ARR}.ref.megatron.dtype=bfloat16", f"{ARR}.ref.megatron.dtype=bfloat16: megarl's dtype is trainer.dtype (fp32); use fp32 or float32 or torch.float32 or leave it unset, or set trainer.dtype=bf16"),
        ("critic.megatron.use_megatron_fsdp=True", "critic.megatron.use_megatron_fsdp=true: Megatron DDP with the distributed optimizer; use false"),
        (f"+{ARR}.ref.megatron.override_mcore_model_config.x=1", f"{ARR}.ref.megatron.override_mcore_model_config={{'x': 1}}: TransformerConfig fields go in {ARR}.ref.megatron.override_transformer_config"),
        (f"{ARR}.rollout.logprobs_mode=raw_logprobs", f"{ARR}.rollout.logprobs_mode=raw_logprobs: vLLM reports log-probs after temperature scaling; use processed_logprobs"),
        ("critic.rollout_n=3", f"critic.rollout_n=3: responses per prompt are {ARR}.rollout.n (8); use 8 or leave it unset"),
        ("trainer.default_hdfs_dir=hdfs://ckpt", "trainer.default_hdfs_dir=hdfs://ckpt: checkpoints are local (trainer.default_local_dir); use null"),
        ("trainer.val_only=True", "trainer.val_only=true: validation-only runs are not supported yet; use false"),
        (f"{ARR}.model.external_lib=my_pkg", f"{ARR}.model.external_lib=my_pkg: no custom modelling code is imported; use null"),
        ("critic.model.enable_activation_offload=True", "critic.model.enable_activation_offload=true: no activation offloading; use false"),
        (f"{ARR}.rollout.skip_tokenizer_init=False", f"{ARR}.rollout.skip_tokenizer_init=false: prompts reach vLLM as token ids and responses leave as token ids; use true"),
        (f"{OVR}.adam_eps=-1", f"{OVR[1:]}.adam_eps=-1 must be a number >= 0"),
        (f"{ARR}.rollout.checkpoint_engine.backend=nccl", f"{ARR}.rollout.checkpoint_engine.backend=nccl: megarl's weight sync streams the resharding plan's buckets over torch.distributed (verl's naive backend); use naive"),
        (f"{ARR}.rollout.checkpoint_engine.update_weights_bucket_megabytes=0", f"{ARR}.rollout.checkpoint_engine.update_weights_bucket_megabytes must be >= 1, got 0"),
        (f"+{ARR}.rollout.moe_tensor_parallel_size=1", f"{ARR}.rollout.moe_tensor_parallel_size=1: vLLM splits the experts over its tensor-parallel size (2); use 2 or leave it unset"),
        (f"{OVR}.log_num_zeros_in_grad=True", f"{OVR[1:]}.log_num_zeros_in_grad is not applied by megarl; the entries it honours are adam_beta1, adam_beta2, adam_eps, sgd_momentum, clip_grad"),
    ],
)  # fmt: skip
def test_values_megarl_does_not_have_are_refused_in_one_line(override, expected):
    problems = _problems(override.split(" "))
    assert len(problems) == 1, problems
    assert expected in problems[0] and "\n" not in problems[0], problems


def test_model_engine_is_a_key_not_an_unknown_one_with_a_wrong_hint():
    """verl 0.9's examples pass model_engine=megatron; before it was "unknown key" with a hint
    at an unrelated key."""
    assert load_config(GRPO, ["model_engine=megatron"]).model_engine == "megatron"
    problems = _problems(["model_engine=fsdp"])
    expected = "model_engine=fsdp: megarl is the Megatron engine; use model_engine=megatron"
    assert problems == [f"{expected} (or leave it out)"]


def test_lr_decay_steps_and_override_entries_reach_the_optimizer_settings():
    from megarl.trainer.setup import optimizer_settings

    plain = optimizer_settings(load_config(GRPO), 40)
    assert plain.lr_decay_steps == 40  # unset: the run's total steps, as verl
    cfg = load_config(GRPO, [
        f"{ARR}.actor.optim.lr_decay_steps=10", f"{ARR}.actor.optim.betas=[0.8,0.9]",
        f"{OVR}.adam_beta2=0.95", f"{OVR}.adam_eps=1e-5", f"{OVR}.clip_grad=0.5",
        f"{OVR}.sgd_momentum=0.3", "critic.optim.lr_decay_steps=7",
    ])  # fmt: skip
    actor = optimizer_settings(cfg, 40)
    assert actor.lr_decay_steps == 10
    assert actor.betas == (0.8, 0.95)  # the override wins over optim.betas (verl applies it last)
    assert (actor.eps, actor.clip_grad, actor.sgd_momentum) == (1e-5, 0.5, 0.3)
    assert optimizer_settings(cfg, 40, "critic").lr_decay_steps == 7
    assert optimizer_settings(cfg, 40, "critic").eps == plain.eps  # the actor's override only


def test_nccl_timeout_is_the_process_group_timeout_build_run_uses(monkeypatch, tmp_path):
    """``build_run`` starts the process group with ``actor_rollout_ref.nccl_timeout`` seconds
    (verl's unit), over $MEGARL_DIST_TIMEOUT_MINUTES; unset, the variable still decides."""
    from megarl.trainer import setup

    seen: list[float] = []

    class Stop(Exception):
        pass

    def fake_init(layout, *, seed, timeout_minutes=None, **_):
        seen.append(timeout_minutes)
        raise Stop

    monkeypatch.setattr(setup, "init_distributed", fake_init)
    monkeypatch.setenv("MEGARL_DIST_TIMEOUT_MINUTES", "90")
    for overrides in ([f"{ARR}.nccl_timeout=1800"], []):
        with pytest.raises(Stop):
            setup.build_run(load_config(GRPO, overrides), None, tmp_path)
    assert seen == [30, 90]


def test_a_verl_0_9_script_s_engine_keys_validate_and_a_wrong_engine_is_one_line(capsys):
    """``megarl config validate`` as a verl 0.9 user runs it: the engine keys every Megatron
    example passes validate; ``model_engine=dp`` is the one error, on one line."""
    from megarl import cli

    verl_0_9 = [
        "model_engine=megatron", f"{ARR}.hybrid_engine=True", f"{ARR}.nccl_timeout=600",
        f"{ARR}.actor.use_torch_compile=False", f"{ARR}.actor.megatron.use_mbridge=True",
        f"{ARR}.actor.megatron.vanilla_mbridge=False", f"{ARR}.model.use_fused_kernels=True",
        f"{ARR}.rollout.calculate_log_probs=True", f"{ARR}.actor.megatron.seed=42",
        f"{ARR}.actor.optim.lr_decay_steps=200", f"{OVR}.adam_beta2=0.95",
    ]  # fmt: skip
    assert cli.main(["config", "validate", "-c", str(GRPO), *verl_0_9]) == 0
    capsys.readouterr()
    assert cli.main(["config", "validate", "-c", str(GRPO), *verl_0_9, "model_engine=dp"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "model_engine=dp: megarl is the Megatron engine" in errors[0]


def test_lr_decay_steps_and_overrides_reach_megatrons_scheduler_and_optimizer(tmp_path):
    """On one CPU rank, the actor's TrainableModel built from the config as ``megarl train``
    builds it: linear decay from 1e-3 over lr_decay_steps=4 of 40 trainer steps, then held at
    min_lr (0); the override entries are in Megatron's OptimizerConfig."""
    import json
    from pathlib import Path

    from megarl.models.tiny import make_tiny_model
    from tests.conftest import run_torchrun

    model = make_tiny_model(tmp_path / "qwen2", family="qwen2")
    optim = f"{ARR}.actor.optim"
    run_torchrun(Path(__file__).with_name("_optimizer_worker.py"), 1, [
        str(tmp_path / "out.json"), str(model), str(GRPO), f"{optim}.lr=1e-3",
        f"{optim}.lr_decay_style=linear", f"{optim}.lr_decay_steps=4", f"{optim}.clip_grad=2.0",
        f"{OVR}.adam_eps=1e-5", f"{OVR}.adam_beta1=0.8", f"{OVR}.clip_grad=0.5",
    ])  # fmt: skip
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["lrs"] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0, 0.0], abs=1e-12)
    assert (got["adam_eps"], got["adam_beta1"], got["adam_beta2"]) == (1e-5, 0.8, 0.999)
    assert got["clip_grad"] == 0.5  # the override wins over optim.clip_grad, as in verl


MODEL_OVR = f"+{ARR}.model.override_config"
MEG_OVR = f"+{ARR}.actor.megatron.override_transformer_config"


def test_verls_max_position_embeddings_is_accepted_when_it_covers_the_sequence_budget():
    """verl's one-step-off and fully-async scripts raise ``max_position_embeddings`` (the
    latter under ``model_config``, verl's Megatron spelling) to pass verl's own
    ``max_model_len`` check; megarl's RoPE families have no position table, so a value covering
    prompt + response (128 + 16 here) is megarl's behaviour; below it, one line naming the
    values that work."""
    assert _problems([f"{MODEL_OVR}.max_position_embeddings=144"]) == []
    assert _problems([f"{MODEL_OVR}.model_config.max_position_embeddings=32768",
                      f"{MODEL_OVR}.attention_dropout=0."]) == []  # fmt: skip
    cfg = load_config(GRPO, [f"{MODEL_OVR}.model_config.max_position_embeddings=32768"])
    assert cfg.actor_rollout_ref.model.override_config == {"max_position_embeddings": 32768}
    assert _problems([f"{MODEL_OVR}.model_config.max_position_embeddings=143"]) == [
        (
            f"{ARR}.model.override_config.max_position_embeddings=143 is below the sequence budget "
            "(data.max_prompt_length + data.max_response_length, or rollout.max_model_len) = 144; "
            "use 144 or more, or leave it out"
        )
    ]
    assert _problems([f"{MODEL_OVR}.rope_theta=1e6"]) == [
        (
            f"{ARR}.model.override_config.rope_theta=1e6: the model is built from config.json "
            "as is; only dropouts of 0 and max_position_embeddings >= the sequence budget are accepted"
        )
    ]
    with pytest.raises(ConfigError, match="one setting given two values"):
        load_config(GRPO, [f"{MODEL_OVR}.model_config.max_position_embeddings=4096",
                           f"{MODEL_OVR}.max_position_embeddings=2048"])  # fmt: skip


def test_verls_fusion_overrides_are_megarls_megatron_keys_or_have_no_effect():
    """The fully-async MoE script's ``override_transformer_config`` fusions: the four megarl has
    as ``megatron.*`` keys move there (given both ways with different values: one line); the
    apex-kernel and bias-dropout ones have no effect (TE fuses its attention and norms; no
    dropout in these families) and are dropped; anything else is still refused."""
    fusions = ["apply_rope_fusion", "bias_activation_fusion", "gradient_accumulation_fusion",
               "deallocate_pipeline_outputs"]  # fmt: skip
    none = ["masked_softmax_fusion", "persist_layer_norm", "bias_dropout_fusion"]
    cfg = load_config(
        GRPO,
        [f"{MEG_OVR}.{k}=False" for k in fusions]
        + [f"{MEG_OVR}.{k}=True" for k in none]
        + [f"{MEG_OVR}.moe_router_dtype=fp32"],
    )
    meg = cfg.actor_rollout_ref.actor.megatron
    assert [getattr(meg, k) for k in fusions] == [False] * 4
    assert meg.override_transformer_config == {"moe_router_dtype": "fp32"}
    with pytest.raises(ConfigError) as err:
        load_config(GRPO, [f"{MEG_OVR}.apply_rope_fusion=True",
                           f"{ARR}.actor.megatron.apply_rope_fusion=False"])  # fmt: skip
    assert err.value.problems == [
        (
            f"{ARR}.actor.megatron.override_transformer_config.apply_rope_fusion=true and "
            f"{ARR}.actor.megatron.apply_rope_fusion=false are one setting given two values; "
            "give one of them"
        )
    ]
    problems = _problems([f"{MEG_OVR}.hidden_dropout=0.1"])
    assert len(problems) == 1 and "override_transformer_config" in problems[0], problems


def test_verls_checkpoint_engine_bucket_is_the_syncs_bucket_size():
    """``rollout.checkpoint_engine.update_weights_bucket_megabytes`` (MiB, verl's unit) is the
    resharding plan's bucket bound, as ``build_run`` passes it to ``plan_for_chunks``; verl's
    ``backend=naive`` (its default) validates, as does its section spelled out in full."""
    from megarl.config.model_dims import ModelDims
    from megarl.parallel.layout import ParallelLayout
    from megarl.rollout.reshard import make_reshard_plan

    ce = f"{ARR}.rollout.checkpoint_engine"
    cfg = load_config(GRPO, [f"{ce}.update_weights_bucket_megabytes=1", f"{ce}.backend=naive",
                             f"{ce}.engine_kwargs={{}}", f"{ce}.custom_backend_module=null"])  # fmt: skip
    validate(cfg)
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.bucket_bytes() == 1 << 20
    assert load_config(GRPO).actor_rollout_ref.rollout.checkpoint_engine.bucket_bytes() is None
    from megarl.models.tiny import tiny_hf_config

    dims = ModelDims.from_hf_config(tiny_hf_config("qwen2", hidden_size=512, vocab_size=4096))
    small = make_reshard_plan(dims, ParallelLayout(), 1, bucket_bytes=1 << 20)
    whole = make_reshard_plan(dims, ParallelLayout(), 1)
    assert len(small.buckets) > len(whole.buckets)
    assert small.bucket_bytes == 1 << 20
