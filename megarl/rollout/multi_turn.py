"""Multi-turn rollouts: model turns alternate with tool and interaction turns (verl 0.9.1's tool
agent loop, batched), kept as token ids from start to end.

Each trajectory starts from its prompt's chat messages rendered with the tools' schemas. Then,
per turn, every active trajectory generates together in **one** ``generate`` call (all of them
batched, one request each, each capped at its own budget and context room; a trajectory whose
context room is below another's cap goes in a call of its own cap: :func:`_cap_groups`); each
model turn's sampled ids and vLLM's log-probs are kept as they are. A turn whose text holds tool
calls (``multi_turn.format``) gets a tool turn (:func:`megarl.tools.runner.run_tool_calls`:
concurrent, time-limited, truncated, every failure an error message; every ``execute`` gets
``agent_data``, :class:`~megarl.rollout.multi_turn_agent.AgentData`); a turn without calls gets
an interaction turn when an interaction is configured, else the trajectory ends. It also ends
when the response budget (``data.max_response_length`` counted over all turns, as verl),
``max_assistant_turns`` or ``max_user_turns`` runs out, and (as verl) before a tool or user turn
that would fill the budget (or the engine's context), so that the last turn is the model's.
Tool and interaction turns run on one event loop (:class:`~megarl.tools.event_loop.ToolEventLoop`).

Token in, token out: a tool or user turn's ids are the chat template's delta, the ids of the
conversation rendered with the new messages (and the generation prompt) past the ids held so
far; model text is never re-tokenised. Where the rendering of the conversation so far does not
start with the ids held (a model turn whose text re-tokenises differently), the delta is the
difference of the two renderings; where the template rewrites history (Qwen3 drops earlier
turns' reasoning once a user turn follows), the new messages rendered alone less the template's
own system prompt (verl's way for every turn). Either way the trajectory counts in
``drifted_turns`` and fails the sanity check (``tokenization_sanity_check_mode``: the whole
conversation re-rendered against the ids held).

The result per trajectory (:class:`Trajectory`): response ids, log-probs (0 on tool and user
tokens), a per-token mask (1 on model tokens), turn counts, every call's outcome, step rewards
and interaction scores. :func:`~megarl.rollout.multi_turn_output.rollout_samples` turns them into
the trainer's :class:`~megarl.rollout.base.RolloutSample` list;
:mod:`megarl.rollout.multi_turn_rollout` runs the loop in the trainer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from megarl.rollout.base import RolloutBatch, request_seed
from megarl.rollout.multi_turn_agent import AgentData, agent_data, visible_messages
from megarl.rollout.multi_turn_output import (
    merge_multi_turn_metrics,
    multi_turn_metrics,
    rollout_samples,
)
from megarl.rollout.multi_turn_types import MultiTurnSettings, Trajectory, TrajectoryPrompt
from megarl.tools.event_loop import ToolEventLoop
from megarl.tools.parser import parse_tool_calls
from megarl.tools.runner import ToolCallError, run_tool_calls

__all__ = [
    "AgentData",
    "MultiTurnSettings",
    "Trajectory",
    "TrajectoryPrompt",
    "merge_multi_turn_metrics",
    "multi_turn_metrics",
    "rollout_samples",
    "run_multi_turn",
    "tool_schema",
]

logger = logging.getLogger(__name__)

GenerateFn = Callable[..., RolloutBatch]
"""``generate(prompts, *, prompt_ids, max_tokens, seed)`` → one response per prompt, in order
(:meth:`RolloutEngine.generate <megarl.rollout.base.RolloutEngine.generate>` with ``n=1``)."""


# -- rendering -------------------------------------------------------------------------------


class _Renderer:
    """The chat template as the loop uses it: render messages (with the tools' schemas) to ids."""

    def __init__(self, tokenizer: Any, tool_schemas: list[dict] | None, kwargs: dict[str, Any]):
        self.tokenizer = tokenizer
        self.tools = tool_schemas or None
        self.kwargs = {
            k: v
            for k, v in kwargs.items()
            if k not in ("tokenize", "return_dict", "return_tensors", "add_generation_prompt")
        }
        self._system: list[int] | None = None

    def text(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **self.kwargs,
        )

    def ids(self, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        text = self.text(messages, generation_prompt)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def alone(self, messages: list[dict[str, Any]]) -> list[int]:
        """verl's ids of a tool or user turn: ``messages`` rendered alone (no tools, with the
        generation prompt), less the system prompt the template adds by itself (verl's
        ``initialize_system_prompt``: what rendering one empty user turn adds beyond the
        second one's length)."""
        if self._system is None:
            one = [{"role": "user", "content": ""}]
            a, b = (self._plain(one * k, False) for k in (1, 2))
            self._system = a[: len(a) - (len(b) - len(a))]
        ids = self._plain(messages, True)
        return ids[len(self._system) :] if ids[: len(self._system)] == self._system else ids

    def _plain(self, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False, **self.kwargs
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _turn_delta(
    render: _Renderer, traj: Trajectory, new: list[dict[str, Any]], stops: set[int]
) -> tuple[list[int], bool]:
    """The ids of the messages ``new`` appended to ``traj`` (with the generation prompt), and
    whether they are the exact template delta past the ids held."""
    held = traj.cut_prompt_ids + traj.prompt_ids + traj.response_ids
    after = render.ids(traj.messages + new, True)
    if after[: len(held)] == held:
        return after[len(held) :], True
    before = render.ids(traj.messages, False)
    # Both fallbacks start the new turn at its own header; the template's text after the
    # model's end-of-turn token (ChatML's newline) comes first, as verl 0.9.1's Qwen builder
    # inserts it after <|im_end|> (continuous_token.py).
    joint = _after_end_of_turn(render, before, held, stops)
    if after[: len(before)] == before:
        return joint + after[len(before) :], False
    # A template that rewrites history (Qwen3 drops earlier turns' <think> once a user turn
    # follows): no delta of renderings exists, so verl's way, the new messages rendered alone.
    return joint + render.alone(new), False


def _after_end_of_turn(
    render: _Renderer, rendered: list[int], held: list[int], stops: set[int]
) -> list[int]:
    """What the template renders after the last model turn's end-of-turn token (``held``'s
    last id, a stop id) in ``rendered``, the conversation so far: ChatML's ``\\n`` after
    ``<|im_end|>``, nothing for Llama 3's ``<|eot_id|>``. Only whitespace counts (what follows
    the stop id's last place is other text when the template does not render that id, e.g. a
    turn ended by ``<|endoftext|>``); nothing when the turn did not end on a stop id."""
    if not held or held[-1] not in stops or held[-1] not in rendered:
        return []
    tail = rendered[len(rendered) - rendered[::-1].index(held[-1]) :]
    return tail if not render.decode(tail).strip() else []


def _sanity_check(render: _Renderer, traj: Trajectory, mode: str) -> bool | None:
    """verl's ``tokenization_sanity_check_mode``: the ids held must be the start of the whole
    conversation re-rendered (the template may close the last turn after them). ``strict``:
    exactly; ``ignore_strippable``: up to whitespace; ``disable``: not checked (None)."""
    if mode == "disable":
        return None
    full = render.ids(traj.messages, False)
    start = render.ids(traj.messages[: traj.prompt_messages], True)
    ok = full[: len(start)] == start and full[len(start) :][: len(traj.response_ids)] == (
        traj.response_ids
    )
    if not ok and mode == "ignore_strippable":
        held = re.sub(r"\s+", "", render.decode(traj.response_ids))
        again = re.sub(r"\s+", "", render.decode(full[len(start) :]))
        ok = again.startswith(held)
    if not ok:
        logger.warning(
            "multi-turn: trajectory of prompt %d sample %d: its token ids differ from the "
            "re-rendered conversation (tokenization_sanity_check_mode=%s)",
            traj.prompt_id, traj.sample_index, mode,
        )  # fmt: skip
    return ok


# -- the loop --------------------------------------------------------------------------------


def _model_message(render: _Renderer, ids: Sequence[int], stops: set[int]) -> dict[str, Any]:
    body = list(ids[:-1]) if ids and ids[-1] in stops else list(ids)
    return {
        "role": "assistant",
        "content": render.tokenizer.decode(body, skip_special_tokens=False),
    }


_Session = tuple[Any, str, dict]
"""An interaction's instance for one trajectory: (interaction, instance id, its kwargs)."""


def _start(
    prompts: Sequence[TrajectoryPrompt],
    n: int,
    render: _Renderer,
    interactions: Mapping,
    prompt_length: int | None,
) -> tuple[list[Trajectory], dict[int, _Session]]:
    out, sessions = [], {}
    for p, prompt in enumerate(prompts):
        ids = prompt.prompt_ids
        if ids is None:
            ids = render.ids(prompt.messages, True)
        cut = max(0, len(ids) - prompt_length) if prompt_length else 0
        if cut:  # as verl 0.9.1's agent loop (_cap_text_prompt_length): from the left
            logger.warning(
                "multi-turn: prompt %d is %d tokens rendered with the tools' schemas, over "
                "rollout.prompt_length=%d: its first %d are cut (as verl)",
                prompt.prompt_id, len(ids), prompt_length, cut,
            )  # fmt: skip
        for s in range(n):
            traj = Trajectory(
                p, s, prompt.prompt_id, list(ids[cut:]), messages=list(prompt.messages)
            )
            traj.cut_prompt_ids = list(ids[:cut])
            traj.prompt_messages = len(prompt.messages)
            if interactions and prompt.interaction_kwargs is not None:
                kwargs = dict(prompt.interaction_kwargs)
                name = kwargs.get("name", "gsm8k")
                if name not in interactions:
                    raise ValueError(
                        f"prompt {prompt.prompt_id}: interaction_kwargs.name={name!r} is not in "
                        f"interaction_config_path (has {sorted(interactions)})"
                    )
                sessions[len(out)] = (interactions[name], "", kwargs)
            out.append(traj)
    return out, sessions


async def _start_interactions(sessions: dict[int, _Session]) -> None:
    async def one(i: int) -> None:
        interaction, _, kwargs = sessions[i]
        sessions[i] = (interaction, await interaction.start_interaction(None, **kwargs), kwargs)

    await asyncio.gather(*(one(i) for i in list(sessions)))


async def _finish_interactions(sessions: dict[int, _Session]) -> None:
    await asyncio.gather(*(s[0].finalize_interaction(s[1]) for s in sessions.values()))


def _model_turn(
    generate: GenerateFn,
    active: list[Trajectory],
    settings: MultiTurnSettings,
    *,
    seed: int,
    step: int,
    turn: int,
    stops: set[int],
) -> None:
    """Every active trajectory's turn, each capped at its own ``min(budget left, context
    room)``: one batched generate, or one per group of :func:`_cap_groups` where one
    trajectory's context room is below another's cap."""
    contexts = [t.prompt_ids + t.response_ids for t in active]
    budgets = [settings.response_length - len(t.response_ids) for t in active]
    limit = settings.max_model_len
    rooms = [None if limit is None else limit - len(c) for c in contexts]
    caps = [b if r is None else min(b, r) for b, r in zip(budgets, rooms, strict=True)]
    samples: list[Any] = [None] * len(active)
    for max_tokens, members in _cap_groups(caps, rooms):
        batch = generate(
            [contexts[i] for i in members],
            prompt_ids=[active[i].prompt_index * 1_000_003 + active[i].sample_index
                        for i in members],
            max_tokens=max(max_tokens, 1),
            seed=request_seed(seed, step, turn, -1),
        )  # fmt: skip
        for i, sample in zip(members, batch.samples, strict=True):
            samples[i] = sample
    for t, sample, cap in zip(active, samples, caps, strict=True):
        ids = list(sample.response_token_ids)[:cap]
        logprobs = list(sample.response_logprobs)[: len(ids)]
        cut = len(ids) < len(sample.response_token_ids) or sample.finish_reason == "length"
        t.finish_reason = "length" if cut and not (ids and ids[-1] in stops) else "stop"
        if sample.routing is not None:
            t.routing = _compose_routing(
                t.routing, sample.routing, len(t.prompt_ids) + len(t.response_ids) + len(ids)
            )
        t.response_ids += ids
        t.response_logprobs += logprobs
        t.response_mask += [1] * len(ids)
        t.last_turn_len = len(ids)
        t.assistant_turns += 1


def _cap_groups(caps: list[int], rooms: list[int | None]) -> list[tuple[int, list[int]]]:
    """The fewest ``(max_tokens, request indices)`` groups such that each request's
    ``max_tokens`` is at least its cap and at most its context room (``None``: unbounded): the
    engine takes one ``max_tokens`` per call and refuses one past a request's room, and each
    trajectory keeps its first ``cap`` tokens (a request's tokens do not depend on its
    ``max_tokens``: each is seeded on its own). Greedy stabbing of the intervals
    ``[cap, room]`` in the order of their rooms; one group unless some room is short."""
    order = sorted(range(len(caps)), key=lambda i: (rooms[i] is None, rooms[i] or 0))
    groups: list[list[int]] = []
    point: int | None = None
    for i in order:
        if not groups or (point is not None and caps[i] > point):
            groups.append([])
            point = rooms[i]
        groups[-1].append(i)
    return [(max(caps[i] for i in g), sorted(g)) for g in groups]


def _compose_routing(held: Any, new: Any, length: int) -> Any:
    """The trajectory's routing after a model turn: ``held`` (the earlier requests') kept for the
    positions they ran, i.e. all but their last, which was sampled and never run; ``new`` (this
    request's: its context prefilled, its tokens decoded) for the rest, up to ``length``."""
    import numpy as np

    new = np.asarray(new)[:length]
    if held is None:
        return new
    ran = len(held) - 1
    return np.concatenate([held[:ran], new[ran:]])


def _append(traj: Trajectory, ids: list[int], messages: list[dict[str, Any]]) -> None:
    traj.response_ids += ids
    traj.response_logprobs += [0.0] * len(ids)
    traj.response_mask += [0] * len(ids)
    traj.messages += messages
    traj.user_turns += 1


async def _env_turn(
    traj: Trajectory,
    prompt: TrajectoryPrompt,
    render: _Renderer,
    tools: Mapping[str, Any],
    settings: MultiTurnSettings,
    stops: set[int],
    session: _Session | None,
    agents: dict[tuple[int, int], AgentData],
) -> None:
    """After a model turn: stop, or run its calls / the interaction and append that turn."""
    s = settings
    turn_ids = traj.response_ids[len(traj.response_ids) - traj.last_turn_len :]
    last = _model_message(render, turn_ids, stops)
    traj.assistant_texts.append(render.tokenizer.decode(turn_ids, skip_special_tokens=True))
    over = (
        len(traj.response_ids) >= s.response_length
        or (s.max_assistant_turns and traj.assistant_turns >= s.max_assistant_turns)
        or (s.max_user_turns and traj.user_turns >= s.max_user_turns)
    )
    traj.messages.append(last)
    if over:
        traj.done = True
        return
    calls = parse_tool_calls(last["content"], s.format).calls if tools else []
    if calls:
        results = await run_tool_calls(
            calls,
            tools,
            tools_kwargs=prompt.tools_kwargs,
            timeout_s=s.tool_call_timeout_s,
            max_parallel_calls=s.max_parallel_calls,
            max_tool_response_length=s.max_tool_response_length,
            tool_response_truncate_side=s.tool_response_truncate_side,
            execute_kwargs={"agent_data": agent_data(agents, traj, prompt, session, calls)},
        )
        traj.tool_results += results
        # As verl's tool agent loop: every executed call's step reward, 0.0 for one that failed
        # (raised, timed out, unknown tool); a call that could not be read is no call in verl.
        traj.tool_rewards += [
            r.reward
            for r in results
            if r.reward is not None and r.error is not ToolCallError.MALFORMED
        ]
        new = [{"role": "tool", "content": r.text} for r in results]
    elif session is not None:
        interaction, instance, kwargs = session
        terminate, text, score, _ = await interaction.generate_response(
            instance, visible_messages(traj), **kwargs
        )
        if score is not None:  # as verl: only scores given
            traj.turn_scores.append(float(score))
        if terminate:  # megarl: no trailing user turn that no model turn answers
            traj.done = True
            return
        new = [{"role": "user", "content": text}]
    else:
        traj.done = True
        return
    ids, exact = _turn_delta(render, traj, new, stops)
    held = len(traj.prompt_ids) + len(traj.response_ids) + len(ids)
    if len(traj.response_ids) + len(ids) >= s.response_length or (
        s.max_model_len is not None and held >= s.max_model_len
    ):
        traj.done = True  # as verl: the last turn stays the model's (and it has room)
        return
    traj.drifted_turns += not exact
    _append(traj, ids, new)


def run_multi_turn(
    generate: GenerateFn,
    prompts: Sequence[TrajectoryPrompt],
    *,
    n: int,
    tokenizer: Any,
    tools: Mapping[str, Any],
    interactions: Mapping[str, Any] | None = None,
    settings: MultiTurnSettings,
    seed: int,
    step: int,
    stop_token_ids: Sequence[int],
    run_env: Callable[[Callable[[], Any]], Any] | None = None,
    env_loop: ToolEventLoop | None = None,
    abort: Callable[[], str | None] | None = None,
) -> list[Trajectory]:
    """``n`` multi-turn trajectories per prompt, prompt-major.

    ``generate``: see :data:`GenerateFn` (every rank of a distributed run calls it together);
    ``tools``: name → tool (:func:`megarl.tools.registry.load_all_tools`); ``interactions``:
    name → interaction; ``stop_token_ids``: the ids that end a model turn (the engine's EOS
    ids); ``run_env``: runs the tool/interaction turns (a callable taking a function of no
    arguments and returning its result; the trainer runs them on rank 0 and broadcasts the
    trajectories, so every rank holds the same ones); ``env_loop``: the event loop those
    turns run on (:class:`~megarl.tools.event_loop.ToolEventLoop`; keep one for the whole run,
    as :class:`~megarl.rollout.multi_turn_rollout.MultiTurnRollout` does, so that tools holding
    asyncio state work across steps; None: one for this call, closed at its end). Seeds: turn
    ``t`` of trajectory ``(p, s)`` is sampled with a seed drawn from ``(seed, step, t)`` and
    ``(p, s)``, however the turn's requests are grouped into ``generate`` calls. ``abort``:
    asked twice a second while a tool/interaction turn runs; a line from it ends the turn with
    :class:`~megarl.tools.event_loop.TurnAborted` (the trainer's: another rank of the node has
    died, so the step cannot finish).
    """
    own_loop = env_loop is None
    env = env_loop or ToolEventLoop()
    try:
        return _run(generate, prompts, n, tokenizer, tools, interactions, settings, seed, step,
                    stop_token_ids, run_env, functools.partial(env.run, abort=abort))  # fmt: skip
    finally:
        if own_loop:
            env.close()


def _run(generate, prompts, n, tokenizer, tools, interactions, settings, seed, step,
         stop_token_ids, run_env, env_run: Callable[[Any], Any]) -> list[Trajectory]:  # fmt: skip
    schemas = [tool_schema(t) for t in tools.values()] if tools else None
    render = _Renderer(tokenizer, schemas, settings.chat_template_kwargs)
    stops = set(stop_token_ids)
    interactions = interactions or {}
    trajs, sessions = _start(prompts, n, render, interactions, settings.prompt_length)
    run_env = run_env or (lambda fn: fn())
    if sessions:
        run_env(lambda: env_run(_start_interactions(sessions)))
    agents: dict[tuple[int, int], AgentData] = {}  # on the rank that runs the tools
    turn = 0
    while True:
        for t in trajs:
            t.done = t.done or len(t.response_ids) >= settings.response_length
        active = [i for i, t in enumerate(trajs) if not t.done]
        if not active:
            break
        _model_turn(
            generate, [trajs[i] for i in active], settings,
            seed=seed, step=step, turn=turn, stops=stops,
        )  # fmt: skip
        turn += 1

        def env_turn(active=active) -> list[Trajectory]:
            async def all_turns() -> None:
                await asyncio.gather(
                    *(
                        _env_turn(
                            trajs[i],
                            prompts[trajs[i].prompt_index],
                            render,
                            tools,
                            settings,
                            stops,
                            sessions.get(i),
                            agents,
                        )
                        for i in active
                    )
                )

            env_run(all_turns())
            return trajs

        trajs[:] = run_env(env_turn)

    def finish() -> list[Trajectory]:
        env_run(_finish_interactions(sessions))
        for t in trajs:
            t.tokenization_ok = _sanity_check(render, t, settings.tokenization_sanity_check_mode)
        return trajs

    trajs[:] = run_env(finish)
    return trajs


def renders_turn(
    tokenizer: Any, tools: Sequence[Any], role: str, kwargs: dict[str, Any]
) -> str | None:
    """Whether the chat template renders a ``role`` turn (``tool`` or ``user``) after a model
    turn, with the tools' schemas, as the loop renders one: None, or what it raised as one line
    (the pre-flight's check: :func:`~megarl.rollout.multi_turn_rollout.multi_turn_problem`)."""
    render = _Renderer(tokenizer, [tool_schema(t) for t in tools] or None, kwargs)
    conversation = [{"role": "user", "content": "6 * 7?"}, {"role": "assistant", "content": "…"},
                    {"role": role, "content": "42"}]  # fmt: skip
    try:
        render.ids(conversation, True)
    except Exception as exc:  # noqa: BLE001 - a template raises what its author chose
        text = " ".join(str(exc).split()) or "no message"
        return f"{type(exc).__name__}: {text}"
    return None


def tool_schema(tool: Any) -> dict:
    """A tool's OpenAI schema as the chat template gets it (verl's ``model_dump``)."""
    schema = getattr(tool, "tool_schema", None)
    return schema.model_dump(exclude_unset=True, exclude_none=True) if schema else {}
