"""Prompt datasets over local parquet files in verl's schema.

Columns (as verl's ``examples/data_preprocess/*.py`` write them): ``data_source``, ``prompt``
(chat messages or a string; ``data.prompt_key``), ``ability``, ``reward_model`` (``style``,
``ground_truth``) and ``extra_info``; ``data.reward_fn_key`` names the column that selects the
reward function. Files are read with pyarrow and tokenised once, up front
(:mod:`megarl.data.tokenize`); rows are selected as verl's ``RLHFDataset`` selects them.

Vision-language rows (issue 58) have an ``images`` column (``data.image_key``) and ``<image>``
placeholders in their messages (:mod:`megarl.data.images`, :mod:`megarl.data.image_rows`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from megarl.data.image_rows import ImageRows, row_images
from megarl.data.images import ImageError
from megarl.data.tokenize import is_blank_prompt, render_prompts, tokenize_prompts, truncate

__all__ = ["DataError", "PromptDataset", "PromptSample", "cap_num_workers"]

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A data file or row cannot be used; one line naming the key, file and row."""


@dataclass
class PromptSample:
    """One prompt, ready for rollout and scoring."""

    index: int
    """Position in the dataset (what the sampler yields)."""
    prompt_ids: list[int]
    """Token ids of the rendered (and possibly truncated) prompt."""
    raw_prompt: Any
    """The prompt cell as stored: chat messages or a string."""
    data_source: str
    """Value of the ``data.reward_fn_key`` column: selects the reward function."""
    ground_truth: Any
    """``reward_model.ground_truth``."""
    extra_info: dict[str, Any] = field(default_factory=dict)
    """``extra_info`` (an empty dict when the row has none)."""
    ability: str | None = None
    """``ability`` column, when present."""
    source: str = ""
    """``file row N`` the sample came from (for messages)."""
    images: list[Any] | None = None
    """The prompt's images as vLLM's ``multi_modal_data`` takes them (PIL, RGB, resized as
    qwen_vl_utils' ``fetch_image``); None for a text prompt."""
    multi_modal_inputs: dict[str, Any] | None = None
    """``pixel_values [patches, C·T·P·P]`` and ``image_grid_thw [images, 3]`` (long) of the image
    processor, for the model; None for a text prompt. ``prompt_ids`` then hold each image's
    widened placeholder (``t·h·w / merge²`` image tokens)."""


def _read_table(name: str, key: str) -> Any:
    import pyarrow.parquet as pq

    path = Path(name).expanduser()
    if not path.is_file():
        raise DataError(f"{key}: {name!r} does not exist")
    try:
        # One file: ParquetFile reads it without pyarrow.dataset (read_table's engine), whose
        # import costs each rank about 0.7 CPU-seconds at start-up; the same table.
        with pq.ParquetFile(path) as parquet:
            return parquet.read()
    except Exception as exc:
        raise DataError(f"{key}: cannot read {name!r} as parquet: {exc}") from exc


def _read_rows(
    files: Sequence[str], key: str, num_workers: int = 0
) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows of all files in order; ``num_workers`` > 1 decodes several files at once (pyarrow
    releases the GIL while decoding)."""
    if num_workers > 1 and len(files) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(num_workers, len(files))) as pool:
            tables = list(pool.map(lambda name: _read_table(name, key), files))
    else:
        tables = [_read_table(name, key) for name in files]
    rows: list[dict[str, Any]] = []
    wheres: list[str] = []
    for name, table in zip(files, tables, strict=True):
        rows += table.to_pylist()
        wheres += [f"{key}: {name} row {r}" for r in range(table.num_rows)]
    return rows, wheres


def _check_columns(row: dict[str, Any], where: str, prompt_key: str, reward_fn_key: str) -> None:
    for column, config_key in (
        (prompt_key, "data.prompt_key"),
        (reward_fn_key, "data.reward_fn_key"),
    ):
        if column not in row:
            raise DataError(
                f"{where.rsplit(' row ', 1)[0]} has no column {column!r} ({config_key}); columns: "
                f"{sorted(row)}"
            )
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise DataError(f"{where}: no reward_model.ground_truth")


class PromptDataset:
    """Tokenised prompts of one split; ``len()``, ``[i]`` -> :class:`PromptSample`.

    Rows as verl's ``RLHFDataset`` selects them: the files are concatenated; ``max_samples`` > 0
    keeps that many rows (with ``shuffle`` a choice without replacement by numpy's
    ``default_rng(seed)``, as verl, so the same rows; else the first ones);
    ``filter_overlong_prompts`` then drops prompts longer than ``max_prompt_length`` (counted and
    reported once; with ``tool_schemas``, counted as the chat template renders them with those
    tools, as verl's ``data.tool_config_path``), and longer prompts that remain are cut by
    ``truncation``.

    Rows with images (``image_key`` column; needs the model's ``image_processor``) are rendered
    with an image content item at each ``<image>``, their placeholders widened to each image's
    merged token count: the filter counts those tokens, as verl's. A longer image prompt that
    remains is refused (cutting it would split an image's tokens; verl refuses it at rollout).
    ``mm_processor_kwargs`` go to the image processor; a row with more than ``limit_images``
    images (None: vLLM's 999), an image that does not decode or a missing file is refused in one
    line naming file, row and image, and so is a row with videos (``video_key``).
    """

    def __init__(
        self,
        files: str | Sequence[str],
        tokenizer: Any,
        *,
        files_key: str = "data.train_files",
        prompt_key: str = "prompt",
        reward_fn_key: str = "data_source",
        max_prompt_length: int = 512,
        truncation: str = "error",
        filter_overlong_prompts: bool = False,
        use_chat_template: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        max_samples: int = -1,
        shuffle: bool = True,
        seed: int | None = 0,
        num_workers: int = 0,
        tool_schemas: list[dict[str, Any]] | None = None,
        image_processor: Any = None,
        image_key: str = "images",
        video_key: str = "videos",
        mm_processor_kwargs: dict[str, Any] | None = None,
        limit_images: int | None = None,
    ) -> None:
        files = [files] if isinstance(files, str) else list(files)
        if not files:
            raise DataError(f"{files_key} is empty")
        self.num_workers = num_workers
        """Threads that read the parquet files (``data.dataloader_num_workers``, capped)."""
        rows, wheres = _read_rows(files, files_key, num_workers)
        if 0 < max_samples < len(rows):
            import numpy as np

            if shuffle:
                keep = np.random.default_rng(seed).choice(len(rows), max_samples, replace=False)
            else:
                keep = np.arange(max_samples)
            rows, wheres = [rows[i] for i in keep], [wheres[i] for i in keep]
        for row, where in zip(rows, wheres, strict=True):
            _check_columns(row, where, prompt_key, reward_fn_key)
        prompts = [row[prompt_key] for row in rows]
        self.image_rows = self._image_rows(
            rows, wheres, prompts, tokenizer, image_processor, image_key, video_key,
            mm_processor_kwargs, limit_images,
        )  # fmt: skip
        texts = self._render(tokenizer, prompts, wheres, use_chat_template, chat_template_kwargs)
        ids = tokenize_prompts(tokenizer, texts)
        self.num_filtered = 0
        if filter_overlong_prompts:
            counted = ids
            if tool_schemas and use_chat_template:  # verl's RLHFDataset: counted with the tools
                with_tools = {**(chat_template_kwargs or {}), "tools": tool_schemas}
                texts_with_tools = self._render(tokenizer, prompts, wheres, True, with_tools)
                counted = tokenize_prompts(tokenizer, texts_with_tools)
            keep_rows = [i for i, t in enumerate(counted) if len(t) <= max_prompt_length]
            self.num_filtered = len(rows) - len(keep_rows)
            if self.num_filtered:
                log.warning(
                    "data.filter_overlong_prompts: dropped %d of %d prompts of %s longer than "
                    "data.max_prompt_length=%d tokens",
                    self.num_filtered,
                    len(rows),
                    files_key,
                    max_prompt_length,
                )
            rows = [rows[i] for i in keep_rows]
            wheres = [wheres[i] for i in keep_rows]
            ids = [ids[i] for i in keep_rows]
            if self.image_rows is not None:
                self.image_rows.keep(keep_rows)
        if self.image_rows is not None:
            for i, (t, where) in enumerate(zip(ids, wheres, strict=True)):
                if i in self.image_rows.cells and len(t) > max_prompt_length:
                    raise DataError(
                        f"{where}: the image prompt has {len(t)} tokens, more than "
                        f"data.max_prompt_length={max_prompt_length}; image prompts are not "
                        "truncated (an image's tokens would be cut): set "
                        "data.filter_overlong_prompts=true, or lower the images' max_pixels"
                    )
        self.samples = [
            PromptSample(
                index=i,
                prompt_ids=truncate(t, max_prompt_length, truncation, where),
                raw_prompt=row[prompt_key],
                data_source=row[reward_fn_key],
                ground_truth=row["reward_model"]["ground_truth"],
                extra_info=dict(row.get("extra_info") or {}),
                ability=row.get("ability"),
                source=where,
            )
            for i, (row, t, where) in enumerate(zip(rows, ids, wheres, strict=True))
        ]
        if not self.samples:
            raise DataError(f"{files_key}: no prompts left (all filtered or the files are empty)")
        self.blank_prompts = [s.source for s in self.samples if is_blank_prompt(s.raw_prompt)]
        """Where each prompt without text is (``file row N``): verl trains on them as they are,
        ``megarl train``'s pre-flight warns."""

    @staticmethod
    def _image_rows(
        rows: list[dict[str, Any]], wheres: list[str], prompts: list[Any], tokenizer: Any,
        image_processor: Any, image_key: str, video_key: str,
        mm_processor_kwargs: dict[str, Any] | None, limit_images: int | None,
    ) -> ImageRows | None:  # fmt: skip
        """The rows' images (None when no row has any); ``prompts`` of the image rows become
        their messages with image content items."""
        try:
            cells = [
                row_images(r, image_key, video_key, w) for r, w in zip(rows, wheres, strict=True)
            ]
            if not any(cells):
                return None
            if image_processor is None:
                where = wheres[next(i for i, c in enumerate(cells) if c)]
                raise ImageError(f"{where}: the row has images (data.image_key={image_key!r}) but "
                                 "the model has no image processor (preprocessor_config.json)")  # fmt: skip
            images = ImageRows(tokenizer, image_processor,
                               mm_processor_kwargs=mm_processor_kwargs, limit_images=limit_images)  # fmt: skip
            for i, (row_cells, where) in enumerate(zip(cells, wheres, strict=True)):
                if row_cells:
                    prompts[i] = images.add(i, prompts[i], row_cells, where)
            return images
        except ValueError as exc:  # ImageError, a bad mm_processor_kwargs key, a bad message
            raise DataError(str(exc)) from exc

    def _render(
        self, tokenizer: Any, prompts: list[Any], wheres: list[str], use_chat_template: bool,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> list[str]:  # fmt: skip
        """The prompts' texts, image placeholders widened."""
        texts = render_prompts(tokenizer, prompts, wheres, use_chat_template=use_chat_template,
                               chat_template_kwargs=chat_template_kwargs)  # fmt: skip
        if self.image_rows is not None:
            try:
                for i in self.image_rows.cells:
                    texts[i] = self.image_rows.widen(i, texts[i], wheres[i])
            except ImageError as exc:
                raise DataError(str(exc)) from exc
        return texts

    @classmethod
    def from_config(
        cls,
        data: Any,
        tokenizer: Any,
        split: str,
        seed: int,
        tool_schemas: list[dict[str, Any]] | None = None,
        image_processor: Any = None,
        limit_images: int | None = None,
    ) -> PromptDataset:
        """The ``train`` or ``val`` split of a ``DataConfig``; ``seed``: ``data.seed`` or
        ``trainer.seed``; ``tool_schemas``: the tools ``filter_overlong_prompts`` counts a prompt
        with (:func:`megarl.rollout.multi_turn_rollout.prompt_tool_schemas`); ``image_processor``:
        the model's (:func:`megarl.data.tokenizer.load_image_processor`), for image rows;
        ``limit_images``: ``actor_rollout_ref.rollout.limit_images``."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        return cls(
            data.train_files if split == "train" else data.val_files,
            tokenizer,
            files_key=f"data.{split}_files",
            prompt_key=data.prompt_key,
            reward_fn_key=data.reward_fn_key,
            max_prompt_length=data.max_prompt_length,
            truncation=data.truncation,
            filter_overlong_prompts=data.filter_overlong_prompts,
            use_chat_template=data.use_chat_template,
            chat_template_kwargs=data.apply_chat_template_kwargs,
            max_samples=data.train_max_samples if split == "train" else data.val_max_samples,
            shuffle=data.shuffle,
            seed=data.seed if data.seed is not None else seed,
            num_workers=cap_num_workers(data.dataloader_num_workers),
            tool_schemas=tool_schemas,
            image_processor=image_processor,
            image_key=data.image_key,
            mm_processor_kwargs=data.mm_processor_kwargs,
            limit_images=limit_images,
        )

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> PromptSample:
        """The sample; an image prompt's with its images and pixels (made now, from the stored
        image bytes)."""
        sample = self.samples[index]
        index = sample.index
        if self.image_rows is None or index not in self.image_rows.cells:
            return sample
        try:
            images, pixels = self.image_rows.inputs(index, sample.source)
        except ImageError as exc:
            raise DataError(str(exc)) from exc
        return replace(sample, images=images, multi_modal_inputs=pixels)


_capped_note_given = False


def cap_num_workers(requested: int, cpus: int | None = None) -> int:
    """``data.dataloader_num_workers`` capped at the CPUs this process may use (noted once).

    megarl reads and tokenises prompts once, up front (verl's loader workers tokenise lazily), so
    the value sizes the threads that read the parquet files (:meth:`PromptDataset.from_config`);
    a value above the CPU count would just oversubscribe the machine.
    """
    global _capped_note_given
    if cpus is None:
        affinity = getattr(os, "sched_getaffinity", None)
        cpus = len(affinity(0)) if affinity else (os.cpu_count() or 1)
    if requested <= cpus:
        return requested
    if not _capped_note_given:
        _capped_note_given = True
        log.warning(
            "data.dataloader_num_workers=%d exceeds the %d CPU(s) available; using %d",
            requested,
            cpus,
            cpus,
        )
    return cpus
