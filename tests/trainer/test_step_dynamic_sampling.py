"""DAPO's dynamic sampling in the step (verl-recipe's DAPO trainer): groups whose responses are
all correct or all wrong are dropped, generation batches follow until data.train_batch_size
groups are kept, and the step trains on exactly that many; past max_num_gen_batches it fails.
Generation and scoring are scripted (no model): the logic under test is the step's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megarl.config import load_config
from megarl.reward.manager import RewardResult
from megarl.rollout.base import RolloutBatch, RolloutSample
from megarl.trainer import step as step_module
from megarl.trainer.batch import rollout_batch
from megarl.trainer.metrics import Timer

# Each generation batch: three prompts, two responses each, their acc.
BATCHES = [
    {"A": [1, 1], "B": [0, 0], "C": [1, 0]},  # keeps C
    {"D": [0, 1], "E": [1, 1], "F": [0, 0]},  # keeps D
    {"G": [1, 0], "H": [0, 1], "I": [0, 1]},  # keeps G, H, I: 5 kept, 3 wanted
]


ROUTE = {name: k for k, name in enumerate(sorted(n for b in BATCHES for n in b))}


class Script:
    def __init__(self):
        self.next = 1  # the step's own batch (0) is generated before fill_with_groups

    def prompts(self, k):
        return [SimpleNamespace(name=p, data_source="toy") for p in BATCHES[k]]

    def generate(self, engine, prompts, *, n, **_):
        samples = []
        for i, p in enumerate(prompts):
            for j in range(n):
                resp = [10 + i, 20 + j] if j else [10 + i]  # varied lengths
                # R3: the routing "captured", one expert per position naming the response
                routing = torch.full((2 + len(resp), 1, 1), ROUTE[p.name] * 10 + j)
                samples.append(RolloutSample(i, j, [1, 2], resp, [0.0] * len(resp), "stop",
                                             prompt_id=i, routing=routing.numpy()))  # fmt: skip
        out = RolloutBatch(samples, n)
        batch = rollout_batch([s.prompt_token_ids for s in samples],
                              [s.response_token_ids for s in samples],
                              [s.response_logprobs for s in samples],
                              [s.prompt_id for s in samples], [False] * len(samples),
                              pad_token_id=0)  # fmt: skip
        return batch, out

    def score(self, run, prompts, samples, batch, step, dump, prescored=None):
        acc = torch.tensor(
            [float(BATCHES[_which(prompts)][prompts[s.prompt_index].name][s.sample_index])
             for s in samples])  # fmt: skip
        width = batch.response_mask.shape[1]
        return RewardResult(torch.zeros(len(acc), width), acc, {"acc": acc}, {},
                            torch.zeros(len(acc), dtype=torch.bool))  # fmt: skip


def _which(prompts):
    return next(k for k, b in enumerate(BATCHES) if prompts[0].name in b)


@pytest.fixture
def scripted(monkeypatch):
    script = Script()
    monkeypatch.setattr(step_module, "generate", script.generate)
    monkeypatch.setattr(step_module, "score", script.score)
    monkeypatch.setattr(step_module, "enter", lambda *a, **k: None)
    monkeypatch.setattr(step_module, "pad_token_id", lambda tokenizer: 0)
    return script


def _run(max_batches=0):
    cfg = load_config([], ["data.train_batch_size=3", "actor_rollout_ref.rollout.n=2",
                           "algorithm.filter_groups.enable=true",
                           "algorithm.filter_groups.metric=acc",
                           f"algorithm.filter_groups.max_num_gen_batches={max_batches}"])  # fmt: skip
    return SimpleNamespace(
        cfg=cfg,
        engine=None,
        tokenizer=None,
        ahead=None,
        engine_residency=None,
        last_sleep_level=None,
        image_width=None,  # a text actor
    )


def _first(script):
    prompts = script.prompts(0)
    batch, samples = script.generate(None, prompts, n=2)
    return prompts, batch, samples, script.score(None, prompts, samples, batch, 1, None)


def test_dropped_groups_extra_batches_and_a_full_training_batch(scripted):
    prompts, batch, samples, scored = _first(scripted)
    drawn = iter([scripted.prompts(1), scripted.prompts(2)])
    batch, samples, prompts, scored, metrics = step_module.fill_with_groups(
        _run(), 1, prompts, batch, samples, scored, lambda: (next(drawn), None), Timer()
    )
    assert [p.name for p in prompts] == ["C", "D", "G"]  # the first 3 kept groups
    assert batch.prompt_ids.tolist() == [0, 0, 1, 1, 2, 2] and len(samples) == 6
    assert scored.scores.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert scored.fields["acc"].tolist() == scored.scores.tolist()
    # R3: each kept response's captured routing, -1 past its end
    routes = batch.rollout_routing[:, :, 0, 0]
    for row, (name, j) in enumerate([("C", 0), ("C", 1), ("D", 0), ("D", 1), ("G", 0), ("G", 1)]):
        end = 2 + (2 if j else 1)
        assert routes[row, :end].tolist() == [ROUTE[name] * 10 + j] * end, row
        assert (routes[row, end:] == -1).all(), row
    # each score sits on its response's last token in the joined batch
    lengths = batch.response_mask.sum(1).long()
    assert lengths.tolist() == [1, 2, 1, 2, 1, 2]
    for i, length in enumerate(lengths.tolist()):
        assert scored.token_level_rewards[i, length - 1] == scored.scores[i]
    assert metrics == {
        "train/num_gen_batches": 3.0,
        "dynamic_sampling/generated_groups": 9.0,
        "dynamic_sampling/kept_groups": 5.0,
        "dynamic_sampling/dropped_groups": 4.0,
    }


def test_past_max_num_gen_batches_the_step_fails_in_one_line(scripted):
    prompts, batch, samples, scored = _first(scripted)
    drawn = iter([scripted.prompts(1), scripted.prompts(2)])
    with pytest.raises(RuntimeError, match="2 generation batches kept 2 of the "
                       "data.train_batch_size=3 groups"):  # fmt: skip
        step_module.fill_with_groups(_run(max_batches=2), 1, prompts, batch, samples, scored,
                                     lambda: (next(drawn), None), Timer())  # fmt: skip


def test_gdpo_components_come_from_the_scorers_dict_and_a_missing_key_is_one_line():
    from megarl.reward.manager import RewardError

    acc = torch.tensor([1.0, 0.0])
    scored = RewardResult(torch.zeros(2, 1), acc, {"acc": acc, "fmt": 1 - acc}, {},
                          torch.zeros(2, dtype=torch.bool))  # fmt: skip
    assert step_module.gdpo_components(["fmt", "acc"], scored)["fmt"].tolist() == [0.0, 1.0]
    assert step_module.gdpo_metrics(["acc"], scored) == {
        "gdpo/acc/mean": 0.5, "gdpo/acc/std": 0.5, "gdpo/acc/max": 1.0, "gdpo/acc/min": 0.0}  # fmt: skip
    with pytest.raises(RewardError) as info:
        step_module.gdpo_components(["acc", "length"], scored)
    assert str(info.value) == (
        "algorithm.gdpo_reward_keys ['length']: not among the numeric fields the reward function "
        "returns (acc, fmt); return a dict with a number under each key"
    )
