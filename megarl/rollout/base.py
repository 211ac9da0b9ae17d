"""The narrow interface between the trainer and a rollout engine, and what a rollout returns.

The trainer only ever talks to rollout through :class:`RolloutEngine`: ``generate``, one
weight-update session (``begin_weight_update`` / ``load_weight_chunk`` / ``finish_weight_update``,
which the resharding executor drives; :func:`update_weights` wraps one session), ``sleep`` and
``wake_up``, and the attributes ``tensor_parallel_size``, ``dp_rank``, ``dp_size``,
``eos_token_ids``. Implementations: :class:`~megarl.rollout.vllm_engine.VLLMEngine` and
:class:`~megarl.rollout.actor_engine.ActorEngine`; an engine on ranks of its own also implements
:class:`AheadEngine` (:mod:`megarl.rollout.remote`). Only the ``megarl.rollout.vllm_*`` modules
import vLLM.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = [
    "AheadEngine",
    "CallOrder",
    "FinishReason",
    "RolloutBatch",
    "RolloutEngine",
    "RolloutSample",
    "WeightSink",
    "request_seed",
    "update_weights",
]

FinishReason = Literal["stop", "length"]


@dataclass
class RolloutSample:
    """One response to one prompt."""

    prompt_index: int
    """Position of the prompt in the prompt list the caller passed."""
    sample_index: int
    """Which of the ``n`` responses to that prompt (0..n-1)."""
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    """Generated tokens; ends with the stop/EOS token when ``finish_reason == "stop"``."""
    response_logprobs: list[float]
    """Log-prob of each generated token under the sampling distribution, i.e.
    ``log_softmax(logits / temperature)`` (after top-k/top-p masking when those are on)."""
    finish_reason: FinishReason
    """``"stop"``: ended on an EOS/stop token (included in the response); ``"length"``: hit
    ``max_tokens`` (no EOS)."""
    prompt_id: int = field(kw_only=True)
    """Global id of the prompt (its position in the step's global batch), the id its seed was
    drawn from; GRPO groups the ``n`` responses of one prompt by it."""
    routing: Any = field(default=None, kw_only=True)
    """With routing capture on, the MoE experts each position of prompt + response was routed
    to: int16 ``[positions, layers, k]``, -1 for dense layers and the last generated token
    (:mod:`megarl.rollout.routing_capture`); otherwise None."""
    response_mask: list[int] | None = field(default=None, kw_only=True)
    """Multi-turn responses: 1 on the model's tokens, 0 on tool and user turns' tokens (their
    log-probs are 0); None: every response token is the model's."""
    extra: dict[str, Any] | None = field(default=None, kw_only=True)
    """Multi-turn responses: ``num_turns``, ``tool_rewards``, ``turn_scores``
    (:func:`megarl.rollout.multi_turn.rollout_samples`); None otherwise."""
    token_versions: list[int] | None = field(default=None, kw_only=True)
    """Partial rollouts (:mod:`megarl.rollout.partial`): the weight version that sampled each
    response token (its log-prob is that version's); None: one version, the batch's."""

    def __post_init__(self) -> None:
        if len(self.response_logprobs) != len(self.response_token_ids):
            raise ValueError(
                f"{len(self.response_logprobs)} log-probs for "
                f"{len(self.response_token_ids)} response tokens"
            )
        if self.token_versions is not None and len(self.token_versions) != len(
            self.response_token_ids
        ):
            raise ValueError(
                f"{len(self.token_versions)} token versions for "
                f"{len(self.response_token_ids)} response tokens"
            )
        if self.response_mask is not None and len(self.response_mask) != len(
            self.response_token_ids
        ):
            raise ValueError(
                f"a response mask of {len(self.response_mask)} for "
                f"{len(self.response_token_ids)} response tokens"
            )


@dataclass
class RolloutBatch:
    """Responses ordered prompt-major: prompt 0 samples 0..n-1, prompt 1 samples 0..n-1, ..."""

    samples: list[RolloutSample] = field(default_factory=list)
    n: int = 1
    """Responses per prompt."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What the rollout measured (multi-turn: turns, tool calls, errors, tool seconds)."""

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[RolloutSample]:
        return iter(self.samples)

    def __getitem__(self, i: int) -> RolloutSample:
        return self.samples[i]

    @property
    def num_prompts(self) -> int:
        return len(self.samples) // self.n if self.n else 0

    @property
    def prompt_ids(self) -> Tensor:
        """``[B]`` long: the global prompt id of every sample."""
        return torch.tensor([s.prompt_id for s in self.samples], dtype=torch.long)

    def check_order(self) -> None:
        """Raise unless samples are prompt-major with prompt indices 0..num_prompts-1 and the
        ``n`` samples of a prompt share its ``prompt_id``."""
        for i, s in enumerate(self.samples):
            want = (i // self.n, i % self.n)
            if (s.prompt_index, s.sample_index) != want:
                raise ValueError(
                    f"sample {i} is (prompt {s.prompt_index}, sample {s.sample_index}), "
                    f"expected {want}"
                )
            first = self.samples[i - i % self.n]
            if s.prompt_id != first.prompt_id:
                raise ValueError(
                    f"sample {i} has prompt_id {s.prompt_id}, its prompt's first sample "
                    f"{first.prompt_id}"
                )

    def padded_responses(self, pad_token_id: int) -> tuple[Tensor, Tensor, Tensor]:
        """Right-padded responses: ``token_ids [B, T]`` (long), ``logprobs [B, T]`` (float32),
        ``mask [B, T]`` (bool, True on real tokens that are the model's: a multi-turn sample's tool
        and user tokens are False); ``T`` = longest response (at least 1)."""
        b = len(self.samples)
        t = max([len(s.response_token_ids) for s in self.samples] + [1])
        ids = torch.full((b, t), pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((b, t), dtype=torch.float32)
        mask = torch.zeros((b, t), dtype=torch.bool)
        for i, s in enumerate(self.samples):
            k = len(s.response_token_ids)
            ids[i, :k] = torch.tensor(s.response_token_ids, dtype=torch.long)
            logprobs[i, :k] = torch.tensor(s.response_logprobs, dtype=torch.float32)
            mask[i, :k] = (
                True if s.response_mask is None else torch.tensor(s.response_mask, dtype=torch.bool)
            )
        return ids, logprobs, mask


def request_seed(seed: int, step: int, prompt_id: int, sample_index: int) -> int:
    """Sampling seed of one response: a hash of (run seed, step, global prompt id, sample index).

    Deterministic across processes (not Python's salted ``hash``), so every rank of a rollout TP
    group draws the same tokens, and independent of how prompts are spread over rollout DP ranks.
    """
    digest = hashlib.blake2b(
        f"{seed}:{step}:{prompt_id}:{sample_index}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


@runtime_checkable
class WeightSink(Protocol):
    """The weight-update half of :class:`RolloutEngine`: what the resharding executor feeds.

    One update is a session: :meth:`begin_weight_update`, any number of
    :meth:`load_weight_chunk` calls (any order and split; a module's tensors may span chunks),
    then :meth:`finish_weight_update`. Every rank calls each method (collective). Tests use
    fakes that implement only these three methods.
    """

    def begin_weight_update(self) -> None:
        """Open an update (raises ``RuntimeError`` when one is already open)."""
        ...

    def load_weight_chunk(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Consume Hugging Face-named full-shaped (unsharded) tensors; the engine slices them for
        its own TP layout. From :func:`~megarl.rollout.reshard.sync_weights` with PP > 1 only
        the part this rank's TP shard loads is defined (vLLM's narrowing,
        :func:`~megarl.rollout.reshard.plan.rollout_slice`); the rest is undefined. The tensors
        are only valid during this call. Raises ``RuntimeError`` outside an open update."""
        ...

    def finish_weight_update(self) -> None:
        """Close the update: names not given keep their values; cached prefixes are dropped.
        From the next :meth:`RolloutEngine.generate` on, the engine samples from the new
        weights."""
        ...


@runtime_checkable
class RolloutEngine(WeightSink, Protocol):
    """What the trainer needs from a rollout engine. Every rank calls every method (SPMD).

    The ranks of one rollout replica (``dp_rank``) generate together and must call
    :meth:`generate` with identical requests; replicas take different prompts (see
    :func:`megarl.rollout.distribute.generate_distributed`).

    Call-order contract, enforced by every engine (``RuntimeError``): no :meth:`generate` while a
    weight update is open, and none after ``sleep(level=2)`` until a weight update finished.
    """

    tensor_parallel_size: int
    """Rollout TP: ranks that hold one model copy split by tensor parallelism (the resharding
    plan's ``rollout_tp``)."""
    dp_rank: int
    """This rank's rollout replica, in ``[0, dp_size)``."""
    dp_size: int
    """Number of rollout replicas (rollout DP)."""
    eos_token_ids: list[int]
    """Token ids that always end a response."""

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
        """``n`` responses per prompt, prompt-major. Response ``(p, s)`` is sampled with
        ``request_seed(seed, step, prompt_ids[p], s)`` and carries ``prompt_id=prompt_ids[p]``
        (``prompt_ids`` defaults to ``range(len(prompts))``; pass global prompt ids when
        ``prompts`` is a shard). Log-probs are of ``log_softmax(logits / temperature)``. The
        engine's ``eos_token_ids`` always stop generation; ``stop_token_ids`` adds more.
        ``interrupts`` (a :class:`megarl.rollout.partial.Interrupts`): a partial rollout, which
        stops at the token boundaries it asks for and continues on new weights, each token's
        version recorded; an engine that cannot interrupt refuses it (ValueError).
        ``images``: each prompt's images (None or empty for a text prompt) for a
        vision-language engine, whose prompts hold every image widened to its tokens; an engine
        without images refuses them (ValueError)."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory between rollouts (a no-op where there is nothing to free).

        ``level=1``: weights offloaded to host memory, KV cache dropped; ``level=2``: both
        dropped, so a weight update must finish before the next :meth:`generate` (enforced on
        every engine, on CPU too, so CPU runs catch a missing sync).
        """
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back what :meth:`sleep` freed: ``tags`` from ``("weights", "kv_cache")``, None
        for all. Wake the weights, update them, then wake the KV cache to keep the peak low."""
        ...


@runtime_checkable
class AheadEngine(RolloutEngine, Protocol):
    """A rollout engine on ranks of its own that generates ahead of the trainer
    (:class:`~megarl.rollout.remote.engine.RemoteEngine`). Besides :class:`RolloutEngine`'s
    calls, the trainer asks it for later steps' batches and reads how far behind each was."""

    version: int
    """The weight version it holds now (syncs finished in this launch, less one)."""
    last_version: int
    """The weight version that generated the last batch :meth:`generate` returned."""
    waited_s: float
    """Seconds the trainer waited for the last batch."""
    sync_waited_s: float
    """Seconds the last weight sync waited for the batch asked before it."""
    update_bytes: int
    """Bytes the rollout ranks received of the last weight update."""
    rollout_timing: dict[str, float]
    """The rollout side's seconds for the last batch (``generate``, ``score``, ...)."""
    prescored: Any
    """The last batch's scores when the rollout ranks scored it (a ``RewardResult``, or the
    scorer's error as a string); None otherwise."""
    weights_link: str | None
    """How weight buckets travel: ``NCCL``, ``gloo`` (None on the training ranks after the
    first)."""

    def prefetch(self, requests: Sequence[tuple[list[list[int]], dict, dict | None]]) -> None:
        """Ask now for the batches later :meth:`generate` calls with the same arguments take,
        ``(prompts, generate's keyword arguments, what to score them with or None)`` each."""
        ...

    def bind_plan(self, plan: Any) -> None:
        """The resharding plan whose buckets each weight update sends."""
        ...

    def shutdown(self) -> None:
        """Stop the rollout ranks serving (they exit)."""
        ...


def update_weights(engine: WeightSink, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
    """One whole weight-update session: HF-named full tensors (a partial set updates only the
    named ones; a lazy generator is consumed once). For the trainer's sync use
    :func:`megarl.rollout.reshard.sync_weights`, which streams buckets into the same session."""
    engine.begin_weight_update()
    engine.load_weight_chunk(named_tensors)
    engine.finish_weight_update()


class CallOrder:
    """The call-order rules of :class:`RolloutEngine`, one implementation for every engine."""

    def __init__(self) -> None:
        self.updating = False
        """A weight update is open."""
        self.weights_dropped = False
        """``sleep(level=2)`` dropped the weights and no update has finished since."""

    def begin_update(self) -> None:
        if self.updating:
            raise RuntimeError("begin_weight_update: a weight update is already open")
        self.updating = True

    def check_updating(self, method: str) -> None:
        if not self.updating:
            raise RuntimeError(f"{method} called without begin_weight_update()")

    def finish_update(self) -> None:
        self.check_updating("finish_weight_update")
        self.updating = False
        self.weights_dropped = False

    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if level == 2:
            self.weights_dropped = True

    def check_can_generate(self) -> None:
        if self.updating:
            raise RuntimeError("generate during an open weight update (finish it first)")
        if self.weights_dropped:
            raise RuntimeError("generate after sleep(level=2): update the weights first")
