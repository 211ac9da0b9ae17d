"""A trainable model on Megatron's own pieces: DDP, ``get_megatron_optimizer``, the LR scheduler.

:class:`TrainableModel` wraps the chunks of a :class:`megarl.models.build.BuiltModel` (weights
already loaded) in Megatron's ``DistributedDataParallel`` with the Megatron optimizer and an
``OptimizerParamScheduler``. Megatron's fp32 path (and bf16 without a grad scaler) never checks
gradients for NaN/Inf, so :meth:`TrainableModel.step` computes the global gradient norm itself
and either clips and steps on every rank or skips on every rank. The LR schedule advances once
per trainer step (:meth:`TrainableModel.advance_lr`, as verl), not once per optimizer step.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megarl.models.build import BuiltModel
from megarl.models.gpt import unwrap


@dataclass(frozen=True)
class OptimizerSettings:
    """What the optimizer and its schedule need (verl's ``*.optim`` keys, in Megatron's terms)."""

    lr: float
    """Peak learning rate."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """adam is AdamW (decoupled weight decay); sgd has no momentum unless ``sgd_momentum``."""
    min_lr: float = 0.0
    """Final learning rate of a decaying schedule."""
    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to biases and 1-D parameters, as Megatron groups)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam beta1, beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    sgd_momentum: float = 0.0
    """SGD momentum."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 turns clipping off (the norm is still computed)."""
    lr_warmup_steps: int = 0
    """Linear warm-up, in scheduler steps (trainer steps)."""
    lr_warmup_init: float = 0.0
    """Learning rate the warm-up starts from (optim.lr_warmup_init)."""
    lr_decay_steps: int = 1
    """Scheduler steps over which the LR decays to min_lr (optim.lr_decay_steps, else the run's
    total trainer steps); held at min_lr after."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after warm-up."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state (and gradient reduction) over data-parallel ranks."""
    grad_reduce_in_fp32: bool = True
    """Reduce and accumulate gradients in fp32 even for bf16 parameters."""
    overlap_grad_reduce: bool = True
    """Launch each gradient bucket's reduce-scatter (all-reduce without the distributed
    optimizer) asynchronously from the backward pass of the last micro-batch, as soon as the
    bucket is complete; the step waits for them (Megatron's ``finish_grad_sync``)."""
    overlap_param_gather: bool = True
    """With the distributed optimizer: defer the parameter all-gather after a step to the next
    forward pass, bucket by bucket. Weights read outside a forward are made current first
    (:meth:`TrainableModel.finish_param_sync`). No effect without the distributed optimizer."""
    ddp_bucket_size: int | None = None
    """Parameters per gradient bucket with ``overlap_grad_reduce`` (None: Megatron's default,
    max(40M, 1M x DP))."""


@dataclass(frozen=True)
class StepResult:
    """Outcome of one optimizer step, identical on every rank."""

    updated: bool
    """False when the gradient was not finite on some rank and the step was skipped."""
    grad_norm: float
    """Global gradient norm before clipping (nan/inf when skipped for that reason)."""


class TrainableModel:
    """Megatron DDP chunks + Megatron optimizer + LR scheduler for one model (actor or critic).

    Every method is collective over the world (SPMD): call it on every rank.
    """

    @property
    def pack(self) -> bool:
        """Run the passes on packed rows (:attr:`BuiltModel.pack`)."""
        return self.model.pack

    def __init__(self, model: BuiltModel, settings: OptimizerSettings) -> None:
        self.model = model
        self.settings = settings
        config = model.config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=settings.grad_reduce_in_fp32,
            overlap_grad_reduce=settings.overlap_grad_reduce,
            overlap_param_gather=(
                settings.overlap_param_gather and settings.use_distributed_optimizer
            ),
            use_distributed_optimizer=settings.use_distributed_optimizer,
            bucket_size=settings.ddp_bucket_size,
            check_for_nan_in_grad=False,  # step() checks the reduced norm on every rank
        )
        self.ddp_config = ddp_config
        self._param_gather_pending = False
        self.chunks: list[DistributedDataParallel] = [
            DistributedDataParallel(
                config=config,
                ddp_config=ddp_config,
                module=chunk,
                # Megatron buckets only the first chunk's parameters (as in its training loop).
                disable_bucketing=i > 0,
            )
            for i, chunk in enumerate(model.chunks)
        ]
        for chunk in self.chunks:
            chunk.broadcast_params()  # DP replicas start bit-identical
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer=settings.optimizer,
                lr=settings.lr,
                min_lr=settings.min_lr,
                weight_decay=settings.weight_decay,
                adam_beta1=settings.betas[0],
                adam_beta2=settings.betas[1],
                adam_eps=settings.eps,
                sgd_momentum=settings.sgd_momentum,
                clip_grad=settings.clip_grad,
                bf16=config.bf16,
                fp16=config.fp16,
                params_dtype=config.params_dtype,
                use_distributed_optimizer=settings.use_distributed_optimizer,
            ),
            self.chunks,
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=settings.lr_warmup_init if settings.lr_warmup_steps > 0 else settings.lr,
            max_lr=settings.lr,
            min_lr=settings.min_lr,
            lr_warmup_steps=settings.lr_warmup_steps,
            lr_decay_steps=max(settings.lr_decay_steps, settings.lr_warmup_steps + 1),
            lr_decay_style=settings.lr_decay_style,
            start_wd=settings.weight_decay,
            end_wd=settings.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
            # megarl's checkpoint code decides which settings win on resume (and warns).
            use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=True,
        )
        self.zero_grad()

    # -- training ---------------------------------------------------------------------------

    def zero_grad(self) -> None:
        """Clear the DDP gradient buffers and the optimizer's main gradients."""
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    @torch.no_grad()
    def step(self) -> StepResult:
        """Clip and apply the accumulated (already reduced) gradients, or skip a non-finite one.

        Gradients are zeroed afterwards in both cases.
        """
        found_inf = bool(self.optimizer.prepare_grads())
        norm = float(self.optimizer.get_grad_norm())
        bad = torch.tensor([1.0 if found_inf or not math.isfinite(norm) else 0.0])
        if dist.is_initialized():
            bad = bad.to(_flag_device())
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item() > 0:
            self.zero_grad()
            return StepResult(
                updated=False, grad_norm=norm if not math.isfinite(norm) else math.nan
            )
        if self.settings.clip_grad > 0:
            # Megatron's clip_grad_by_total_norm_fp32, with its formula, for any gradient dtype.
            coeff = self.settings.clip_grad / (norm + 1.0e-6)
            if coeff < 1.0:
                grads = [
                    p.grad
                    for opt in _leaf_optimizers(self.optimizer)
                    for p in opt.get_parameters()
                    if p.grad is not None
                ]
                torch._foreach_mul_(grads, coeff)
        self.optimizer.step_with_ready_grads()
        # With overlap_param_gather each rank has updated only the shard it owns; the others'
        # arrive at the next forward's pre-hooks, or at finish_param_sync.
        self._param_gather_pending = self.ddp_config.overlap_param_gather
        self.zero_grad()
        return StepResult(updated=True, grad_norm=norm)

    def finish_param_sync(self) -> None:
        """Make every parameter current on every rank (collective over DP).

        With ``overlap_param_gather`` the distributed optimizer's all-gather after a step is
        deferred to the next forward pass (Megatron's forward pre-hooks); anything that reads
        or moves weights outside a forward (the weight sync to the rollout engine, checkpoints,
        offloading) must call this first. :meth:`place`, the checkpoint state dicts and
        :meth:`reload_model_params` do; a no-op when nothing is pending.
        """
        if not self._param_gather_pending:
            return
        for chunk in self.chunks:
            # Waits for an all-gather in flight, else gathers now (Megatron's own path before
            # it evaluates or saves with overlap_param_gather: disable_forward_pre_hook).
            chunk.start_param_sync(force_sync=True)
        self._param_gather_pending = False

    def advance_lr(self, increment: int = 1) -> None:
        """Advance the LR schedule (once per trainer step, as verl does)."""
        self.scheduler.step(increment=increment)

    @property
    def lr(self) -> float:
        """Current learning rate of the first parameter group."""
        return float(self.optimizer.param_groups[0]["lr"])

    # -- memory between phases (RL: the rollout engine needs the device in between) --------

    @property
    def residency(self) -> tuple[bool, bool, bool]:
        """(parameters, gradient buffers, optimizer state) on the device: what :meth:`place`
        last applied (all True after construction)."""
        return getattr(self, "_on_device", (True, True, True))

    def place(self, *, params: bool, grads: bool, optimizer: bool) -> None:
        """Put parameters, gradient buffers and optimizer state (main parameters, moments) on
        the device (True) or in host memory (False), by Megatron's own RL helpers; only what
        changes moves, and everything leaving moves before anything arrives (a lower peak).

        Parameters leave as a host copy and their device storage is freed (also under CPU
        emulation, so a pass that runs while they are away fails loudly on CPU too); gradient
        buffers are dropped and come back zeroed (call between updates, when they are zero);
        the optimizer state moves to host memory and back.
        """
        self.finish_param_sync()  # moved or read next: the weights must be current
        p, g, o = self.residency
        out_p, out_g = p and not params, g and not grads
        if out_p or out_g:
            for buffer in self._buffers():
                buffer.offload_to_cpu(move_params=out_p, move_grads=out_g)
        if o and not optimizer:
            for leaf in _leaf_optimizers(self.optimizer):
                leaf.offload_to_cpu()
        if (out_p or out_g or (o and not optimizer)) and torch.cuda.is_available():
            torch.cuda.empty_cache()
        in_p, in_g = params and not p, grads and not g
        if in_p or in_g:
            for buffer in self._buffers():
                buffer.reload_from_cpu(move_params=in_p, move_grads=in_g)
        if optimizer and not o:
            for leaf in _leaf_optimizers(self.optimizer):
                leaf.restore_from_cpu()
        self._on_device = (params, grads, optimizer)

    def _buffers(self) -> list:
        return [b for chunk in self.chunks for b in chunk.buffers + chunk.expert_parallel_buffers]

    def reload_model_params(self) -> None:
        """Refresh the optimizer's main (fp32) parameters after weights were loaded in place."""
        self.finish_param_sync()
        self.optimizer.reload_model_params()

    # -- checkpoints ------------------------------------------------------------------------

    def model_sharded_state_dict(self) -> dict:
        """Megatron sharded state dict of the model chunks (``model0``, ``model1``, ...), of
        current weights (a deferred parameter all-gather is finished first)."""
        self.finish_param_sync()
        return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(self.chunks)}

    def sharded_state_dict(self, *, is_loading: bool = False) -> dict:
        """Model and optimizer (``fully_reshardable``: survives any layout change).

        With ``is_loading`` the optimizer state is first created empty where it does not exist
        yet (Megatron's distributed optimizer cannot describe a state it has not created; torch's
        Adam creates it at the first step), so a fresh model can load a checkpoint.

        Host memory of a save: each rank all-gathers its DP group's fp32 main parameters and
        Adam moments (~12 bytes per parameter of its TP×PP shard) before the writes are spread
        over the DP ranks. Megatron's ``distrib_optim_fully_reshardable_mem_efficient`` variant
        gathers over gloo onto DP rank 0 only, which leaves the per-rank peak (what fails a node)
        unchanged and slows saves, so it is not used.
        """
        if is_loading:
            _create_empty_optimizer_state(self.optimizer)
        model = self.model_sharded_state_dict()
        optimizer = self.optimizer.sharded_state_dict(
            model,
            is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": "fully_reshardable"},
        )
        return {"model": model, "optimizer": optimizer}

    def load_sharded_state_dict(self, state: dict) -> None:
        """Load what :meth:`sharded_state_dict` saved (after ``dist_checkpointing.load``)."""
        self.finish_param_sync()  # no deferred all-gather may land on the loaded weights
        for i, chunk in enumerate(self.chunks):
            unwrap(chunk).load_state_dict(state["model"][f"model{i}"], strict=False)
        with _per_param_step_set_aside(self.optimizer):
            self.optimizer.load_state_dict(state["optimizer"])


def _create_empty_optimizer_state(optimizer) -> None:
    """Zero Adam moments and step 0 for every parameter without optimizer state yet."""
    for leaf in _leaf_optimizers(optimizer):
        inner = getattr(leaf, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue  # SGD without momentum has no state; fused optimizers build their own
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    # A placeholder the load replaces. Not 0: Megatron's FP32 optimizer leaves a
                    # falsy step out of its sharded state dict (``if step:``), and the template
                    # would then not ask the checkpoint for the saved step.
                    inner.state[param]["step"] = torch.tensor(1.0)
                    inner.state[param]["exp_avg"] = torch.zeros_like(param.data)
                    inner.state[param]["exp_avg_sq"] = torch.zeros_like(param.data)


@contextlib.contextmanager
def _per_param_step_set_aside(optimizer):
    """Work around Megatron-Core 0.16.1 loading ``fully_reshardable`` distributed-optimizer state
    into torch's Adam (the CPU path; TE's FusedAdam keeps its step in the parameter groups): the
    loader leaves ``step`` out of the tensors it copies, but copies every key of the live state,
    ``step`` included, and fails with ``KeyError: 'step'``. The step is set aside while the
    tensors are copied (its value is restored from the checkpoint's parameter groups before),
    and every parameter gets its own step tensor afterwards."""
    patched = []
    for leaf in _leaf_optimizers(optimizer):
        if not hasattr(leaf, "_set_main_param_and_optimizer_states"):
            continue
        original = leaf._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, leaf=leaf, original=original):
            group, order = leaf.model_param_group_index_map[model_param]
            main_param = leaf.optimizer.param_groups[group]["params"][order]
            state = leaf.optimizer.state[main_param]
            step = state.pop("step", None)
            try:
                original(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        leaf._set_main_param_and_optimizer_states = set_states
        patched.append(leaf)
    try:
        yield
    finally:
        for leaf in patched:
            del leaf._set_main_param_and_optimizer_states
    # The same loader hands one ``step`` tensor to every parameter; torch's Adam increments each
    # parameter's step in place, so a shared tensor would advance once per parameter per step.
    for leaf in _leaf_optimizers(optimizer):
        inner = getattr(leaf, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _leaf_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _flag_device() -> torch.device:
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
