"""``megarl train`` with vLLM on a rank of its own, up to two steps off (issue 26): the quickstart
on 2 training ranks plus 1 rollout rank (``actor_rollout_ref.rollout.nnodes=1``,
``n_gpus_per_node=1``, ``async_training.staleness_threshold=2``), stopped by SIGTERM sent to
the rollout rank alone once step ``STOP_AFTER`` is done (the rollout rank is then generating the
next steps ahead; it survives the signal, as under ``scancel``, which signals every process, and
passes the request on to the training ranks as the STOP file, which a signal to the launcher
writes too: tests/trainer/test_faults.py) and relaunched to the end. Together the two launches
learn the synthetic task, see every step's prompts in the order of an uninterrupted run (the
sampler's, nothing repeated or dropped across the stop), say where their rollout runs, keep the
console megarl's own and leave nothing running or in their temporary directory."""

from __future__ import annotations

import signal
from pathlib import Path

import psutil
import pytest

from tests._run_outputs import assert_prompts_in_sampler_order, stop_and_resume
from tests.checkpoint.test_trainer_checkpoint import _survivors
from tests.conftest import left_behind
from tests.trainer.test_grpo_learning import MEGARL_LINE

REPO = Path(__file__).resolve().parents[2]
STEPS = 10
STOP_AFTER = 3
STALENESS = 2
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.multirank]


OVERRIDES = [
    "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    f"async_training.staleness_threshold={STALENESS}", f"trainer.total_training_steps={STEPS}",
    "trainer.test_freq=5", "trainer.save_freq=-1",
]  # fmt: skip


def _stop_the_rollout_rank(first) -> dict:
    """SIGTERM to the rollout rank alone; afterwards, which of the launch's processes remain."""
    tree = [psutil.Process(first.pid), *psutil.Process(first.pid).children(recursive=True)]
    rollout = next(p for p in tree
                   if "megarl.trainer" in p.cmdline() and p.environ().get("RANK") == "2")  # fmt: skip
    rollout.send_signal(signal.SIGTERM)
    return {"after_stop": lambda: {"survivors": _survivors(tree, timeout=10)}}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("steps_off")
    return stop_and_resume(out, OVERRIDES, STOP_AFTER, _stop_the_rollout_rank)


def test_two_steps_off_learns(run):
    """Greedy validation rises as the colocated run's does (the dense learning test's bar: its
    lr-0 control shows greedy validation does not move by itself), across the stop."""
    m = run["metrics"]
    gain = m[STEPS]["val/score/mean"] - m[0]["val/score/mean"]
    print(f"r0={m[0]['val/score/mean']:.4f} final={m[STEPS]['val/score/mean']:.4f} gain={gain:.4f}")
    assert gain >= 0.15


def test_a_signal_to_the_rollout_rank_stops_both_sides_with_the_step_saved(run):
    out, err = run["stopped"]
    assert run["saved"] >= STOP_AFTER and f"stopped after step {run['saved']}" in out + err
    assert "(SIGTERM on rank 2)" in out  # passed on by the rollout rank, which says so in its log
    rank2 = (run["run_dir"] / "logs" / "rank2.log").read_text()
    assert "SIGTERM received on rank 2: the training ranks stop after this step" in rank2
    assert "Traceback" not in out + err
    assert run["survivors"] == []  # the rollout rank waited for the trainer to stop it
    resumed_from = run["run_dir"] / f"global_step_{run['saved']}"
    assert f"resumed from {resumed_from}" in "".join(run["done"])


def test_every_step_trains_on_a_rollout_two_updates_old_but_the_first_of_each_launch(run):
    """Each launch's first step generates with the weights it starts from (staleness 0), and
    asks for the next two steps' batches with them (1, then 2): the steps the first launch
    asked for ahead when it stopped are generated again after the resume."""
    m, saved = run["metrics"], run["saved"]

    def launch(steps: int) -> list[float]:
        return [float(min(i, STALENESS)) for i in range(steps)]

    want = launch(saved) + launch(STEPS - saved)
    assert [m[s]["async/staleness_max"] for s in range(1, STEPS + 1)] == want
    assert m[1]["rollout/logprob_diff_max"] <= 1e-4  # step 1: the synced initial weights


def test_the_stop_repeats_and_drops_no_prompt(run):
    """Every step's prompts are those the sampler gives an uninterrupted run (the trainer's own
    dataset and sampler, built here from the same config): it fails if the checkpoint held the
    sampler's state after the lookahead (the relaunch would skip a batch)."""
    assert_prompts_in_sampler_order(REPO / "configs" / "grpo_tiny_cpu.yaml", run["out"],
                                    run["run_dir"], STEPS)  # fmt: skip


def test_console_says_where_the_rollout_runs_and_holds_only_megarl_lines(run):
    lines = [p.strip() for launch in (run["stopped"], run["done"]) for t in launch
             for line in t.splitlines() for p in line.split("\r") if p.strip()]  # fmt: skip
    assert [line for line in lines if not MEGARL_LINE.match(line)] == []
    said = "on 1 rank(s) of its own, up to 2 steps off, weights over gloo"  # staged: host memory
    assert any(said in line for line in lines), lines[:3]
    assert (run["run_dir"] / "logs" / "rank2.log").is_file()  # the rollout rank's log


def test_the_run_leaves_nothing_in_the_temporary_directory(run):
    assert left_behind(run["out"] / "tmp") == []
