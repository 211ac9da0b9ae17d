"""verl 0.9's top-level ``reward`` section and the async recipes' top-level ``rollout`` section.

Both are spellings of settings megarl keeps elsewhere: :mod:`megarl.config.spellings` copies
each given key onto the older key megarl reads (``reward.custom_reward_function.path`` onto
``custom_reward_function.path``, ``rollout.nnodes`` onto ``actor_rollout_ref.rollout.nnodes``,
...) and refuses a setting given both ways with different values. Fields are unset (None) by
default, so that "given" is known.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal

REWARD_MANAGERS = ("naive", "dapo", "gdpo", "prime")
"""Reward managers megarl computes (verl's registered names)."""

DAPO_REWARD_KWARGS: dict[str, Any] = {
    "overlong_buffer_cfg": {"enable": False, "len": 0, "penalty_factor": 0.0, "log": False},
    "max_resp_len": None,
}
"""verl-recipe's DAPO config's ``reward.reward_kwargs`` (the overlong buffer, off)."""


@dataclass
class RewardFunctionSection:
    """``reward.custom_reward_function.*``: verl 0.9's place of ``custom_reward_function.*``."""

    path: str | None = None
    """As custom_reward_function.path (a .py file or a module); null: not given here."""
    name: str | None = None
    """As custom_reward_function.name; null: not given here."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Free-form: as custom_reward_function.reward_kwargs (passed to every call)."""


@dataclass
class ModuleSection:
    """``reward.reward_manager.module.*``: the file or module holding a user's manager class."""

    path: str | None = None
    """A .py file or a module (as custom_reward_function.path) with source=importlib."""
    name: str | None = None
    """The class's name there when reward_manager.name is not given (verl's older spelling)."""


@dataclass
class RewardManagerSection:
    """``reward.reward_manager.*``: how a response's score is computed from the scorer's."""

    source: Literal["register", "importlib"] | None = None
    """register: one of megarl's managers by name; importlib: a class from module.path."""
    name: str | None = None
    """register: naive, dapo (overlong buffer), gdpo (= naive) or prime; importlib: the class."""
    module: ModuleSection = field(default_factory=ModuleSection)
    """Where a user's manager class lives (source=importlib)."""


@dataclass
class RewardModelSection:
    """``reward.reward_model.*``: verl 0.9's place of ``reward_model.enable`` / ``model.path``."""

    enable: bool | None = None
    """As reward_model.enable; null: not given here."""
    model_path: str | None = None
    """As reward_model.model.path; null: not given here."""
    enable_resource_pool: bool = False
    """Only false: the reward model runs on Megatron at the actor's layout, on the same ranks."""
    n_gpus_per_node: int | None = None
    """No effect, any value (verl: the reward model's own pool, with enable_resource_pool)."""
    nnodes: int = 0
    """Only 0: the reward model has no nodes of its own."""


@dataclass
class SandboxFusionConfig:
    """``reward.sandbox_fusion.*`` (also the older top-level ``sandbox_fusion.*``): code sandbox."""

    url: str | None = None
    """A Sandbox Fusion run_code URL: the code scorers run programs there; null: locally."""
    max_concurrent: int = 64
    """Calls to the service at once on each machine (verl: in the whole job)."""
    memory_limit_mb: int = 1024
    """Memory limit of each program on the service, in MB (with url only, as in verl)."""


@dataclass
class RewardConfig:
    """``reward.*`` (verl 0.9): the reward function, the reward manager, the reward model."""

    num_workers: int | None = None
    """As reward_model.num_workers (scoring processes per rank); null: not given here."""
    custom_reward_function: RewardFunctionSection = field(default_factory=RewardFunctionSection)
    """A user reward function."""
    reward_manager: RewardManagerSection = field(default_factory=RewardManagerSection)
    """naive, dapo, gdpo, prime, or a user's class."""
    reward_kwargs: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(DAPO_REWARD_KWARGS))
    """Free-form: the manager's settings; dapo: overlong_buffer_cfg.*, max_resp_len."""
    reward_model: RewardModelSection = field(default_factory=RewardModelSection)
    """The learned reward model."""
    code_sandbox: bool = True
    """Model-written code (code scorers, PythonTool) runs in bubblewrap; false: rlimits only."""
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)
    """The code scorers' Sandbox Fusion service (url null: programs run locally in bubblewrap)."""


@dataclass
class RolloutResourcesConfig:
    """``rollout.*`` (verl's one-step-off and fully-async recipes): the rollout's own ranks."""

    nnodes: int | None = None
    """As actor_rollout_ref.rollout.nnodes (> 0: vLLM on ranks of its own); null: not given."""
    n_gpus_per_node: int | None = None
    """As actor_rollout_ref.rollout.n_gpus_per_node; null: not given here."""
    total_rollout_steps: int | None = None
    """Prompts to generate in all (fully async); sets trainer.total_training_steps when unset."""
