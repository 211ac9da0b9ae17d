"""The weight update's steps inside vLLM's worker: ``collective_rpc`` calls each as
``f(worker, ...)`` in the engine core's process (in-process here). :class:`megarl.rollout.
vllm_engine.VLLMEngine` drives them: begin a layerwise reload, load chunks, finish it, then redo
what vLLM's reload skips (a tied ``lm_head``'s and the CPU MoE kernel's weight packing)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch import Tensor


def begin_layerwise_reload(worker: Any) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(worker.model_runner.get_model())


def load_weights(worker: Any, named_tensors: Iterator[tuple[str, Tensor]]) -> None:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        worker.model_runner.get_model().load_weights(named_tensors)


def finish_layerwise_reload(worker: Any) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(worker.model_runner.get_model(), worker.vllm_config.model_config)


IN_PLACE_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})
"""vLLM quantization methods whose CPU layers multiply by their kept weight (see
:func:`megarl.rollout.vllm_process._keep_cpu_linear_weights`)."""


def weights_update_in_place(worker: Any) -> bool:
    """Whether a weight update of this worker's model can be a plain ``load_weights`` into the
    weights it computes with: every layer with a quantization method is an unquantized one
    multiplying by its kept weight (``cpu_linear`` is torch's linear), and no weight has more
    than two dimensions (MoE experts are repacked after loading) but a convolution's (a VL
    vision tower's patch embedding, which computes with its weight as loaded). Else the update
    reloads layer by layer (:func:`begin_layerwise_reload`)."""
    import torch
    from vllm.model_executor.layers.conv import ConvLayerBase

    model = worker.model_runner.get_model()
    convolutions = {
        id(p)
        for m in model.modules()
        if isinstance(m, ConvLayerBase)
        for p in m.parameters(recurse=False)
    }
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        if type(method).__name__ not in IN_PLACE_METHODS:
            return False
        if getattr(module, "cpu_linear", None) is not torch.nn.functional.linear:
            return False
    return all(p.ndim <= 2 or id(p) in convolutions for p in model.parameters())


def reprocess_tied_lm_head(worker: Any) -> None:
    """Redo a tied ``lm_head``'s post-load processing after a weight update.

    vLLM's reload never hands a tied ``lm_head`` a tensor of its own (its loader skips
    ``lm_head.*``), so that layer's ``process_weights_after_loading`` is not re-run; on CPU that
    step packs the weight for the GEMM kernel, so logits would keep coming from the *old*
    embedding. Untied models: nothing to do. A VL model's are those of its ``language_model``.
    """
    from vllm.config import set_current_vllm_config

    top = worker.model_runner.get_model()
    model = getattr(top, "language_model", top)
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(lm_head, "weight", None)
    if weight is None or embed is None or weight is not getattr(embed, "weight", None):
        return
    with set_current_vllm_config(worker.vllm_config):
        lm_head.quant_method.process_weights_after_loading(lm_head)


def note_moe_blocks(
    named_tensors: Iterable[tuple[str, Tensor]], blocks: set[str]
) -> Iterator[tuple[str, Tensor]]:
    """Yield ``named_tensors`` unchanged, adding to ``blocks`` the MoE block of every expert
    tensor (``model.layers.3.mlp`` for ``model.layers.3.mlp.experts.5.up_proj.weight``)."""
    for name, tensor in named_tensors:
        if ".experts." in name:
            blocks.add(name.split(".experts.", 1)[0])
        yield name, tensor


def repack_cpu_experts(worker: Any, blocks: Sequence[str]) -> None:
    """Redo the CPU MoE kernel's weight packing for the experts of ``blocks`` after an update.

    vLLM 0.32 packs each layer's expert weights for its CPU grouped GEMM
    (``CPUUnquantizedExperts.process_weights_after_loading``) only when the layer is first
    loaded: a reload re-runs the layer's processing but skips that step on a weight update
    (``UnquantizedFusedMoEMethod._setup_kernel``), so the kernel would read the new weights in
    the unpacked layout (wrong log-probs even for the very same weights).
    GPU kernels are not touched. Raises ``NotImplementedError`` where the CPU kernel pads the
    experts' intermediate size (the reload cannot fill padded weights).
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config):
        for name, module in model.named_modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if not isinstance(experts, CPUUnquantizedExperts):
                continue
            if name.split(".experts", 1)[0] not in blocks:
                continue  # not updated in this session: already packed
            moe = module.moe_config
            padded = experts._padded_intermediate_size(moe)
            if padded != moe.intermediate_size_per_partition:
                raise NotImplementedError(
                    f"{name}: vLLM's CPU MoE kernel pads the experts' intermediate size "
                    f"{moe.intermediate_size_per_partition} per TP rank to {padded}; weight "
                    "updates of such a model are not supported on CPU"
                )
            experts.process_weights_after_loading(module)


def load_lora_adapter(
    worker: Any, lora_id: int, tensors: dict[str, Tensor], peft_config: dict[str, Any]
) -> bool:
    """Register PEFT-named full adapter tensors as vLLM LoRA adapter ``lora_id``, replacing the
    one of that id (``lora.merge=false``).

    vLLM's own path (``WorkerLoRAManager._load_adapter``) reads a folder; this builds the same
    ``LoRAModel`` from tensors in memory. Each TP rank's LoRA layers slice the full tensors
    themselves when the adapter is activated (``set_lora``). The tensors are copied first: vLLM
    scales B in place while building the model (``LoRAModel.optimize``), and in-process the
    caller's tensors would be the very same objects.
    """
    from vllm.config import set_current_vllm_config
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    adapters = manager._adapter_manager
    helper = PEFTHelper.from_dict(dict(peft_config))
    helper.validate_legal(manager.lora_config)
    mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
    with set_current_vllm_config(worker.vllm_config):
        lora = LoRAModel.from_lora_tensors(
            lora_id,
            {name: t.detach().clone() for name, t in tensors.items()},
            helper,
            device="cpu",
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(adapters.model, "lora_skip_prefixes", None),
        )
        adapters.remove_adapter(lora_id)  # deactivates it: the next batch copies the new one in
        return adapters.add_adapter(lora)
