"""Trainer checkpoints: save and resume the actor (and critic), their optimizers and schedules,
the trainer's state and the resolved config (layout in :mod:`megarl.checkpoint.layout`).

Models go through Megatron's ``dist_checkpointing`` with the distributed optimizer in the
``fully_reshardable`` format, so a checkpoint saved at one TP×PP×DP layout resumes at any other.
verl's ``<role>.checkpoint.save_contents`` / ``load_contents`` choose the parts (``model``,
``optimizer``, ``extra``: the LR scheduler, ``hf_model``: an HF copy); the trainer's state is
always saved and loaded. Every function here is collective: call it on every rank.
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state

from megarl.checkpoint import processes
from megarl.checkpoint.hf_export import checkpoint_meta, copy_side_files, export_hf
from megarl.checkpoint.layout import (
    CONFIG_FILE,
    EXTRA_STATE_FILE,
    HF_EXPORT_DIR,
    HF_FILES_DIR,
    TRAINER_STATE_FILE,
    CheckpointError,
    apply_retention,
    commit,
    read_json,
    step_dir,
    tmp_dir,
    write_json,
)
from megarl.checkpoint.meta import META_FILE
from megarl.checkpoint.resume import check_model_fits
from megarl.checkpoint.schedule import (
    param_groups,
    restore_group_hyperparameters,
    restore_scheduler,
)
from megarl.models.gpt import unwrap
from megarl.models.trainable import TrainableModel

Warn = Callable[[str], None]


@dataclass
class SavedModel:
    """One trained model of the run as the checkpoint sees it."""

    role: str
    """Sub-directory and name: actor or critic."""
    model: TrainableModel
    """Its chunks, optimizer and scheduler."""
    prefix: str
    """Its config section (actor_rollout_ref.actor, critic), for messages."""
    model_key: str
    """The config key of its HF model (actor_rollout_ref.model.path, critic.model.path)."""
    model_path: str
    """Its HF directory: config and tokenizer files are kept beside the shards."""
    save_contents: tuple[str, ...] = ("model", "optimizer", "extra")
    """verl's save_contents."""
    load_contents: tuple[str, ...] = ("model", "optimizer", "extra")
    """verl's load_contents."""
    use_checkpoint_schedule: bool = False
    """optim.use_checkpoint_opt_param_scheduler."""


def check_shared_run_dir(run_dir: Path) -> None:
    """Fail on every rank, naming the ranks, unless all ranks see rank 0's files in run_dir."""
    rank, world = dist.get_rank(), dist.get_world_size()
    box = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    probe = Path(run_dir) / f".megarl_shared_dir_{box[0]}"
    if rank == 0:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text(str(box[0]))
    dist.barrier()
    seen = probe.is_file() and probe.read_text() == box[0]
    views: list[Any] = [None] * world
    dist.all_gather_object(views, (seen, socket.gethostname()))
    dist.barrier()
    if rank == 0:
        probe.unlink(missing_ok=True)
    blind = [f"{r} ({host})" for r, (ok, host) in enumerate(views) if not ok]
    if blind:
        raise CheckpointError(
            f"trainer.default_local_dir={run_dir} is not one directory shared by all ranks: "
            f"rank(s) {', '.join(blind)} do not see the file rank 0 wrote there; put it on a "
            "filesystem every node mounts"
        )


def save_checkpoint(
    run_dir: Path,
    step: int,
    models: Sequence[SavedModel],
    *,
    trainer_state: dict,
    config_yaml: str,
    keep: dict[str, int | None],
    export_hf_model: bool = False,
) -> tuple[Path, float]:
    """Write ``global_step_<step>`` atomically; returns (its path, seconds taken).

    ``export_hf_model`` adds ``<role>/huggingface`` for the actor (the final save) even when
    ``hf_model`` is not in ``save_contents``. Retention (``keep[role]``) runs after the commit.
    """
    start = time.perf_counter()
    rank = dist.get_rank()
    tmp, final = tmp_dir(run_dir, step), step_dir(run_dir, step)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash of an earlier launch
        tmp.mkdir(parents=True)
    dist.barrier()
    with processes.saving(step, run_dir, rank):
        for saved in models:
            hf = "hf_model" in saved.save_contents or (export_hf_model and saved.role == "actor")
            _save_model(saved, tmp / saved.role, step, with_hf=hf)
    if rank == 0:
        write_json(tmp / TRAINER_STATE_FILE, trainer_state)
        (tmp / CONFIG_FILE).write_text(config_yaml)
    dist.barrier()  # every rank's shards are on disk
    if rank == 0:
        commit(tmp, final, Path(run_dir))
        apply_retention(run_dir, keep)
    dist.barrier()
    return final, time.perf_counter() - start


LORA_ADAPTER_DIR = "lora_adapter"
"""Beside ``huggingface/`` in a LoRA actor's final save: the adapters as a PEFT folder."""

MODEL_HOLDS_ADAPTERS = "lora_adapters"
"""``megarl_meta.json``'s ``model_holds`` of a LoRA actor's checkpoint: its model tensors are
the adapters only; the base is the HF checkpoint at ``source`` (verl's Megatron LoRA saves
adapters only too)."""


def _save_model(saved: SavedModel, path: Path, step: int, *, with_hf: bool) -> None:
    from megarl.config.model_dims import read_hf_config

    model = saved.model
    if dist.get_rank() == 0:
        path.mkdir(parents=True)
    dist.barrier()
    if "optimizer" in saved.save_contents:
        state = model.sharded_state_dict()
    else:
        state = {"model": model.model_sharded_state_dict()}
    lora = model.model.meta.get("lora")
    if lora is not None:  # the adapters (and their optimizer state); the base stays at its path
        state["model"] = adapters_only(state["model"])
    dist_checkpointing.save(state, str(path))
    hf_config = read_hf_config(Path(saved.model_path).expanduser())
    dtype = str(model.model.config.params_dtype).removeprefix("torch.")
    # Side files after the shards: Megatron takes files already in the directory for the
    # remains of an incomplete save.
    if dist.get_rank() == 0:
        layout = {
            "tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size(),
            "vpp": len(model.chunks) if len(model.chunks) > 1 else None,
            **model.model.layout.pipeline_split(),  # for the record: any split resumes
        }
        meta = checkpoint_meta(
            hf_config,
            source=str(saved.model_path),
            dtype=dtype,
            layout=layout,
            step=step,
            contents=list(saved.save_contents),
        )
        if lora is not None:  # what megarl convert needs to rebuild (and merge) the adapters
            meta["lora"] = dataclasses.asdict(lora)
            meta["model_holds"] = MODEL_HOLDS_ADAPTERS  # the base: meta["source"]
        write_json(path / META_FILE, meta)
        if "extra" in saved.save_contents:
            write_json(path / EXTRA_STATE_FILE, {"scheduler": model.scheduler.state_dict()})
        copy_side_files(Path(saved.model_path).expanduser(), path / HF_FILES_DIR)
    if with_hf:
        export_hf(
            model.chunks,
            path / HF_EXPORT_DIR,
            model.model.dims,
            hf_config=hf_config,
            dtype_name=dtype,
            side_dir=Path(saved.model_path).expanduser(),
        )
        if lora is not None:  # LoRA: the export above is merged; the adapters alone for peft
            from megarl.models.lora_peft import export_peft_adapter

            export_peft_adapter(model.chunks, model.model.dims, lora, path / LORA_ADAPTER_DIR,
                                base_model=str(saved.model_path))  # fmt: skip


def load_checkpoint(ckpt: Path, models: Sequence[SavedModel], warn: Warn) -> dict:
    """Load ``ckpt`` into ``models`` (per ``load_contents``); returns the saved trainer state."""
    for saved in models:
        check_model_fits(ckpt, saved.role, saved.model_key, saved.model_path)
    for saved in models:
        _load_model(saved, ckpt / saved.role, warn)
    return read_json(ckpt / TRAINER_STATE_FILE)


def _load_model(saved: SavedModel, path: Path, warn: Warn) -> None:
    model = saved.model
    meta = read_json(path / META_FILE)
    stored = set(meta.get("contents", ("model", "optimizer", "extra")))
    wanted = set(saved.load_contents)
    lora = model.model.meta.get("lora") is not None  # the adapters come from the checkpoint
    for part in sorted((wanted & {"optimizer", "extra"}) - stored):
        warn(f"resume: {path} holds no {part} (save_contents); it starts fresh")
    if "optimizer" in wanted & stored:
        configured = [
            {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
            for group in param_groups(model.optimizer)
        ]
        wanted_state = model.sharded_state_dict(is_loading=True)
        if lora:
            wanted_state["model"] = adapters_only(wanted_state["model"])
        state = dist_checkpointing.load(wanted_state, str(path))
        model.load_sharded_state_dict(state)  # (not strict: a LoRA base stays as loaded)
        restore_group_hyperparameters(
            model.optimizer,
            configured,
            use_checkpoint=saved.use_checkpoint_schedule,
            prefix=saved.prefix,
            warn=warn,
        )
    else:
        wanted_model = model.model_sharded_state_dict()
        if lora:
            wanted_model = adapters_only(wanted_model)
        state = dist_checkpointing.load({"model": wanted_model}, str(path))
        _load_weights_only(model, state["model"], path, adapters=lora)
        model.reload_model_params()  # the optimizer's main parameters follow the loaded weights
    if "extra" in wanted & stored:
        extra = read_json(path / EXTRA_STATE_FILE)
        restore_scheduler(
            model.scheduler,
            extra["scheduler"],
            use_checkpoint=saved.use_checkpoint_schedule,
            prefix=saved.prefix,
            warn=warn,
        )


def adapters_only(model_state: dict) -> dict:
    """A LoRA actor's ``{"model0": {key: sharded tensor}, ...}`` cut to its adapters' keys."""
    from megarl.models.lora import is_adapter_param

    return {c: {k: v for k, v in d.items() if is_adapter_param(k)} for c, d in model_state.items()}


def _load_weights_only(
    model: TrainableModel, state: dict, path: Path, *, adapters: bool = False
) -> None:
    from megarl.models.lora import is_adapter_param

    for i, chunk in enumerate(model.chunks):
        missing, unexpected = unwrap(chunk).load_state_dict(state[f"model{i}"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if adapters:  # the base weights are the ones loaded from the model path
            missing = [k for k in missing if is_adapter_param(k)]
        if missing or unexpected:
            raise CheckpointError(
                f"checkpoint {path} does not match the model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
