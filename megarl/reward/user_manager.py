"""A user's own reward manager class (``reward.reward_manager.source=importlib``), called as
verl 0.9.1's reward loop calls one, inside a scoring worker.

verl 0.9.1 loads ``getattr(<reward.reward_manager.module.path>, reward.reward_manager.name)``,
constructs it as ``cls(config=, tokenizer=, compute_score=)`` (``compute_score``: the
``custom_reward_function`` with its ``reward_kwargs`` bound, or the built-in router) and awaits
``run_single(data)`` for each sample, ``data`` a one-sample ``DataProto``; the answer is
``{"reward_score": float, "reward_extra_info": {...}}``. megarl does the same in each scoring
worker, one manager per worker, with these differences (docs/verl-differences.md):

- ``data`` is :class:`SampleBatch`, the part of ``DataProto`` a manager reads: ``len``,
  ``data[-1:]``, ``data[0]`` (``.batch`` and ``.non_tensor_batch``), ``.batch`` with
  ``prompts`` ``[1, P]``, ``responses`` ``[1, R]``, ``input_ids`` and ``attention_mask``
  ``[1, P + R]`` (unpadded: the mask is all ones), ``.non_tensor_batch`` with ``data_source``,
  ``reward_model`` (``{"ground_truth": ...}``) and ``extra_info`` (the prompt's), for a
  multi-turn response also ``__num_turns__`` and ``tool_extra_fields`` (``turn_scores``,
  ``tool_rewards``; verl's has the agent loop's other fields too), ``.meta_info``;
- ``config`` is megarl's resolved config as nested dicts with attribute access (verl: an
  OmegaConf ``DictConfig``; ``config.reward.reward_kwargs`` and ``.get`` work alike);
- the base class is :class:`RewardManagerBase` here (verl's needs verl installed): the same
  constructor, attributes (``config``, ``tokenizer``, ``compute_score``, ``loop``) and
  ``init_class``; any class with that constructor and an ``async run_single`` works.
"""

from __future__ import annotations

import asyncio
import functools
from abc import ABC, abstractmethod
from typing import Any

__all__ = [
    "AttrDict",
    "RewardManagerBase",
    "SampleBatch",
    "UserManager",
    "manager_class",
    "manager_problem",
]
MODULE_KEY = "reward.reward_manager.module.path"


class AttrDict(dict):
    """A dict whose keys are also attributes, nested dicts included (``config.reward.x``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            value = self[name]
        except KeyError:
            raise AttributeError(name) from None
        return (
            AttrDict(value)
            if isinstance(value, dict) and not isinstance(value, AttrDict)
            else value
        )

    def get(self, key: str, default: Any = None) -> Any:
        value = super().get(key, default)
        return (
            AttrDict(value)
            if isinstance(value, dict) and not isinstance(value, AttrDict)
            else value
        )


class RewardManagerBase(ABC):
    """verl 0.9.1's ``RewardManagerBase`` contract: subclass it and write ``run_single``."""

    _class_initialized = False

    def __init__(self, config: Any, tokenizer: Any, compute_score: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.compute_score = compute_score
        self.loop = asyncio.get_event_loop()
        self.init_class(config, tokenizer)

    @classmethod
    def init_class(cls, config: Any, tokenizer: Any) -> None:
        """Class state shared by every instance (once per worker process)."""
        if cls._class_initialized:
            return
        cls._class_initialized = True

    @abstractmethod
    async def run_single(self, data: SampleBatch) -> dict:
        """``{"reward_score": float, "reward_extra_info": dict}`` of the one sample in ``data``."""


class _Item:
    def __init__(self, batch: dict, non_tensor_batch: dict) -> None:
        self.batch = batch
        self.non_tensor_batch = non_tensor_batch


class SampleBatch:
    """One sample as the part of verl's ``DataProto`` a reward manager reads (module doc)."""

    def __init__(self, batch: dict, non_tensor_batch: dict, meta_info: dict | None = None) -> None:
        self.batch = batch
        self.non_tensor_batch = non_tensor_batch
        self.meta_info = meta_info or {}

    @classmethod
    def of(
        cls, prompt_ids, response_ids, data_source, ground_truth, extra_info, rollout=None
    ) -> SampleBatch:
        """One sample; ``rollout``: a multi-turn response's record, which goes where verl's
        agent loop puts it (``__num_turns__``, ``tool_extra_fields``), not into ``extra_info``."""
        import numpy as np
        import torch

        prompts = torch.tensor([list(prompt_ids)], dtype=torch.long).reshape(1, -1)
        responses = torch.tensor([list(response_ids)], dtype=torch.long).reshape(1, -1)
        input_ids = torch.cat([prompts, responses], dim=1)

        def column(value: Any) -> np.ndarray:
            out = np.empty(1, dtype=object)
            out[0] = value
            return out

        batch = {"prompts": prompts, "responses": responses, "input_ids": input_ids,
                 "attention_mask": torch.ones_like(input_ids)}  # fmt: skip
        non_tensor = {"data_source": column(data_source),
                      "reward_model": column({"ground_truth": ground_truth}),
                      "extra_info": column(dict(extra_info or {}))}  # fmt: skip
        if rollout is not None:
            non_tensor["__num_turns__"] = np.array([rollout.get("num_turns")], dtype=np.int32)
            non_tensor["tool_extra_fields"] = column(
                {k: list(rollout.get(k, [])) for k in ("turn_scores", "tool_rewards")}
            )
        return cls(batch, non_tensor)

    def __len__(self) -> int:
        return 1

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            return SampleBatch({k: v[key] for k, v in self.batch.items()},
                               {k: v[key] for k, v in self.non_tensor_batch.items()},
                               self.meta_info)  # fmt: skip
        return _Item({k: v[key] for k, v in self.batch.items()},
                     {k: v[key] for k, v in self.non_tensor_batch.items()})  # fmt: skip


class UserManager:
    """A scoring worker's instance of the user's class and the event loop it runs on."""

    def __init__(self, spec: Any, compute_score: Any) -> None:
        cls = manager_class(spec)
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        tokenizer = None
        if spec.tokenizer_path:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path)
        if spec.reward_kwargs:
            compute_score = functools.partial(compute_score, **spec.reward_kwargs)
        self.manager = cls(config=AttrDict(spec.config or {}), tokenizer=tokenizer,
                           compute_score=compute_score)  # fmt: skip

    def score(self, task: tuple) -> tuple[Any, dict]:
        """``(reward_score, reward_extra_info)`` of one worker task (its token ids included)."""
        _, data_source, _, ground_truth, extra_info, *ids = task
        prompt_ids, response_ids, rollout = ids if ids else ([], [], None)
        data = SampleBatch.of(prompt_ids, response_ids, data_source, ground_truth, extra_info,
                              rollout)  # fmt: skip
        out = self.loop.run_until_complete(self.manager.run_single(data))
        if not isinstance(out, dict) or "reward_score" not in out:
            raise TypeError(
                f"run_single returned {type(out).__name__}, not a dict with 'reward_score' "
                "(verl 0.9.1's {'reward_score': ..., 'reward_extra_info': {...}})"
            )
        return out["reward_score"], dict(out.get("reward_extra_info") or {})


def manager_class(spec: Any) -> type:
    """The user's class ``spec`` (a ``ScorerSpec`` with ``manager`` importlib) names; a missing
    file, a module that does not import, a missing name or a class without ``run_single`` is a
    ``RewardFunctionError`` naming the reward manager's key and file."""
    from megarl.reward.loader import RewardFunctionError, load_object

    cls = load_object(spec.manager_path, spec.manager_class, MODULE_KEY)
    if not callable(getattr(cls, "run_single", None)):
        raise RewardFunctionError(
            f"reward.reward_manager.name={spec.manager_class}: {spec.manager_class} in "
            f"{spec.manager_path} has no run_single (verl 0.9.1's reward manager contract: "
            "cls(config=, tokenizer=, compute_score=) and async run_single(data))"
        )
    return cls


def manager_problem(spec: Any) -> str | None:
    """The pre-flight's one line when :func:`manager_class` cannot load the class, else None."""
    from megarl.reward.loader import RewardFunctionError

    try:
        manager_class(spec)
    except RewardFunctionError as exc:  # names the key and file already
        return (str(exc).strip().splitlines() or [""])[0]
    except Exception as exc:  # noqa: BLE001 -- the user's module: syntax, import, anything
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"{MODULE_KEY}={spec.manager_path}: cannot load it ({type(exc).__name__}: {first})"
    return None
