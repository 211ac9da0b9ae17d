"""The reward manager: every sample of the global batch scored exactly once in the whole job.

Called SPMD: every rank passes the same global list of :class:`RewardInput`; rank ``r`` of ``W``
scores samples ``r, r + W, ...`` in its own :class:`ScoringPool` and an all-gather gives every
rank the full :class:`RewardResult`. As in verl's naive reward manager, a response is decoded
with ``skip_special_tokens=True``, scored by ``compute_score(data_source=, solution_str=,
ground_truth=, extra_info=, **reward_kwargs)``, and its score goes on its last valid token. A
learned reward model's scores replace the scorers (``model_scores``), as in verl 0.9.1.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import torch

from megarl.reward.dump import write_dump
from megarl.reward.loader import ScorerSpec, load_scorer
from megarl.reward.pool import Outcome, ScoringPool
from megarl.reward.records import RewardInput, RewardResult, reward_inputs

__all__ = ["RewardError", "RewardInput", "RewardManager", "RewardResult", "reward_inputs"]


class RewardError(RuntimeError):
    """A scorer raised (or crashed) on a sample; one line naming scorer, data_source, index."""


def _rank_and_world(group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


class RewardManager:
    """Scores global batches with a pool of ``num_workers`` scoring processes per rank.

    ``RewardManager(tokenizer, spec, num_workers=1, timeout_s=30.0, dump_samples=16)``; use
    :meth:`from_config` in the trainer. Call :meth:`close` (or use ``with``) at the end.
    """

    def __init__(
        self,
        tokenizer: Any,
        spec: ScorerSpec | None = None,
        *,
        num_workers: int = 1,
        timeout_s: float = 30.0,
        dump_samples: int = 16,
        group: Any = None,
        overlong: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.overlong = overlong
        self.spec = spec or ScorerSpec()
        load_scorer(self.spec)  # a bad path or name fails here, before any worker starts
        self.dump_samples = dump_samples
        self.group = group
        self.pool = ScoringPool(self.spec, num_workers, timeout_s)

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any, group: Any = None) -> RewardManager:
        """From a ``MegarlConfig`` (``custom_reward_function.*``, ``reward_model.*``, the reward
        manager and its ``reward_kwargs``)."""
        from megarl.config.recipe_checks import overlong_settings

        rm = cfg.reward_model
        return cls(
            tokenizer,
            ScorerSpec.from_config(cfg.custom_reward_function, cfg),
            num_workers=rm.num_workers,
            timeout_s=rm.compute_score_timeout,
            dump_samples=rm.dump_samples,
            group=group,
            overlong=overlong_settings(cfg),
        )

    def close(self) -> None:
        """Stop the scoring workers."""
        self.pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def decode(self, sample: RewardInput) -> str:
        """The response text as verl decodes it (special tokens skipped)."""
        return self.tokenizer.decode(list(sample.response_ids), skip_special_tokens=True)

    def __call__(
        self,
        samples: Sequence[RewardInput],
        *,
        response_width: int | None = None,
        dump_dir: str | Path | None = None,
        step: int = 0,
        model_scores: torch.Tensor | None = None,
    ) -> RewardResult:
        """Score the global batch ``samples`` (same list on every rank); see the module doc.

        ``response_width`` is T of ``token_level_rewards`` (default: the longest response).
        With ``dump_dir``, rank 0 writes the first ``dump_samples`` samples to
        ``dump_dir/<step>.jsonl``. ``model_scores`` ``[B]`` (a reward model's, the same on every
        rank) replace the scorers, as verl 0.9.1's reward loop does with a reward model enabled
        (a reward model and the data_source rules are never added).

        Deliberately unlike verl: a per-sample time limit always applies (a sample over it
        scores 0, has no dict fields and counts in ``reward/timeouts``); a scorer that raises
        fails the step on every rank with one :class:`RewardError`; an empty response's row of
        ``token_level_rewards`` is all zero (verl writes index -1), its score still in
        ``scores``; dict fields some samples lack are 0 in the numeric field tensors.
        """
        rank, world = _rank_and_world(self.group)
        if model_scores is not None:
            outcomes = [Outcome(i, "ok", float(x)) for i, x in enumerate(model_scores.tolist())]
        else:
            outcomes = self._score_on_all_ranks(samples, rank, world)
        by_index = sorted(outcomes, key=lambda o: o.index)
        if [o.index for o in by_index] != list(range(len(samples))):
            raise RuntimeError("reward manager: ranks returned a different set of samples")
        self._raise_first_error(by_index, samples)
        own = torch.tensor([o.score for o in by_index], dtype=torch.float32).reshape(-1)
        if self.overlong is not None and model_scores is None:
            by_index = self._shape_overlong(by_index, samples)
        result = self._assemble(by_index, samples, response_width)
        result.function_scores = own
        if dump_dir is not None and rank == 0 and self.dump_samples != 0:
            k = len(samples) if self.dump_samples < 0 else min(self.dump_samples, len(samples))
            texts = [self.decode(s) for s in samples[:k]]
            write_dump(Path(dump_dir), step, samples[:k], texts, result)
        return result

    def _score_on_all_ranks(
        self, samples: Sequence[RewardInput], rank: int, world: int
    ) -> list[Outcome]:
        """Rank ``rank`` scores every ``world``-th sample; every rank gets every outcome."""
        manager = self.spec.manager
        ids = manager == "importlib"  # a user's manager class reads token ids (and the record)
        mine = [
            (i, s.data_source, self.decode(s), s.ground_truth, s.scorer_extra_info(manager))
            + ((list(s.prompt_ids), list(s.response_ids), s.rollout) if ids else ())
            for i, s in enumerate(samples)
            if i % world == rank
        ]
        try:
            outcomes = self.pool.score(mine)
        except Exception as exc:  # noqa: BLE001 -- every rank must reach the all-gather
            outcomes = [
                Outcome(t[0], "error", message=f"{type(exc).__name__}: {exc}") for t in mine
            ]
        if world > 1:
            import torch.distributed as dist

            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, outcomes, group=self.group)
            outcomes = [o for part in gathered for o in part]
        return outcomes

    def _raise_first_error(self, outcomes: list[Outcome], samples: Sequence[RewardInput]) -> None:
        errors = [o for o in outcomes if o.status == "error"]
        if errors:
            o = errors[0]
            more = f" ({len(errors) - 1} more sample(s) failed)" if len(errors) > 1 else ""
            raise RewardError(
                f"scorer {self.spec.label} failed on sample {o.index} "
                f"(data_source={samples[o.index].data_source!r}): {o.message}{more}"
            )

    def _shape_overlong(
        self, outcomes: list[Outcome], samples: Sequence[RewardInput]
    ) -> list[Outcome]:
        """The dapo manager's overlong buffer (:mod:`megarl.reward.overlong`): each score plus
        its length's penalty; with ``overlong_buffer_cfg.log``, fields ``overlong_reward`` and
        ``overlong`` (as verl). A reward model's scores are not shaped (verl 0.9.1 scores with
        the reward model instead of the manager)."""
        from megarl.reward.overlong import overlong_penalty

        o = self.overlong
        assert o is not None
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        penalties = overlong_penalty(lengths, max_resp_len=o["max_resp_len"],
                                     buffer_len=o["len"], penalty_factor=o["penalty_factor"])  # fmt: skip
        shaped = []
        for outcome, penalty in zip(outcomes, penalties.tolist(), strict=True):
            fields = dict(outcome.fields or {})
            if o["log"]:
                fields.update(overlong_reward=penalty, overlong=penalty < 0)
            shaped.append(dataclasses.replace(outcome, score=outcome.score + penalty,
                                              fields=fields))  # fmt: skip
        return shaped

    def _assemble(
        self, outcomes: list[Outcome], samples: Sequence[RewardInput], width: int | None
    ) -> RewardResult:
        n = len(samples)
        lengths = [len(s.response_ids) for s in samples]
        width = max(lengths, default=0) if width is None else width
        too_long = [i for i, length in enumerate(lengths) if length > width]
        if too_long:
            i = too_long[0]
            raise ValueError(
                f"reward manager: sample {i} has {lengths[i]} response tokens, more than "
                f"response_width={width}"
            )
        scores = torch.tensor([o.score for o in outcomes], dtype=torch.float32).reshape(n)
        token_rewards = torch.zeros(n, width, dtype=torch.float32)
        for i, length in enumerate(lengths):
            if length > 0:
                token_rewards[i, length - 1] = scores[i]
        timed_out = torch.tensor([o.status == "timeout" for o in outcomes], dtype=torch.bool)
        per_sample = [o.fields or {} for o in outcomes]
        fields, extra = _split_fields(per_sample)
        metrics = _metrics([s.data_source for s in samples], scores, per_sample, fields, timed_out)
        return RewardResult(token_rewards, scores, fields, extra, timed_out, metrics)


def _split_fields(
    per_sample: list[dict[str, Any]],
) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]]]:
    names = sorted({k for fields in per_sample for k in fields})
    numeric: dict[str, torch.Tensor] = {}
    other: dict[str, list[Any]] = {}
    for name in names:
        values = [fields.get(name) for fields in per_sample]
        present = [v for v in values if v is not None]
        if present and all(isinstance(v, numbers.Real) for v in present):
            numeric[name] = torch.tensor(
                [float(v) if v is not None else 0.0 for v in values], dtype=torch.float32
            )
        else:
            other[name] = values
    return numeric, other


def _metrics(
    sources: list[str],
    scores: torch.Tensor,
    per_sample: list[dict[str, Any]],
    numeric: dict[str, torch.Tensor],
    timed_out: torch.Tensor,
) -> dict[str, float]:
    """Per data_source score statistics; numeric field means over the samples that have them."""
    rows: dict[str, list[int]] = defaultdict(list)
    for i, source in enumerate(sources):
        rows[source].append(i)
    metrics: dict[str, float] = {}
    for source, idx in sorted(rows.items()):
        s = scores[idx]
        prefix = f"reward/{source}"
        metrics[f"{prefix}/mean"] = s.mean().item()
        metrics[f"{prefix}/min"] = s.min().item()
        metrics[f"{prefix}/max"] = s.max().item()
        metrics[f"{prefix}/count"] = float(len(idx))
        for name, values in numeric.items():
            has = [i for i in idx if per_sample[i].get(name) is not None]
            if has:
                metrics[f"{prefix}/{name}/mean"] = values[has].mean().item()
    metrics["reward/timeouts"] = float(timed_out.sum().item())
    return metrics


def result_rows(
    parts: Sequence[tuple[RewardResult, Sequence[int]]],
    sources: Sequence[str],
    lengths: Sequence[int],
    width: int,
) -> RewardResult:
    """The rows ``rows`` of each ``(result, rows)`` in turn, as one result whose responses come
    from ``sources`` with ``lengths`` valid tokens, ``width`` wide (DAPO's dynamic sampling
    joins the groups it keeps from several generation batches)."""
    names = sorted({k for result, _ in parts for k in result.fields})
    extras = sorted({k for result, _ in parts for k in result.extra})
    scores, own, timed_out, per_sample = [], [], [], []
    fields: dict[str, list[torch.Tensor]] = {k: [] for k in names}
    extra: dict[str, list[Any]] = {k: [] for k in extras}
    for result, rows in parts:
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        scores.append(result.scores[idx])
        own.append(result.function_scores[idx])
        timed_out.append(result.timed_out[idx])
        for k in names:
            values = result.fields.get(k, torch.zeros_like(result.scores))
            fields[k].append(values[idx])
        for k in extras:
            values = result.extra.get(k, [None] * len(result.scores))
            extra[k].extend(values[i] for i in rows)
        per_sample.extend({k: 1 for k in result.fields} for _ in rows)
    all_scores = torch.cat(scores) if scores else torch.zeros(0)
    joined = {k: torch.cat(v) for k, v in fields.items()}
    out_timed = torch.cat(timed_out) if timed_out else torch.zeros(0, dtype=torch.bool)
    token_rewards = torch.zeros(len(all_scores), width, dtype=torch.float32)
    for i, length in enumerate(lengths):
        if length > 0:
            token_rewards[i, length - 1] = all_scores[i]
    metrics = _metrics(list(sources), all_scores, per_sample, joined, out_timed)
    own_scores = torch.cat(own) if own else torch.zeros(0)
    return RewardResult(token_rewards, all_scores, joined, extra, out_timed, metrics, own_scores)
