"""One conformance check of the rollout-engine protocol, for every engine.

:func:`probe_engine` runs inside a torchrun worker (every rank, collective) against a live engine
and the Megatron actor it serves, and records what it saw as JSON; :func:`assert_conforms` is
the test, the same function for :class:`~megarl.rollout.actor_engine.ActorEngine` and
:class:`~megarl.rollout.vllm_engine.VLLMEngine`. It covers every protocol attribute and method
(names, parameters, defaults) and the behaviour the trainer relies on: n responses per prompt in
prompt-major order carrying their prompt ids, seeds reproducible and distinct, EOS / stop
handling, log-probs of ``log_softmax(logits / T)`` (the actor's own), a weight sync visible in
the next generation's log-probs, the call-order errors, sleep/wake, and ``generate_distributed``
returning global prompt ids.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

T = 0.7
LOGPROB_TOL = 1e-4
PROMPTS = [[11, 42, 7, 99, 500], [3, 14, 15, 92, 65, 35, 89], [271, 828, 182, 845]]
PROMPT_IDS = [10, 11, 12]
GLOBAL_PROMPTS = [[5 + i, 17, 300 + 7 * i, 9][: 2 + i % 3] for i in range(5)]
EXTRA_STOPS = list(range(4, 300))  # ~30% of the vocabulary: most responses stop early
SAMPLING = {"n": 3, "temperature": T, "max_tokens": 8, "seed": 5, "prompt_ids": PROMPT_IDS}
METHODS = (
    "generate",
    "begin_weight_update",
    "load_weight_chunk",
    "finish_weight_update",
    "sleep",
    "wake_up",
)
ATTRIBUTES = ("tensor_parallel_size", "dp_rank", "dp_size", "eos_token_ids")


def _params(fn: Callable, drop_self: bool) -> list[list[str]]:
    """(name, kind, default) of each parameter: what a caller of the protocol depends on."""
    params = list(inspect.signature(fn).parameters.values())[int(drop_self) :]
    return [[p.name, p.kind.name, repr(p.default)] for p in params]


def _record(batch) -> list[dict]:
    return [
        {
            "prompt_index": s.prompt_index,
            "sample_index": s.sample_index,
            "prompt_id": s.prompt_id,
            "prompt": s.prompt_token_ids,
            "response": s.response_token_ids,
            "logprobs": s.response_logprobs,
            "finish_reason": s.finish_reason,
        }
        for s in batch
    ]


def _raises(fn: Callable[[], Any], kind: type[Exception]) -> bool:
    try:
        fn()
    except kind:
        return True
    return False


class _WatchingSink:
    """Forwards a sync to the engine and, while the session is open, checks that a second
    ``begin_weight_update`` and a ``generate`` are refused."""

    def __init__(self, engine, rec: dict) -> None:
        self.engine, self.rec = engine, rec

    def begin_weight_update(self) -> None:
        self.engine.begin_weight_update()

        def generate() -> None:
            self.engine.generate(PROMPTS[:1], n=1, temperature=T, max_tokens=2, seed=0)

        self.rec["generate_during_update_raises"] = _raises(generate, RuntimeError)
        self.rec["begin_twice_raises"] = _raises(self.engine.begin_weight_update, RuntimeError)

    def load_weight_chunk(self, named_tensors) -> None:
        self.engine.load_weight_chunk(named_tensors)

    def finish_weight_update(self) -> None:
        self.engine.finish_weight_update()


def probe_engine(
    engine,
    chunks: Sequence,
    dims,
    *,
    perturb_actor: Callable[[], None],
    train_dp: tuple[int, int],
) -> dict:
    """Exercise ``engine`` (serving the actor ``chunks``) and record the results.

    Precondition: the engine holds the actor's current weights. ``perturb_actor`` changes the
    actor's weights in place (the "training step"); ``train_dp`` is the actor's (DP rank, DP
    size). Every rank calls this with the same arguments.
    """
    from megarl.rollout.base import RolloutEngine
    from megarl.rollout.consistency import rollout_logprob_consistency
    from megarl.rollout.distribute import even_split, generate_distributed
    from megarl.rollout.reshard import plan_for_chunks, sync_weights

    def consistency(batch) -> float:
        metrics = rollout_logprob_consistency(
            chunks, batch, vocab_size=dims.vocab_size, temperature=T
        )
        return metrics["rollout/logprob_diff_max"]

    rec: dict[str, Any] = {
        "is_protocol_instance": isinstance(engine, RolloutEngine),
        "signatures": {m: _params(getattr(engine, m), False) for m in METHODS},
        "protocol_signatures": {m: _params(getattr(RolloutEngine, m), True) for m in METHODS},
        "attributes": {a: getattr(engine, a, None) for a in ATTRIBUTES},
    }
    first = engine.generate(PROMPTS, **SAMPLING)
    rec["first"] = _record(first)
    rec["first_diff_max"] = consistency(first)
    rec["again"] = _record(engine.generate(PROMPTS, **SAMPLING))
    rec["other_seed"] = _record(engine.generate(PROMPTS, **{**SAMPLING, "seed": 6}))
    rec["other_step"] = _record(engine.generate(PROMPTS, **{**SAMPLING, "step": 1}))
    stops = {**SAMPLING, "n": 2, "max_tokens": 12, "stop_token_ids": EXTRA_STOPS}
    rec["stops"] = _record(engine.generate(PROMPTS, **stops))
    rec["empty"] = len(engine.generate([], n=2, temperature=T, max_tokens=4, seed=0))

    # Call order outside a session.
    rec["load_without_begin_raises"] = _raises(lambda: engine.load_weight_chunk([]), RuntimeError)
    rec["finish_without_begin_raises"] = _raises(engine.finish_weight_update, RuntimeError)
    rec["bad_sleep_level_raises"] = _raises(lambda: engine.sleep(3), ValueError)

    # A training step, then the sync: the next generation follows the new weights.
    perturb_actor()
    plan = plan_for_chunks(chunks, dims, rollout_tp=engine.tensor_parallel_size)
    sync_weights(chunks, plan, _WatchingSink(engine, rec))
    synced = engine.generate(PROMPTS, **SAMPLING)
    rec["synced"] = _record(synced)
    rec["synced_diff_max"] = consistency(synced)

    # Sleep and wake (level 1 keeps the weights); level 2 needs a sync before generating.
    engine.sleep()
    engine.wake_up()
    rec["after_wake"] = _record(engine.generate(PROMPTS, **SAMPLING))
    engine.sleep(level=2)
    rec["generate_after_level2_raises"] = _raises(
        lambda: engine.generate(PROMPTS, **SAMPLING), RuntimeError
    )
    engine.wake_up(["weights"])
    sync_weights(chunks, plan, engine)
    engine.wake_up(["kv_cache"])
    rec["after_level2_sync"] = _record(engine.generate(PROMPTS, **SAMPLING))

    # Training-DP shards through the rollout replicas and back, with global prompt ids.
    dp_rank, dp_size = train_dp
    shard = even_split(len(GLOBAL_PROMPTS), dp_size, dp_rank)
    batch = generate_distributed(
        engine,
        [GLOBAL_PROMPTS[i] for i in shard],
        dp_rank=dp_rank,
        dp_size=dp_size,
        n=2,
        temperature=T,
        max_tokens=4,
        seed=9,
    )
    rec["distributed"] = _record(batch)
    rec["distributed_shard"] = list(shard)
    rec["distributed_prompt_ids_tensor"] = batch.prompt_ids.tolist()
    return rec


# --------------------------------------------------------------------------------------------
# The assertions (pytest side)
# --------------------------------------------------------------------------------------------


def _tokens(recs: list[dict]) -> list[list[int]]:
    return [r["response"] for r in recs]


def _same(a: list[dict], b: list[dict], where: str, abs_tol: float) -> None:
    import pytest

    assert _tokens(a) == _tokens(b), where
    for x, y in zip(a, b, strict=True):
        assert x["logprobs"] == pytest.approx(y["logprobs"], abs=abs_tol), where


def assert_conforms(rec: dict, where: str) -> None:
    """Every protocol requirement on one rank's :func:`probe_engine` record."""
    # Surface: attributes and method parameters as the protocol declares them.
    assert rec["is_protocol_instance"], where
    assert rec["signatures"] == rec["protocol_signatures"], where
    attrs = rec["attributes"]
    assert isinstance(attrs["tensor_parallel_size"], int) and attrs["tensor_parallel_size"] >= 1
    assert 0 <= attrs["dp_rank"] < attrs["dp_size"], (where, attrs)
    assert attrs["eos_token_ids"] and all(isinstance(i, int) for i in attrs["eos_token_ids"])

    # n responses per prompt, prompt-major, each carrying its prompt and prompt id.
    n = SAMPLING["n"]
    first = rec["first"]
    assert len(first) == n * len(PROMPTS), where
    for i, r in enumerate(first):
        assert (r["prompt_index"], r["sample_index"]) == (i // n, i % n), where
        assert r["prompt_id"] == PROMPT_IDS[i // n], where
        assert r["prompt"] == PROMPTS[i // n], where
        assert len(r["logprobs"]) == len(r["response"]), where
    assert rec["empty"] == 0, where

    # Seeds: reproducible; another seed / step / sample index draws other tokens.
    _same(first, rec["again"], where, abs_tol=0.0)
    for other in ("other_seed", "other_step"):
        differ = sum(x != y for x, y in zip(_tokens(first), _tokens(rec[other]), strict=True))
        assert differ >= len(first) - 1, (where, other)
    for p in range(len(PROMPTS)):
        group = {tuple(t) for t in _tokens(first[p * n : (p + 1) * n])}
        assert len(group) >= n - 1, where

    # EOS / stop ids: "stop" ends on one (and only there), "length" has max_tokens tokens.
    stops = set(attrs["eos_token_ids"]) | set(EXTRA_STOPS)
    stopped = 0
    for key, max_tokens, ends in [
        ("first", 8, set(attrs["eos_token_ids"])),
        ("stops", 12, stops),
    ]:
        for r in rec[key]:
            if r["finish_reason"] == "length":
                assert len(r["response"]) == max_tokens and not set(r["response"]) & ends, where
            else:
                assert r["finish_reason"] == "stop", where
                assert r["response"][-1] in ends and not set(r["response"][:-1]) & ends, where
                stopped += key == "stops"
    assert stopped >= 2, where

    # Log-probs are the actor's log_softmax(logits / T); a sync shows in the next generation.
    assert rec["first_diff_max"] <= LOGPROB_TOL, (where, rec["first_diff_max"])
    assert rec["synced_diff_max"] <= LOGPROB_TOL, (where, rec["synced_diff_max"])
    for a, b in zip(first, rec["synced"], strict=True):
        assert abs(a["logprobs"][0] - b["logprobs"][0]) > 1e-6, where

    # Call order.
    for flag in (
        "load_without_begin_raises",
        "finish_without_begin_raises",
        "bad_sleep_level_raises",
        "generate_during_update_raises",
        "begin_twice_raises",
        "generate_after_level2_raises",
    ):
        assert rec[flag], (where, flag)

    # Sleep/wake keep (level 1) or, after a sync, restore (level 2) the same weights.
    _same(rec["synced"], rec["after_wake"], where, abs_tol=1e-5)
    _same(rec["synced"], rec["after_level2_sync"], where, abs_tol=1e-5)

    # generate_distributed: this rank's shard, n=2 each, global prompt ids.
    shard, dist_recs = rec["distributed_shard"], rec["distributed"]
    assert len(dist_recs) == 2 * len(shard), where
    for i, r in enumerate(dist_recs):
        assert (r["prompt_index"], r["sample_index"]) == (i // 2, i % 2), where
        assert r["prompt_id"] == shard[i // 2], where
        assert r["prompt"] == GLOBAL_PROMPTS[shard[i // 2]], where
    assert rec["distributed_prompt_ids_tensor"] == [r["prompt_id"] for r in dist_recs], where
