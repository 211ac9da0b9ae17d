"""Qwen2.5-VL and Qwen2-VL actors (issue 58): a Megatron language model with multimodal RoPE and
transformers' own vision tower.

The design of slime's geo3k VLM example. The language model is the Qwen2 ``GPTModel`` megarl
builds for text (:mod:`megarl.models.gpt`, any TP×PP), with Megatron's ``mrope`` rotary
embedding; its weights load through the text mapping (:mod:`megarl.models.hf_mapping`) under
the VL checkpoint's names. The vision tower (patch embedding, blocks, merger) is transformers'
``model.visual`` module, built from the checkpoint's ``vision_config`` and loaded under its HF
names, replicated on every TP rank of the first pipeline stage (the only stage that embeds).
On that stage the image embeddings replace the word embeddings at the image tokens
(:func:`~megarl.models.vl_inputs.place_image_embeddings`) and go in as ``decoder_input``; every
stage rotates by the 3-D positions (:func:`~megarl.models.vl_inputs.mrope_position_ids`).

Built: TP and PP, right-padded rows, images; the runner's passes (log-probs, the update) with
the images as a batch extra (:class:`~megarl.models.vl_inputs.ImageRows`, read by
:func:`image_prompt_inputs`), the tower trainable or frozen. Not built (refused by
:func:`build_vision_language_model` or the runner in one line): sequence and context
parallelism, VPP, packed rows, videos.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megarl.config.model_dims import ModelDims
from megarl.models.build import BuiltModel, _check_parallel_state
from megarl.models.gpt import build_gpt_chunks, build_transformer_config, unwrap
from megarl.models.sequences import causal_mask
from megarl.models.vl_inputs import (
    VISION_TOWER,
    ImageRows,
    mrope_position_ids,
    place_image_embeddings,
)
from megarl.models.weights import HFCheckpointReader, local_global_names, read_tp_shard, tp_group_of
from megarl.parallel.layout import ParallelLayout, shape_layout_problems

VISION_TOWERS = {
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel"),
    "qwen2_vl": ("qwen2_vl", "Qwen2VisionTransformerPretrainedModel"),
}
"""HF ``model_type`` -> (transformers module, vision tower class) of each VL family."""


@dataclass(frozen=True)
class VisionLanguageSpec:
    """What the VL forward needs of the HF config beside the language model's shape."""

    model_type: str
    """``qwen2_5_vl`` or ``qwen2_vl``."""
    image_token_id: int
    """The image placeholder (``<|image_pad|>``): one token per merged patch."""
    spatial_merge_size: int
    """Patches merged into one language token along each side (2)."""
    mrope_section: tuple[int, int, int]
    """Rotary frequency pairs given to the temporal, height and width positions."""


@dataclass
class VisionLanguageModel:
    """This rank's part of a VL actor: the language model's chunks and, on the first pipeline
    stage, the vision tower (None elsewhere)."""

    language: BuiltModel
    vision: torch.nn.Module | None
    spec: VisionLanguageSpec


@dataclass
class ImageBatch:
    """Right-padded rows of image prompts (and responses), as the processor gives them."""

    input_ids: torch.Tensor
    """``[b, s]`` token ids, each image widened to its ``t·h·w / merge²`` placeholder tokens."""
    lengths: torch.Tensor
    """``[b]`` tokens of each row before its padding."""
    pixel_values: torch.Tensor | None = None
    """``[patches, channels · temporal_patch · patch²]`` of every image, in order."""
    image_grid_thw: torch.Tensor | None = None
    """``[images, 3]`` each image's (t, h, w) patch grid, in order."""


def _hf_config(path: str | Path) -> Any:
    """The checkpoint's config as transformers reads it (old flat and new nested files alike)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path))
    if config.model_type not in VISION_TOWERS:
        raise ValueError(
            f"{path}: model_type {config.model_type!r} is not a VL family "
            f"({', '.join(VISION_TOWERS)})"
        )
    return config


def language_hf_config(config: Any) -> dict[str, Any]:
    """The Qwen2 ``config.json`` of a VL config's language model, for :class:`ModelDims`.

    transformers' Qwen2-VL attention takes head_dim = hidden_size / heads whatever the config
    says; a config saying otherwise is refused rather than built differently.
    """
    text = config.text_config.to_dict()
    heads = text["num_attention_heads"]
    if text.get("head_dim") not in (None, text["hidden_size"] // heads):
        raise ValueError(
            f"text_config.head_dim={text['head_dim']} != hidden_size / heads "
            f"({text['hidden_size'] // heads}), which transformers' Qwen2-VL attention uses"
        )
    rope = text.get("rope_parameters") or {}
    return {
        **{k: v for k, v in text.items() if k not in ("architectures", "head_dim", "rope_scaling")},
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        "rope_parameters": {"rope_type": "default", "rope_theta": rope.get("rope_theta", 1e6)},
    }


def vision_language_spec(config: Any) -> VisionLanguageSpec:
    """The :class:`VisionLanguageSpec` of a transformers VL config (mrope_section default
    [16, 24, 24], transformers' own)."""
    rope = config.text_config.rope_parameters or {}
    section = tuple(int(x) for x in rope.get("mrope_section", (16, 24, 24)))
    return VisionLanguageSpec(
        model_type=config.model_type,
        image_token_id=int(config.image_token_id),
        spatial_merge_size=int(config.vision_config.spatial_merge_size),
        mrope_section=section,  # type: ignore[arg-type]
    )


class VLCheckpointReader(HFCheckpointReader):
    """A VL checkpoint read under the text families' HF names (``model.layers.{i}.…``,
    ``model.embed_tokens.weight``, ``lm_head.weight``), whichever layout it was saved in: the
    hub's (``model.layers``, ``visual.``) or transformers 5's module names
    (``model.language_model.layers``, ``model.visual.``)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        nested = "model.language_model.embed_tokens.weight" in self._file_of
        self.language_prefix = "model.language_model." if nested else "model."
        self.vision_prefix = (
            "model.visual."
            if "model.visual.patch_embed.proj.weight" in self._file_of
            else "visual."
        )

    def _name(self, name: str) -> str:
        if name.startswith("model."):
            return self.language_prefix + name.removeprefix("model.")
        return name

    def __contains__(self, name: str) -> bool:
        return super().__contains__(self._name(name))

    def get(self, name: str) -> torch.Tensor:
        return super().get(self._name(name))

    def shape(self, name: str) -> tuple[int, ...]:
        return super().shape(self._name(name))

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return super().get_slice(self._name(name), dim, start, stop)

    def vision_state(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The vision tower's tensors by their names in ``model.visual``."""
        return {n: HFCheckpointReader.get(self, self.vision_prefix + n) for n in names}


def build_vision_tower(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' vision tower of ``config`` (uninitialised weights: a load follows), on this
    rank's device, SDPA attention."""
    if config.model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as cls,
        )
    else:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel as cls,
        )
    vision_config = config.vision_config
    vision_config._attn_implementation = "sdpa"
    tower = cls._from_config(vision_config, dtype=dtype)
    if torch.cuda.is_available():
        tower.cuda(torch.cuda.current_device())
    return tower


def build_vision_language_model(
    source: str | Path,
    layout: ParallelLayout,
    *,
    dtype: torch.dtype = torch.float32,
    load_weights: bool = True,
    freeze_vision_tower: bool = False,
) -> VisionLanguageModel:
    """Build this rank's part of the Qwen2.5-VL / Qwen2-VL actor in ``source`` (an HF directory)
    at ``layout`` (the initialised Megatron parallel state), weights loaded unless
    ``load_weights`` is False (then random: Megatron's init and transformers').

    The vision tower is a submodule of the first stage's ``GPTModel`` (:data:`VISION_TOWER`),
    so a :class:`~megarl.models.trainable.TrainableModel` of ``model.language`` trains it:
    Megatron's DDP reduces its gradients over DP and its optimizer steps it. It is replicated
    over TP, each TP rank computing the same gradient; Megatron averages them over TP anyway
    (``average_gradients_across_tp_domain``), so the replicas cannot drift apart under a
    nondeterministic kernel. ``freeze_vision_tower`` (verl's ``actor.freeze_vision_tower``):
    the whole tower, merger included, without gradients and out of the optimizer.

    Refused in one line (not built yet): sequence or context parallelism, VPP, expert
    parallelism.
    """
    _check_parallel_state(layout)
    unbuilt = {"sequence parallelism": layout.sequence_parallel and layout.tp > 1,
               f"CP={layout.cp}": layout.cp > 1, f"VPP={layout.vpp}": layout.vpp > 1,
               f"EP={layout.ep}": layout.ep > 1}  # fmt: skip
    if any(unbuilt.values()):
        names = ", ".join(k for k, v in unbuilt.items() if v)
        raise NotImplementedError(f"{source}: a vision-language model at {names} is not built yet")
    config = _hf_config(source)
    spec = vision_language_spec(config)
    dims = ModelDims.from_hf_config(language_hf_config(config), tp_size=layout.tp)
    problems = shape_layout_problems(layout, dims.known())
    if problems:
        raise ValueError(
            f"{source}: {problems[0].describe(tp=f'TP={layout.tp}', pp=f'PP={layout.pp}')}"
        )
    tconfig = build_transformer_config(
        dims,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        params_dtype=dtype,
        pipeline_split=layout.pipeline_split(),
    )
    # GPTModel reads its position embedding from the config when the config names one (as
    # Megatron's MLA and multimodal configs do), over build_gpt_chunks' "rope" argument.
    tconfig.position_embedding_type = "mrope"
    tconfig.mrope_section = list(spec.mrope_section)
    tconfig.perform_initialization = not load_weights
    chunks = build_gpt_chunks(dims, tconfig)
    vision = None
    for chunk in chunks:  # every stage rotates by the images' 3-D positions
        unwrap(chunk).vision_language_spec = spec
    if parallel_state.is_pipeline_first_stage():
        vision = build_vision_tower(config, dtype)
        vision.requires_grad_(not freeze_vision_tower)
        for param in vision.parameters():
            param.average_gradients_across_tp_domain = True
        setattr(unwrap(chunks[0]), VISION_TOWER, vision)
    language = BuiltModel(dims, list(chunks), tconfig, layout, "actor", Path(source))
    model = VisionLanguageModel(language, vision, spec)
    if load_weights:
        load_vision_language_weights(model, source)
    return model


@torch.no_grad()
def load_vision_language_weights(model: VisionLanguageModel, source: str | Path) -> None:
    """Fill this rank's language-model shards (each rank reading its TP slices) and, on the first
    stage, the whole vision tower from the HF checkpoint at ``source``."""
    dims = model.language.dims
    with VLCheckpointReader(source) as reader:
        for _i, _local, global_name, param in local_global_names(model.language.chunks):
            tp_size, tp_rank = tp_group_of(global_name)
            shard = read_tp_shard(reader, global_name, dims, tp_size, tp_rank)
            if shard.shape != param.shape:
                raise ValueError(
                    f"{global_name}: shard {tuple(shard.shape)} != parameter {tuple(param.shape)}"
                )
            param.copy_(shard.to(param.dtype))
        if model.vision is not None:
            names = list(model.vision.state_dict())
            model.vision.load_state_dict(reader.vision_state(names), strict=True)


def image_embeddings(model: VisionLanguageModel, batch: ImageBatch) -> torch.Tensor | None:
    """The merged image embeddings ``[image tokens, hidden]`` of ``batch`` (None without images)."""
    if batch.pixel_values is None:
        return None
    pixels = batch.pixel_values.to(next(model.vision.parameters()).dtype)
    return model.vision(pixels, grid_thw=batch.image_grid_thw).pooler_output


def image_prompt_inputs(
    chunk: torch.nn.Module, input_ids: torch.Tensor, lengths: torch.Tensor, images: ImageRows
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The runner's inputs of one micro-batch of image prompts on ``chunk`` (a chunk of
    :func:`build_vision_language_model`, DDP-wrapped or not): the 3-D positions ``[3, b, s]``
    and, on the first stage, ``decoder_input [s, b, h]``: the word embeddings with the
    ``images`` (the micro-batch's rows' :class:`ImageRows`) placed at their tokens.

    A micro-batch without images still adds the trainable tower's parameters times 0: Megatron's
    DDP with ``overlap_grad_reduce`` launches a gradient bucket's reduction only once every
    parameter in it has had its gradient, so a DP rank whose last micro-batch had no image
    would fail in ``finish_grad_sync`` while its peers reduce (tried)."""
    gpt = unwrap(chunk)
    spec: VisionLanguageSpec = gpt.vision_language_spec
    positions = mrope_position_ids(
        input_ids,
        lengths,
        images.image_grid_thw,
        image_token_id=spec.image_token_id,
        spatial_merge_size=spec.spatial_merge_size,
    )
    if not gpt.pre_process:
        return positions, None
    decoder_input = gpt.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]
    tower = getattr(gpt, VISION_TOWER)
    if len(images.image_grid_thw):
        pixels = images.pixel_values.to(next(tower.parameters()).dtype)
        embeds = tower(pixels, grid_thw=images.image_grid_thw).pooler_output
        decoder_input = place_image_embeddings(
            decoder_input, input_ids, embeds, image_token_id=spec.image_token_id
        )
    elif torch.is_grad_enabled():
        trainable = [p.sum() for p in tower.parameters() if p.requires_grad]
        if trainable:
            decoder_input = decoder_input + torch.stack(trainable).sum() * 0.0
    return positions, decoder_input


def forward_chunk(
    model: VisionLanguageModel,
    chunk: torch.nn.Module,
    batch: ImageBatch,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """One chunk's forward of ``batch``: the first stage embeds the tokens and places the image
    embeddings; every stage rotates by ``position_ids [3, b, s]``. Returns the chunk's output
    (vocab-parallel logits ``[b, s, V/TP]`` on the last stage)."""
    ids = batch.input_ids
    decoder_input = None
    gpt = unwrap(chunk)
    if gpt.pre_process:
        decoder_input = gpt.embedding(input_ids=ids, position_ids=None)  # [s, b, h]
        images = image_embeddings(model, batch)
        if images is not None:
            decoder_input = place_image_embeddings(
                decoder_input, ids, images, image_token_id=model.spec.image_token_id
            )
    mask = causal_mask(ids.shape[1], ids.device)
    return chunk(None, position_ids, mask, decoder_input=decoder_input)


def position_ids_of(model: VisionLanguageModel, batch: ImageBatch) -> torch.Tensor:
    """``batch``'s multimodal RoPE positions ``[3, b, s]``."""
    return mrope_position_ids(
        batch.input_ids,
        batch.lengths,
        batch.image_grid_thw,
        image_token_id=model.spec.image_token_id,
        spatial_merge_size=model.spec.spatial_merge_size,
    )


def forward_logits(model: VisionLanguageModel, batch: ImageBatch) -> torch.Tensor | None:
    """Forward-only pass of one micro-batch through Megatron's pipeline schedule: the
    vocab-parallel logits ``[b, s, V/TP]`` (detached) on the last stage, None elsewhere."""
    chunks = model.language.chunks
    positions = position_ids_of(model, batch)
    kept: list[torch.Tensor] = []

    def step(data_iterator, chunk):
        next(data_iterator)
        output = forward_chunk(model, chunk, batch, positions)

        def loss_func(logits: torch.Tensor):
            kept.append(logits.detach())
            return logits.sum() * 0.0, torch.ones((), dtype=torch.int), {}

        return output, loss_func

    get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iter([None]),
        model=chunks[0],
        num_microbatches=1,
        seq_length=batch.input_ids.shape[1],
        micro_batch_size=batch.input_ids.shape[0],
        forward_only=True,
    )
    return kept[0] if kept else None
