"""Everything a run holds, built from the config in the order the devices need it.

On GPU vLLM refuses to start unless ``gpu_memory_utilization`` × total memory is free, so the
rollout engine starts before Megatron allocates the models, and goes to sleep right after (its
pool is not needed until the first generate); each model is moved to its ``setup`` residency
(:mod:`megarl.planner.residency`) right after it is built, so the setup peak holds one model's
full state. On CPU the order is the same (one code path). The reference policy is built only
when a KL term is on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.config import BatchPlan, ConfigError, MegarlConfig, critic_enabled, ref_used
from megarl.config.algo_inputs import policy_loss_settings
from megarl.config.batch_plan import rollout_ranks, teacher_used
from megarl.config.distillation_checks import teacher_model_path
from megarl.config.moe_checks import moe_overrides
from megarl.config.optim_overrides import honoured_overrides
from megarl.config.vision_language_checks import vision_language_model_type
from megarl.data import GlobalBatchSampler, PromptDataset, total_training_steps
from megarl.data.tokenizer import image_options, load_actor_tokenizer, trusts_remote_code
from megarl.models.build import BuiltModel, Recompute, build_model
from megarl.models.gpt import Fusions, MoeSettings
from megarl.models.lora import BaseModelView, LoraError, LoraSettings, attach_adapters, freeze_base
from megarl.models.lora_peft import load_peft_adapter
from megarl.models.trainable import OptimizerSettings, TrainableModel
from megarl.models.vision_language import build_vision_language_model
from megarl.parallel.init import init_distributed, process_group_timeout_minutes
from megarl.reward import RewardManager
from megarl.reward.manager import RewardError, reward_inputs
from megarl.rollout.actor_engine import ActorEngine
from megarl.rollout.base import AheadEngine, RolloutEngine
from megarl.rollout.multi_turn_rollout import prompt_tool_schemas
from megarl.rollout.vllm_engine import adapter_engine_args, read_eos_token_ids
from megarl.trainer.batch import pad_token_id
from megarl.trainer.console import Console
from megarl.trainer.losses import Distillation
from megarl.trainer.passes import image_patch_width
from megarl.trainer.residency import applied, settle, settle_engine
from megarl.trainer.reward_model import RewardModel
from megarl.trainer.state import TrainerState
from megarl.trainer.update import PolicyUpdate, ValueUpdate

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class Run:
    """The objects of one training run (identical structure on every rank)."""

    cfg: MegarlConfig
    run_dir: Path
    console: Console
    rank: int
    world_size: int
    tokenizer: Any
    train_data: PromptDataset
    val_data: PromptDataset | None
    sampler: GlobalBatchSampler
    total_steps: int
    plan: BatchPlan
    actor: TrainableModel
    ref: BuiltModel | BaseModelView | None
    """The reference policy: a frozen model, or the actor with its LoRA adapters off."""
    teacher: BuiltModel | None
    """On-policy distillation's Megatron teacher: a frozen model at its own TP × PP or the
    actor's layout."""
    engine: RolloutEngine
    """What generates: vLLM (here or on ranks of its own) or the actor itself."""
    rewards: RewardManager
    policy: PolicyUpdate
    state: TrainerState = field(default_factory=TrainerState)
    ahead: AheadEngine | None = None
    """``engine`` when it runs on ranks of its own and generates ahead of the trainer; None
    when it shares the training ranks."""
    reshard_plan: Any = None
    """The Megatron → engine weight plan (None when the engine samples from the actor)."""
    critic: TrainableModel | None = None
    """The value model (estimators that need values: gae)."""
    values: ValueUpdate | None = None
    """The critic update's settings."""
    kl_ctrl: Any = None
    """The KL-in-reward coefficient controller (``algorithm.use_kl_in_reward``)."""
    reward_model: RewardModel | None = None
    """The learned reward model (``reward_model.enable``); its scores replace the rule scorers."""
    engine_residency: Any = None
    """What of the rollout engine is awake (:class:`megarl.planner.residency.EngineResidency`;
    None when the actor generates)."""
    current_phase: str | None = None
    """The residency phase the run is in (:func:`megarl.trainer.residency.enter`)."""
    phase_peaks: dict = field(default_factory=dict)
    """CUDA: ``("peak" | "used", phase)`` → the most device memory allocated (PyTorch's peak) or
    in use (the device's) in each phase so far, in bytes."""
    sleep_freed: int | None = None
    """CUDA: device bytes vLLM's last sleep freed."""
    last_sleep_level: int | None = None
    """The level vLLM last slept at (None: it never slept)."""
    teacher_client: Any = None
    """On-policy distillation's vLLM teacher on ranks of its own
    (:class:`megarl.rollout.remote.teacher.TeacherClient`), else None."""
    residency_log: list = field(default_factory=list)
    """``(phase, Residency)`` applied at each :func:`megarl.trainer.residency.enter`, as the
    models and the engine report it (the setup entry first)."""
    vision: Any = None
    """A vision-language actor's :class:`~megarl.models.vision_language.VisionLanguageModel`
    (its ``language`` is ``actor.model``; the weight sync sends its tower too); None: text."""
    image_width: int | None = None
    """A vision-language actor's patch width (the prompts' images go to the engine and every
    pass); None: text."""

    @property
    def vocab_size(self) -> int:
        return self.actor.model.dims.vocab_size


def build_run(cfg: MegarlConfig, console: Console, run_dir: Path) -> Run:
    """Initialise the process group and Megatron, then data, engine, models and rewards."""
    arr = cfg.actor_rollout_ref
    layout = arr.actor.megatron.parallel_layout()
    timeout = process_group_timeout_minutes(arr.nccl_timeout)
    # A colocated vLLM's TP size: the weight sync's pipeline pairs are connected at set-up too.
    colocated = arr.rollout.name != "actor" and rollout_ranks(cfg) == 0
    rollout_tp = arr.rollout.tensor_model_parallel_size if colocated else None
    launch = init_distributed(
        layout, seed=cfg.trainer.seed, timeout_minutes=timeout, rollout_tp=rollout_tp
    )
    world = launch.world_size
    plan = BatchPlan.from_config(cfg, world)
    model_path = str(Path(arr.model.path).expanduser())
    tokenizer = load_actor_tokenizer(cfg)
    data_seed = cfg.data.seed if cfg.data.seed is not None else cfg.trainer.seed
    tools = prompt_tool_schemas(cfg)  # data.tool_config_path: the filter counts with them
    vision_language = vision_language_model_type(model_path) is not None
    images = image_options(cfg)  # a VL checkpoint's image processor: pixels and widened ids
    train_data = PromptDataset.from_config(cfg.data, tokenizer, "train", cfg.trainer.seed, tools,
                                           **images)  # fmt: skip
    val_data = (
        PromptDataset.from_config(cfg.data, tokenizer, "val", cfg.trainer.seed, tools, **images)
        if cfg.data.val_files and (cfg.trainer.test_freq > 0 or cfg.trainer.val_before_train)
        else None
    )
    # DAPO's dynamic sampling draws generation batches of data.gen_batch_size prompts, and an
    # epoch counts them (verl's dataloader batch is gen_batch_size): so do the step count and
    # the LR schedule built from it.
    dynamic = cfg.algorithm.filter_groups.enable and cfg.data.gen_batch_size
    prompts_per_draw = cfg.data.gen_batch_size if dynamic else cfg.data.train_batch_size
    sampler = GlobalBatchSampler(
        len(train_data), prompts_per_draw, seed=data_seed, shuffle=cfg.data.shuffle
    )
    total = total_training_steps(
        sampler.batches_per_epoch, cfg.trainer.total_epochs, cfg.trainer.total_training_steps
    )

    dtype = DTYPES[cfg.trainer.dtype]
    engine_from_vllm = arr.rollout.name == "vllm"
    engine_args = adapter_engine_args(arr.model.lora)  # lora.merge=false: vLLM's LoRA layers
    if vision_language and cfg.data.mm_processor_kwargs:  # vLLM's processor widens as the data's
        engine_args["engine_kwargs"] = {**arr.rollout.engine_kwargs,
                                        "mm_processor_kwargs": dict(cfg.data.mm_processor_kwargs)}  # fmt: skip
    vllm_engine = _start_vllm(cfg, model_path, **engine_args) if engine_from_vllm else None
    engine_residency = settle_engine(vllm_engine, cfg) if vllm_engine is not None else None
    meg = arr.actor.megatron
    recompute = Recompute.of(meg)
    moe = MoeSettings.from_dict(moe_overrides(meg))  # verl's moe_* knobs, verl's defaults
    replay = {"moe_enable_routing_replay": True} if meg.router_replay.mode != "disabled" else {}
    vision = None
    if vision_language:  # the pre-flight refused what a VL actor cannot do (vision_language_checks)
        vision = build_vision_language_model(model_path, layout, dtype=dtype,
                                             freeze_vision_tower=arr.actor.freeze_vision_tower)  # fmt: skip
        actor_model = vision.language
    else:
        actor_model = build_role_model(
            initial_checkpoint(meg),
            model_path,
            layout,
            dtype=dtype,
            transformer_impl=meg.transformer_impl,
            recompute=recompute,
            fusions=fusions(meg),
            moe=MoeSettings.from_dict({**moe_overrides(meg), **replay}),
        )
    actor_model.pack = packs(arr.model, meg)
    lora = arr.model.lora.rank > 0
    if lora:  # adapters before DDP and the optimizer: only they get buffers and state
        settings = LoraSettings.from_config(arr.model.lora, seed=cfg.trainer.seed)
        attach_adapters(actor_model.chunks, settings)
        if arr.model.lora.adapter_path:  # verl's: start from a saved (PEFT) adapter
            load_peft_adapter(
                actor_model.chunks, actor_model.dims, settings, arr.model.lora.adapter_path
            )
        freeze_base(actor_model.chunks)
        actor_model.meta["lora"] = settings
    actor = TrainableModel(actor_model, optimizer_settings(cfg, total))
    settle(actor, cfg, "actor")
    ref = None
    if ref_used(cfg) and lora:  # verl's ref_in_actor: the base model is the actor, adapters off
        ref = BaseModelView(actor)
    elif ref_used(cfg) and vision_language:  # the same VL model, frozen (the tower too)
        ref = build_vision_language_model(model_path, layout, dtype=dtype,
                                          freeze_vision_tower=True).language  # fmt: skip
        frozen(ref, cfg, "ref")
    elif ref_used(cfg):  # the reference routes afresh, R3 or not (as verl)
        ref = build_role_model(initial_checkpoint(arr.ref.megatron), model_path, layout,
                               dtype=dtype, transformer_impl=meg.transformer_impl,
                               fusions=fusions(meg), moe=moe)  # fmt: skip
        frozen(ref, cfg, "ref")
    teacher = None
    if teacher_used(cfg):  # a frozen model of its own weights (and shape), at its own layout
        teacher = _megatron_teacher(cfg, layout, timeout, dtype=dtype,
                                    transformer_impl=meg.transformer_impl, fusions=fusions(meg),
                                    moe=moe)  # fmt: skip
    eos = read_eos_token_ids(model_path) or [tokenizer.eos_token_id]
    if vllm_engine is not None:
        engine: RolloutEngine = vllm_engine
        from megarl.rollout.reshard import plan_for_chunks

        bucket = arr.rollout.checkpoint_engine.bucket_bytes()  # verl's bucket megabytes
        sizes = {} if bucket is None else {"bucket_bytes": bucket}
        if vision is not None:  # the language model's plan; the tower goes whole, by name
            from megarl.rollout.reshard.vision_sync import plan_for_vision_language

            reshard = plan_for_vision_language(vision, vllm_engine.tensor_parallel_size, **sizes)
        else:
            reshard = plan_for_chunks(
                actor.chunks,
                actor_model.dims,
                vllm_engine.tensor_parallel_size,
                rollout_ep=vllm_engine.expert_parallel,
                **sizes,
            )
        if isinstance(vllm_engine, AheadEngine):  # it receives the plan with its syncs
            vllm_engine.bind_plan(reshard)
    else:
        engine = ActorEngine(
            actor.chunks,
            vocab_size=actor_model.dims.vocab_size,
            eos_token_ids=eos,
            pad_token_id=pad_token_id(tokenizer),
        )
        reshard = None
    if arr.rollout.multi_turn.enable:  # each response a trajectory of model and tool turns
        from megarl.rollout.multi_turn_rollout import MultiTurnRollout

        engine.multi_turn = MultiTurnRollout.from_config(cfg, tokenizer, engine.eos_token_ids)
    critic, values = _build_critic(cfg, layout, model_path, dtype, total, plan)
    kl_ctrl = _kl_controller(cfg)
    reward_model = RewardModel.from_config(cfg, layout, dtype, tokenizer)
    rewards = RewardManager.from_config(cfg, tokenizer, group=None)
    run = Run(
        cfg=cfg,
        run_dir=run_dir,
        console=console,
        rank=launch.rank,
        world_size=world,
        tokenizer=tokenizer,
        train_data=train_data,
        val_data=val_data,
        sampler=sampler,
        total_steps=total,
        plan=plan,
        actor=actor,
        ref=ref,
        teacher=teacher,
        teacher_client=_teacher_client(cfg),
        engine=engine,
        ahead=engine if isinstance(engine, AheadEngine) else None,
        rewards=rewards,
        policy=policy_update(cfg, plan),
        reshard_plan=reshard,
        critic=critic,
        values=values,
        kl_ctrl=kl_ctrl,
        reward_model=reward_model,
        engine_residency=engine_residency,
        vision=vision,
        image_width=image_patch_width(model_path) if vision_language else None,
    )
    run.residency_log.append(("setup", applied(run)))
    run.current_phase = "setup"
    return run


def _build_critic(cfg: MegarlConfig, layout, model_path: str, dtype, total: int, plan):
    """The critic's trainable model and update settings, or (None, None) without a critic."""
    if not critic_enabled(cfg):
        return None, None
    critic_cfg = cfg.critic
    critic_layout = critic_cfg.megatron.parallel_layout()
    if critic_layout != layout:
        raise ConfigError(
            f"critic.megatron layout {critic_layout} differs from the actor's {layout}: "
            "Megatron-Core keeps one parallel state per process"
        )
    critic_model = build_role_model(
        initial_checkpoint(critic_cfg.megatron),
        str(Path(critic_cfg.model.path or model_path).expanduser()),
        layout,
        role="critic",
        dtype=dtype,
        transformer_impl=cfg.actor_rollout_ref.actor.megatron.transformer_impl,
        value_head_seed=cfg.trainer.seed,
        fusions=fusions(critic_cfg.megatron),
        moe=MoeSettings.from_dict(moe_overrides(critic_cfg.megatron)),
        recompute=Recompute.of(critic_cfg.megatron),
    )
    critic_model.pack = packs(critic_cfg.model, critic_cfg.megatron)
    critic = TrainableModel(critic_model, optimizer_settings(cfg, total, role="critic"))
    settle(critic, cfg, "critic")
    return critic, value_update(cfg, plan)


def packs(model_section, megatron_section) -> bool:
    """Whether a model's passes run on packed rows: its ``megatron.use_remove_padding`` (verl's
    engine key) when set, else its model section's ``use_remove_padding`` (the reference: the
    actor's)."""
    engine = megatron_section.use_remove_padding
    return bool(model_section.use_remove_padding if engine is None else engine)


def _megatron_teacher(cfg: MegarlConfig, layout, timeout: float, **kwargs) -> BuiltModel:
    """On-policy distillation's Megatron teacher, frozen: at the actor's layout, or at its own
    TP × PP (``inference.*``), whose parallel state is built beside the actor's and entered for
    the teacher's building and passes (``meta["layout_state"]``, :mod:`megarl.trainer.teacher`)."""
    from megarl.config.teachers import megatron_teacher_layout
    from megarl.parallel.init import second_layout

    own = megatron_teacher_layout(cfg)
    if own is None:
        teacher = build_role_model(None, teacher_model_path(cfg), layout, **kwargs)
        frozen(teacher, cfg, "teacher")
        return teacher
    state = second_layout(own, timeout)
    with state.entered():
        teacher = build_role_model(None, teacher_model_path(cfg), own, **kwargs)
        frozen(teacher, cfg, "teacher")
    teacher.meta["layout_state"] = state
    return teacher


def frozen(model: BuiltModel, cfg: MegarlConfig, role: str) -> None:
    """A forward-only model (the reference, the teacher): packed as the reference's passes are,
    in eval mode, without gradients, at its ``setup`` residency."""
    model.pack = packs(cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.ref.megatron)
    for chunk in model.chunks:
        chunk.eval()
        chunk.requires_grad_(False)
    settle(model, cfg, role)


def build_role_model(ckpt: Path | None, source, layout, **kwargs) -> BuiltModel:
    """:func:`build_model`, its weights from the Megatron distributed checkpoint ``ckpt`` (saved
    at any layout) instead of ``source``'s safetensors when given; the config still comes from
    ``source``, and another model is refused in one line naming the path. A critic's value head
    is not taken from it (an actor's checkpoint has none): it starts as it would without one."""
    if ckpt is None:
        return build_model(source, layout, **kwargs)
    from megarl.checkpoint.dist_ckpt import CheckpointMismatchError, load_model_checkpoint
    from megarl.config.dist_ckpt_checks import checkpoint_mismatch
    from megarl.config.model_dims import read_hf_config

    mismatch = checkpoint_mismatch(ckpt, read_hf_config(source))
    if mismatch:
        raise CheckpointMismatchError(f"{ckpt} {mismatch}")
    built = build_model(source, layout, hf_weights=False, **kwargs)
    actor = kwargs.get("role", "actor") == "actor"
    load_model_checkpoint(built.chunks, ckpt, skip=() if actor else ("output_layer",))
    return built


def initial_checkpoint(megatron) -> Path | None:
    """The Megatron distributed checkpoint a model's initial weights come from
    (``use_dist_checkpointing``; :mod:`megarl.config.dist_ckpt_checks`), or None: from HF."""
    if not megatron.use_dist_checkpointing:
        return None
    return Path(megatron.dist_checkpointing_path).expanduser()


def _kl_controller(cfg: MegarlConfig):
    """The KL-in-reward coefficient controller (``algorithm.kl_ctrl``), or None."""
    if not cfg.algorithm.use_kl_in_reward:
        return None
    from megarl.algo import get_kl_controller

    ctrl = cfg.algorithm.kl_ctrl
    return get_kl_controller(
        ctrl.type, kl_coef=ctrl.kl_coef, target_kl=ctrl.target_kl, horizon=ctrl.horizon
    )


def optimizer_settings(
    cfg: MegarlConfig, total_steps: int, role: str = "actor"
) -> OptimizerSettings:
    """The optimizer and LR schedule from ``actor_rollout_ref.actor.optim`` (or ``critic.optim``).

    Warm-up counts trainer steps (verl): ``lr_warmup_steps`` when ≥ 0, else
    ``lr_warmup_steps_ratio`` × total steps. The decay runs over ``lr_decay_steps`` (unset: the
    total steps). ``override_optimizer_config``'s honoured entries win over ``optim.*``.
    """
    optim = cfg.critic.optim if role == "critic" else cfg.actor_rollout_ref.actor.optim
    meg = cfg.critic.megatron if role == "critic" else cfg.actor_rollout_ref.actor.megatron
    warmup = optim.lr_warmup_steps
    if warmup < 0:
        warmup = math.floor(optim.lr_warmup_steps_ratio * total_steps)
    betas = (optim.betas[0], optim.betas[1])
    chosen = {"betas": betas, "clip_grad": optim.clip_grad}
    chosen |= honoured_overrides(optim.override_optimizer_config, betas)  # verl applies them last
    return OptimizerSettings(
        lr=optim.lr,
        optimizer=optim.optimizer,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        lr_warmup_steps=warmup,
        lr_warmup_init=optim.lr_warmup_init,
        lr_decay_steps=optim.lr_decay_steps or total_steps,
        lr_decay_style=optim.lr_decay_style,
        use_distributed_optimizer=meg.use_distributed_optimizer,
        overlap_grad_reduce=meg.override_ddp_config.overlap_grad_reduce,
        overlap_param_gather=meg.override_ddp_config.overlap_param_gather,
        ddp_bucket_size=meg.override_ddp_config.bucket_size,
        **chosen,
    )


def fusions(meg) -> Fusions:
    """A ``megatron`` section's fusion switches (each on where the layer spec allows it)."""
    return Fusions(
        bias_activation_fusion=meg.bias_activation_fusion,
        apply_rope_fusion=meg.apply_rope_fusion,
        gradient_accumulation_fusion=meg.gradient_accumulation_fusion,
        deallocate_pipeline_outputs=meg.deallocate_pipeline_outputs,
        attention_backend=str(
            meg.override_transformer_config.get("attention_backend", "auto")
        ).removeprefix("AttnBackend."),
    )


_DR_GRPO = "seq-mean-token-sum-norm"


def policy_update(cfg: MegarlConfig, plan: BatchPlan) -> PolicyUpdate:
    """The actor update's settings from ``actor_rollout_ref.actor`` and the batch plan."""
    actor = cfg.actor_rollout_ref.actor
    loss = actor.policy_loss
    return PolicyUpdate(
        responses_per_mini_batch=plan.actor.responses_per_batch,
        micro_batch_size=plan.actor.micro_batch_size,
        max_token_len=plan.actor.max_token_len_per_gpu,
        ppo_epochs=actor.ppo_epochs,
        shuffle=actor.shuffle,
        loss_mode=loss.loss_mode,
        loss_agg_mode=actor.loss_agg_mode,
        # verl pads responses to the rollout's response length, so its seq-mean-token-sum-norm
        # divisor (the padded width) is that constant; megarl's batches are padded only to the
        # longest response present, so the constant is passed explicitly (Dr.GRPO's normaliser
        # must not change with the DP layout, the mini-batch or the step).
        loss_scale_factor=(
            actor.loss_scale_factor
            if actor.loss_scale_factor is not None or actor.loss_agg_mode != _DR_GRPO
            else float(
                cfg.actor_rollout_ref.rollout.response_length or cfg.data.max_response_length
            )
        ),
        entropy_coeff=actor.entropy_coeff,
        use_kl_loss=actor.use_kl_loss,
        kl_loss_coef=actor.kl_loss_coef,
        kl_loss_type=actor.kl_loss_type,
        temperature=cfg.actor_rollout_ref.rollout.temperature,
        balance=cfg.trainer.balance_batch,
        policy_loss_kwargs=policy_loss_settings(cfg),
        distillation=(
            Distillation.from_config(cfg.distillation.distillation_loss)
            if cfg.distillation.enabled
            else None
        ),
    )


def value_update(cfg: MegarlConfig, plan: BatchPlan) -> ValueUpdate:
    """The critic update's settings from ``critic.*`` and the batch plan."""
    critic = cfg.critic
    passes = plan.critic
    return ValueUpdate(
        responses_per_mini_batch=passes.responses_per_batch,  # type: ignore[union-attr]
        micro_batch_size=passes.micro_batch_size,  # type: ignore[union-attr]
        max_token_len=passes.max_token_len_per_gpu,  # type: ignore[union-attr]
        ppo_epochs=critic.ppo_epochs,
        shuffle=cfg.actor_rollout_ref.actor.shuffle,
        balance=cfg.trainer.balance_batch,
        cliprange_value=critic.cliprange_value,
        loss_agg_mode=critic.loss_agg_mode,
    )


def _start_vllm(cfg: MegarlConfig, model_path: str, **overrides: Any):
    """The run's vLLM engine: in this process, or on the rollout ranks of a split launch
    (:class:`~megarl.rollout.remote.engine.RemoteEngine`, their side :func:`serve_rollout`)."""
    from megarl.rollout.remote.split_world import current

    world = current()
    if world is not None and world.role == "train" and world.rollout_ranks:
        from megarl.config.batch_plan import stages_weight_updates
        from megarl.rollout.remote.engine import RemoteEngine

        streams = stages_weight_updates(cfg)
        tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
        lora = overrides.get("lora_rank", 0) > 0  # lora.merge=false: the rollout ranks' vLLM too
        if lora and streams:
            raise LoraError(
                "actor_rollout_ref.model.lora.merge=false with vLLM on ranks of its own needs "
                "async_training.staleness_threshold <= 1 (staged updates carry no adapters)"
            )
        from megarl.config.async_schedule import partial_rollouts

        return RemoteEngine(world.channels(nccl_weights=not streams), ranks=world.rollout_ranks,
                            timeout=world.timeout, streams=streams, rollout_tp=tp,
                            lora=lora, partial=partial_rollouts(cfg))  # fmt: skip
    from megarl.rollout.vllm_engine import VLLMEngine

    return VLLMEngine.from_config(
        cfg.actor_rollout_ref.rollout,
        model_path,
        dtype=cfg.trainer.dtype,
        seed=cfg.trainer.seed,
        tokenizer_path=cfg.actor_rollout_ref.model.tokenizer_path,  # the EOS fallback's
        trust_remote_code=trusts_remote_code(cfg),
        capture_routing=cfg.actor_rollout_ref.actor.megatron.router_replay.mode == "R3",
        **overrides,
    )


def _teacher_client(cfg: MegarlConfig):
    """The training ranks' handle on the vLLM teacher's ranks (None without them)."""
    from megarl.config.batch_plan import teacher_ranks

    if not teacher_ranks(cfg):
        return None
    from megarl.config.teachers import teachers
    from megarl.rollout.remote.split_world import current
    from megarl.rollout.remote.teacher import TeacherClient

    return TeacherClient(current(), [t.name for t in teachers(cfg)])


def serve_teacher(cfg: MegarlConfig) -> None:
    """A teacher rank of a split launch: start its teacher's vLLM (the teacher whose block of
    the teacher ranks it is in) and score the training ranks' batches until they stop it
    (:mod:`megarl.rollout.remote.teacher`)."""
    from megarl.config.teachers import teachers
    from megarl.rollout.remote.split_world import current
    from megarl.rollout.remote.teacher import serve_teacher as serve
    from megarl.rollout.remote.teacher import start_teacher_engine

    world = current()
    if world is None or world.role != "teacher":
        raise RuntimeError("serve_teacher runs on the teacher ranks of a split launch")
    engine = start_teacher_engine(cfg, teachers(cfg)[world.teacher_index or 0])
    try:
        serve(world, engine)
    finally:
        engine.shutdown()


def serve_rollout(cfg: MegarlConfig) -> None:
    """A rollout rank of a split launch: start vLLM (never asleep: these devices train nothing)
    and run the training ranks' commands until they stop it."""
    from megarl.config.batch_plan import stages_weight_updates
    from megarl.rollout.remote.serve import serve
    from megarl.rollout.remote.split_world import current

    world = current()
    if world is None or world.role != "rollout":
        raise RuntimeError("serve_rollout runs on the rollout ranks of a split launch")
    arr = cfg.actor_rollout_ref
    model_path = str(Path(arr.model.path).expanduser())
    # lora.merge=false: vLLM's LoRA layers, as colocated (the adapters arrive alone)
    adapter_args = adapter_engine_args(arr.model.lora)
    engine = _start_vllm(cfg, model_path, free_cache_engine=False, **adapter_args)
    tokenizer = load_actor_tokenizer(cfg)
    rewards = RewardManager.from_config(cfg, tokenizer)  # spread over the rollout ranks
    multi_turn = None
    if arr.rollout.multi_turn.enable:  # the whole loop, tools included, runs on these ranks
        from megarl.rollout.multi_turn_rollout import MultiTurnRollout

        multi_turn = MultiTurnRollout.from_config(cfg, tokenizer, engine.eos_token_ids)

    def score(batch, reward: dict):
        """Score a prefetched batch as the trainer would (its rollout dump included); a scorer's
        failure is returned as the reward manager's one-line message, which the trainer raises
        as the colocated run would."""
        prompts = [_PromptInfo(*info) for info in reward["prompts"]]
        width = max([len(s.response_token_ids) for s in batch] + [1])  # the batch's tensors'
        try:
            return rewards(reward_inputs(tokenizer, prompts, batch.samples), response_width=width,
                           dump_dir=reward["dump_dir"], step=reward["step"])  # fmt: skip
        except RewardError as exc:
            return str(exc)

    try:
        # staged while generating only when more than one step is asked ahead (the module
        # docstring of megarl.rollout.remote.serve: one step off loses nothing without it);
        # otherwise the bytes go GPU to GPU over NCCL where each rank has a GPU of its own
        stage = stages_weight_updates(cfg)
        tp = arr.rollout.tensor_model_parallel_size  # staged: each rank its vLLM TP rank's pieces
        from megarl.config.async_schedule import partial_rollouts

        serve(engine, world.channels(nccl_weights=not stage), score, stage=stage,
              part=(tp, engine.tp_rank), multi_turn=multi_turn,
              partial=partial_rollouts(cfg))  # fmt: skip
    finally:
        rewards.close()
        engine.shutdown()


@dataclass(frozen=True)
class _PromptInfo:
    """What scoring needs of a prompt (the rollout ranks have no dataset)."""

    data_source: str
    ground_truth: Any
    extra_info: Any


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
