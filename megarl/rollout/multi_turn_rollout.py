"""The trainer's side of multi-turn rollouts: :class:`MultiTurnRollout`, built once per run from
the config (tools, interactions, limits), runs :func:`megarl.rollout.multi_turn.run_multi_turn`
with the model turns on every rollout replica and the tool/interaction turns on rank 0 (the
trajectories broadcast, so every rank holds the same ones).

With vLLM on ranks of its own (:class:`~megarl.rollout.remote.engine.RemoteEngine`, whose
``runs_multi_turn`` is True) the rollout ranks run the whole loop, tools included: the trainer
sends the step's :class:`~megarl.rollout.multi_turn.TrajectoryPrompt` list (raw messages and
``extra_info``'s arguments) with ``multi_turn=True`` in the request (:meth:`remote_request`),
the rollout ranks run :meth:`serve` (their default group is the rollout ranks' own world, so
``on_rank0`` is the first rollout rank) and the trajectories come back, asked ahead or not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megarl.rollout.multi_turn import (
    MultiTurnSettings,
    Trajectory,
    TrajectoryPrompt,
    multi_turn_metrics,
    run_multi_turn,
)
from megarl.tools.event_loop import ToolEventLoop

__all__ = [
    "MultiTurnRollout",
    "local_rank_lost",
    "multi_turn_problem",
    "on_rank0",
    "prompt_tool_schemas",
]


def on_rank0(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 only and give every rank its result (tools run once per step, and
    every rank holds the same trajectories); ``fn`` alone when not distributed."""
    import torch.distributed as dist

    from megarl.rollout.distribute import object_group

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    box = [fn() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=object_group())
    return box[0]


def local_rank_lost() -> str | None:
    """Under torchrun, whether a rank of this node has ended (torchrun's workers, this rank and
    its siblings, fewer alive than ``LOCAL_WORLD_SIZE``): a line saying so, else None (also when
    torchrun did not start this process). Asked while rank 0 runs a tool turn, which no
    collective interrupts: a slow tool kept rank 0 there past torchrun's SIGTERM (a stop request
    for the step's end) until its SIGKILL 30 s later."""
    import os

    import psutil

    expected = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not os.environ.get("TORCHELASTIC_RUN_ID") or expected < 2:
        return None
    try:
        workers = psutil.Process(os.getppid()).children()
    except psutil.Error:
        return None
    alive = 0
    for worker in workers:
        with contextlib.suppress(psutil.Error):
            alive += worker.status() != psutil.STATUS_ZOMBIE
    if alive >= expected:
        return None
    return (
        f"multi-turn: {expected - alive} of this node's {expected} ranks ended during a tool "
        "turn; the step cannot finish"
    )


def _messages(raw_prompt: Any) -> list[dict[str, Any]]:
    if isinstance(raw_prompt, str):
        return [{"role": "user", "content": raw_prompt}]
    return [{k: v for k, v in dict(m).items() if v is not None} for m in raw_prompt]


@dataclass
class MultiTurnRollout:
    """What the trainer's generation pass needs for multi-turn rollouts (built once per run by
    :meth:`from_config`; :func:`megarl.trainer.passes.generate` calls :meth:`generate`)."""

    tokenizer: Any
    tools: dict[str, Any]
    interactions: dict[str, Any]
    settings: MultiTurnSettings
    stop_token_ids: list[int]
    last_metrics: dict[str, float] = field(default_factory=dict)
    """The last :meth:`generate`'s :func:`multi_turn_metrics`."""
    env_loop: ToolEventLoop = field(default_factory=ToolEventLoop)
    """The one event loop of every step's tool and interaction turns (verl keeps one per
    agent-loop worker): tools holding asyncio locks or sessions work across steps."""

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any, stop_token_ids: Sequence[int]):
        """From the whole config: ``actor_rollout_ref.rollout.multi_turn`` (tools, interactions,
        limits), ``data.max_response_length``, the engine's context limit."""
        from megarl.tools.interactions.registry import load_interactions
        from megarl.tools.registry import load_all_tools

        rollout = cfg.actor_rollout_ref.rollout
        mt = rollout.multi_turn
        response = rollout.response_length or cfg.data.max_response_length
        prompt = rollout.prompt_length or cfg.data.max_prompt_length
        settings = MultiTurnSettings.from_config(
            mt,
            response_length=response,
            max_model_len=rollout.max_model_len or prompt + response,
            prompt_length=prompt,
            chat_template_kwargs=dict(getattr(cfg.data, "apply_chat_template_kwargs", {}) or {}),
        )
        return cls(
            tokenizer,
            load_all_tools(mt.tool_config_path, mt.function_tool_path),
            load_interactions(mt.interaction_config_path) if mt.interaction_config_path else {},
            settings,
            list(stop_token_ids),
        )

    def generate(
        self,
        engine: Any,
        prompts: Sequence[Any],
        *,
        n: int,
        sampling: dict[str, Any],
        seed: int,
        step: int,
    ) -> list[Trajectory]:
        """``n`` trajectories per prompt (``PromptSample``s: ``raw_prompt``, ``extra_info``),
        the model turns on every rollout replica (every rank calls this together)."""
        requests = self.requests(prompts)
        if getattr(engine, "runs_multi_turn", False):  # the rollout ranks run the loop
            payload, kwargs = self.remote_request(requests, n=n, sampling=sampling, seed=seed,
                                                  step=step)  # fmt: skip
            trajs = engine.generate(payload, **kwargs)
            self.last_metrics = multi_turn_metrics(trajs)
            return trajs
        return self.run(engine, requests, n=n, sampling=sampling, seed=seed, step=step)

    @staticmethod
    def requests(prompts: Sequence[Any]) -> list[TrajectoryPrompt]:
        """The loop's prompts of the step's ``PromptSample``s (raw messages, ``extra_info``)."""
        return [
            TrajectoryPrompt(
                _messages(p.raw_prompt),
                i,
                tools_kwargs=dict((p.extra_info or {}).get("tools_kwargs") or {}),
                interaction_kwargs=(p.extra_info or {}).get("interaction_kwargs"),
            )
            for i, p in enumerate(prompts)
        ]

    def remote_request(
        self,
        requests: list[TrajectoryPrompt],
        *,
        n: int,
        sampling: dict[str, Any],
        seed: int,
        step: int,
    ) -> tuple[list[TrajectoryPrompt], dict[str, Any]]:
        """``(prompts, kwargs)`` of the request the rollout ranks answer with :meth:`serve`
        (``RemoteEngine.generate`` and ``prefetch`` take it as a token request's). It carries
        this loop's settings and stop ids (``loop``), so the rollout ranks run the loop the
        trainer holds (a ``multi_turn`` passed to ``passes.generate`` included); the tools and
        interactions are the rollout ranks' own, built from the same config."""
        loop = (self.settings, list(self.stop_token_ids))
        kwargs = {"multi_turn": True, "loop": loop, "n": n, "seed": seed, "step": step}
        return requests, {**kwargs, **sampling}

    def prefetch(self, engine: Any, prompts: Sequence[Any], asked: Sequence[tuple], *,
                 seed: int, step: int) -> None:  # fmt: skip
        """Ask the rollout ranks ahead for the trajectories later :meth:`generate` calls with
        these arguments take, one request per ``(n, sampling, reward)`` of ``asked``."""
        requests = self.requests(prompts)
        engine.prefetch([
            (*self.remote_request(requests, n=n, sampling=sampling, seed=seed, step=step), reward)
            for n, sampling, reward in asked
        ])  # fmt: skip

    def serve(self, engine: Any, requests: list[TrajectoryPrompt], kwargs: dict[str, Any]):
        """The rollout ranks' side of a :meth:`remote_request` (every rollout rank calls it)."""
        import dataclasses

        kwargs = {k: v for k, v in kwargs.items() if k != "multi_turn"}
        n, seed, step = kwargs.pop("n"), kwargs.pop("seed"), kwargs.pop("step")
        settings, stops = kwargs.pop("loop", (self.settings, self.stop_token_ids))
        loop = dataclasses.replace(self, settings=settings, stop_token_ids=list(stops))
        return loop.run(engine, requests, n=n, sampling=kwargs, seed=seed, step=step)

    def run(
        self,
        engine: Any,
        requests: list[TrajectoryPrompt],
        *,
        n: int,
        sampling: dict[str, Any],
        seed: int,
        step: int,
    ) -> list[Trajectory]:
        """The loop on this process's ranks: the model turns on every replica of the default
        group's ranks, the tool/interaction turns on its rank 0."""
        import torch.distributed as dist

        from megarl.rollout.distribute import generate_on_replicas

        sampling = {k: v for k, v in sampling.items() if k != "max_tokens"}

        def turn(contexts, *, prompt_ids, max_tokens, seed):
            kw = dict(n=1, max_tokens=max_tokens, seed=seed, step=step, **sampling)
            if dist.is_initialized():
                return generate_on_replicas(engine, contexts, prompt_ids=prompt_ids, **kw)
            return engine.generate(contexts, prompt_ids=prompt_ids, **kw)

        trajs = run_multi_turn(
            turn,
            requests,
            n=n,
            tokenizer=self.tokenizer,
            tools=self.tools,
            interactions=self.interactions,
            settings=self.settings,
            seed=seed,
            step=step,
            stop_token_ids=self.stop_token_ids,
            run_env=on_rank0,
            env_loop=self.env_loop,
            abort=local_rank_lost,
        )
        self.last_metrics = multi_turn_metrics(trajs)
        return trajs


def prompt_tool_schemas(cfg: Any) -> list[dict] | None:
    """The tools' schemas ``data.filter_overlong_prompts`` counts a prompt with, as verl's
    ``RLHFDataset``: those of ``data.tool_config_path`` and ``data.function_tool_path``, each
    by default the rollout's ``multi_turn`` one (verl's ``oc.select`` default); None when the
    filter is off or no tools are set (the tools are built here, as verl's dataset builds them)."""
    from megarl.rollout.multi_turn import tool_schema
    from megarl.tools.registry import load_all_tools

    data, mt = cfg.data, cfg.actor_rollout_ref.rollout.multi_turn
    paths = (data.tool_config_path or mt.tool_config_path,
             data.function_tool_path or mt.function_tool_path)  # fmt: skip
    if not data.filter_overlong_prompts or not any(paths):
        return None
    return [tool_schema(t) for t in load_all_tools(*paths).values()] or None


def multi_turn_problem(cfg: Any, tokenizer: Any, tokenizer_key: str) -> str | None:
    """The pre-flight's check of a multi-turn run (``megarl train``, before any rank works): the
    tools and the interactions load (a bad file, entry or class is its
    :class:`~megarl.tools.errors.ToolConfigError` line), and the chat template renders the
    turns the loop appends after a model turn with the tools' schemas, as the loop renders them
    (a tool turn with tools, a user turn with interactions). The problem as one line (naming
    ``tokenizer_key`` for the template), or None; nothing is checked unless
    ``multi_turn.enable``."""
    from megarl.rollout.multi_turn import renders_turn
    from megarl.tools.errors import ToolConfigError
    from megarl.tools.interactions.registry import load_interactions
    from megarl.tools.registry import load_all_tools

    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        return None
    try:
        tools = load_all_tools(mt.tool_config_path, mt.function_tool_path)
        interactions = (
            load_interactions(mt.interaction_config_path) if mt.interaction_config_path else {}
        )
    except ToolConfigError as exc:
        return " ".join(str(exc).split())
    kwargs = dict(getattr(cfg.data, "apply_chat_template_kwargs", {}) or {})
    for role, needed in (("tool", tools), ("user", interactions)):
        if needed and (problem := renders_turn(tokenizer, list(tools.values()), role, kwargs)):
            return (
                f"{tokenizer_key}: its chat template cannot render a {role!r} turn after a model "
                f"turn, which the multi-turn loop appends (actor_rollout_ref.rollout.multi_turn"
                f".{'tool_config_path' if role == 'tool' else 'interaction_config_path'}): "
                f"{problem}"
            )
    return None
