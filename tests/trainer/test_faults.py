"""Faults and stops against the real trainer through ``megarl train`` (issue 23), 2 CPU ranks.

Launches are the cost (each imports Megatron on two ranks), so they are few and each serves
several checks:

- the stop diamond (6 launches), PPO with a critic (``gae``, ``ppo_epochs`` 2, adaptive KL in
  the reward, whose coefficient moves every step): an uninterrupted 5-step reference; then one
  run stopped by SIGUSR1 before scoring (step 1), resumed and stopped by SIGTERM while its
  scorer is scoring (step 2), resumed and stopped by SIGTERM before scoring (step 3), resumed
  from step 2 (step 3's checkpoint made incomplete) and stopped by SIGTERM to rank 1 alone
  (step 3 again), and resumed to the end. Each stop: exit 0, a
  checkpoint of the step in flight (the critic's included), the trainer's stop line, no
  traceback, no process of the launch alive (scoring workers included); the launcher's
  acknowledgement for the signals sent to it. The resumed run equals the reference (metrics of
  every step, the KL coefficient included, prompts, final weights);
- ``kill -9`` of the launcher (1 launch): nothing of the launch runs 40 s later;
- ``kill -9`` of rank 1 while rank 0 is in a multi-turn step's interaction turn (1 launch):
  exit 1, one line naming rank 1 and SIGKILL, rank 0 left the turn itself (issue 53);
- an error inside the ranks (1 launch: the scorer raises): exit 2, the first rank's ``error:``
  line once with where the logs are, no traceback; torchrun's report in ``logs/torchrun.log``;
- vLLM on a rank of its own, fully async with partial rollouts (issues 26, 55): ``kill -9`` of
  that rank (1 launch) while it is held between two tokens of responses that go on after a
  weight update (:mod:`tests.trainer._held_rollout`), one line naming it. (SIGTERM to such a run and its relaunch: ``test_disaggregated_run.py``, whose
  learning run is stopped and resumed in the middle.)

Scoring is driven by a custom reward file: while ``<root>/hold`` exists each sample touches
``<root>/hold.scoring`` and takes 0.3 s, so a test can signal in the middle of scoring. Its
scores are bools (issue 40: verl counts them as 1.0 / 0.0; they were refused).

Issue 40 in the stop diamond: each stop line names the signal (it said "<run dir>/STOP exists"
of a file removed at exit); after the fourth launch, which runs step 3 again, ``metrics.jsonl``
reads each step once (the abandoned step 3 in ``metrics.superseded.jsonl``). ``kill -9`` of the
rollout rank names it as one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megarl.checkpoint.layout import COMPLETE_MARKER
from tests._run_outputs import read_metrics, rollout_prompts
from tests.checkpoint.test_trainer_checkpoint import (
    _largest_difference,
    _survivors,
    _wait_for,
    _weight_difference,
)
from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

SCORER = """
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None, hold=None, **kw):
    if "raise" in solution_str or (hold and os.path.exists(hold + ".raise")):
        raise ValueError("cannot score " + repr(solution_str[:20]))
    if hold and solution_str and os.path.exists(hold):  # not the pre-flight's empty response
        open(hold + ".scoring", "w").close()
        time.sleep(0.3)
    return len(solution_str) % 3 == 0  # a bool, which counts as 1.0 / 0.0 as in verl
"""
LAUNCH_TIMEOUT_S = 600
PPO = (
    "algorithm.adv_estimator=gae",
    "actor_rollout_ref.actor.ppo_epochs=2",  # the critic's too
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_ctrl.type=adaptive",
    "algorithm.kl_ctrl.kl_coef=0.2",
    "algorithm.kl_ctrl.target_kl=0.01",
    "algorithm.kl_ctrl.horizon=40",
    "trainer.total_training_steps=5",
    "trainer.save_freq=5",
)
"""The stop diamond's run: PPO with a critic, which is saved and restored beside the actor, and
the adaptive KL controller, whose coefficient is restored from trainer_state.json."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    from megarl.commands import data
    from megarl.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("faults")
    make_tiny_model(root / "model", family="qwen2")
    assert data.main(["synth", "--out", str(root / "data"), "--train-size", "64"]) == 0
    (root / "scorer.py").write_text(SCORER)
    return {"root": root, "model": root / "model", "data": root / "data"}


def _args(tiny: dict, run_dir: Path, *extra: str) -> list[str]:
    root = tiny["root"]
    return [
        "-c", "configs/grpo_tiny_cpu.yaml",
        f"actor_rollout_ref.model.path={tiny['model']}",
        f"data.train_files={tiny['data'] / 'train.parquet'}",
        f"data.val_files={tiny['data'] / 'test.parquet'}",
        "actor_rollout_ref.rollout.name=actor",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"custom_reward_function.path={root / 'scorer.py'}",
        "custom_reward_function.name=compute_score",
        f"+custom_reward_function.reward_kwargs.hold={root / 'hold'}",
        "trainer.total_training_steps=4",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=4",
        "reward_model.dump_samples=-1",
        f"trainer.rollout_data_dir={run_dir / 'rollouts'}",
        f"trainer.default_local_dir={run_dir}",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        *extra,
    ]  # fmt: skip


def _start(tiny: dict, run_dir: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    """``megarl train`` in its own session (as a shell's job), console output to a file;
    ``env`` added to its environment."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.pop("WORLD_SIZE", None)
    out = open(f"{run_dir}.{time.monotonic_ns()}.out", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "megarl.cli", "train", *_args(tiny, run_dir, *extra)],
        cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    proc.out_path = Path(out.name)  # type: ignore[attr-defined]
    return proc


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"launch timed out:\n{proc.out_path.read_text()[-6000:]}")
    return code, proc.out_path.read_text(errors="replace")


def _tree(proc: subprocess.Popen) -> list[psutil.Process]:
    root = psutil.Process(proc.pid)
    return [root, *root.children(recursive=True)]


def _announcements(run_dir: Path) -> int:
    """How many launches in ``run_dir`` have started training (rank0.log is appended to)."""
    log = run_dir / "logs" / "rank0.log"
    return log.read_text(errors="replace").count(" rank(s), TP ") if log.exists() else 0


def _announced(run_dir: Path, before: int = 0) -> bool:
    return _announcements(run_dir) > before


def _scoring_workers(tree: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in tree if "megarl.reward.worker" in " ".join(p.cmdline())]


def _stop(tiny: dict, run_dir: Path, sig: signal.Signals, step: int, during_scoring: bool) -> str:
    """Launch, send ``sig`` to the launcher at the chosen moment of ``step``, check the stop."""
    hold = tiny["root"] / "hold"
    (hold.parent / "hold.scoring").unlink(missing_ok=True)
    if during_scoring:
        hold.touch()
    before = _announcements(run_dir)
    proc = _start(tiny, run_dir, *PPO)
    _wait_for(lambda: _announced(run_dir, before), "the run to start")
    if during_scoring:
        _wait_for((hold.parent / "hold.scoring").exists, "scoring")
    tree = _tree(proc)
    assert len(_scoring_workers(tree)) == 4  # 2 per rank, in sessions of their own
    proc.send_signal(sig)
    hold.unlink(missing_ok=True)
    code, out = _finish(proc)
    assert code == 0, out[-4000:]
    assert f"megarl: {sig.name} received" in out and "Traceback" not in out, out
    assert f"stopped after step {step} ({sig.name} to megarl train);" in out, out
    assert "error" not in out and "STOP" not in out, out
    assert "megarl: finished" not in out, out
    _check_saved(run_dir, step)
    assert _survivors(tree, timeout=10) == []
    return out


def _stop_rank_1(tiny: dict, run_dir: Path, step: int) -> None:
    """Launch, send SIGTERM to rank 1 alone once the run started, check the stop."""
    before = _announcements(run_dir)
    proc = _start(tiny, run_dir, *PPO)
    _wait_for(lambda: _announced(run_dir, before), "the run to start")
    tree = _tree(proc)
    rank1 = next(
        p for p in tree if p.environ().get("RANK") == "1" and "megarl.trainer" in p.cmdline()
    )
    rank1.send_signal(signal.SIGTERM)
    code, out = _finish(proc)
    assert code == 0 and "Traceback" not in out and "error" not in out, out[-4000:]
    rank1_log = (run_dir / "logs" / "rank1.log").read_text()
    assert f"stopped after step {step} (SIGTERM on rank 1)" in rank1_log
    _check_saved(run_dir, step)
    assert _survivors(tree, timeout=10) == []


def _check_saved(run_dir: Path, step: int) -> None:
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == str(step)
    assert (run_dir / f"global_step_{step}" / "critic").is_dir()
    assert not (run_dir / "STOP").exists()


def test_stops_save_the_step_in_flight_and_the_relaunch_equals_the_uninterrupted_run(tiny):
    straight = tiny["root"] / "straight"
    code, out = _finish(_start(tiny, straight, *PPO))
    assert code == 0, out[-4000:]
    run_dir = tiny["root"] / "stopped"
    _stop(tiny, run_dir, signal.SIGUSR1, step=1, during_scoring=False)
    _stop(tiny, run_dir, signal.SIGTERM, step=2, during_scoring=True)
    _stop(tiny, run_dir, signal.SIGTERM, step=3, during_scoring=False)
    (run_dir / "global_step_3" / COMPLETE_MARKER).unlink()  # as if its save had not finished
    _stop_rank_1(tiny, run_dir, step=3)  # resumed from step 2: step 3 again
    code, out = _finish(_start(tiny, run_dir, *PPO))
    assert code == 0 and f"resumed from {run_dir / 'global_step_3'}" in out, out[-4000:]
    steps = (1, 2, 3, 4, 5)
    assert [r["step"] for r in _jsonl(run_dir / "metrics.jsonl")] == list(steps)
    assert [r["step"] for r in _jsonl(run_dir / "metrics.superseded.jsonl")] == [3]
    scored = [r for s in steps for r in _jsonl(straight / "rollouts" / f"{s}.jsonl")]
    assert {r["score"] for r in scored} == {0.0, 1.0}
    assert all(r["score"] == float(len(r["output"]) % 3 == 0) for r in scored)
    ref, got = read_metrics(straight), read_metrics(run_dir)
    assert "critic/vf_loss" in ref[5]
    coef = "actor/reward_kl_penalty_coeff"
    assert ref[2][coef] != 0.2  # adapted after step 1
    assert [got[s][coef] for s in steps] == [ref[s][coef] for s in steps]
    worst = max(_largest_difference(ref[s], got[s]) for s in steps)
    weights = _weight_difference(straight, run_dir, step=5)
    print(f"stop diamond: metrics {worst:.3g}, weights {weights:.3g}")
    assert worst == 0.0 and weights == 0.0
    assert all(rollout_prompts(straight, s) == rollout_prompts(run_dir, s) for s in steps)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_kill_9_of_the_launcher_leaves_nothing_running(tiny):
    run_dir = tiny["root"] / "launcher_killed"
    proc = _start(tiny, run_dir, "trainer.total_training_steps=500")  # far past the 40 s
    _wait_for(lambda: _announced(run_dir), "the run to start")
    tree = _tree(proc)
    assert len(tree) >= 7  # launcher, torchrun, 2 ranks, 4 scoring workers
    proc.kill()
    proc.wait()
    assert _survivors(tree, timeout=40) == []


def _kill_9_names_it(
    tiny: dict, run_dir: Path, rank: int, *extra: str, role: str = "", hold: Path | None = None
) -> None:
    """Launch, ``kill -9`` rank ``rank`` once the run started (with ``hold``: once the rollout
    rank is held by :mod:`tests.trainer._held_rollout` between two tokens of responses that go
    on after a weight update): exit 1, one line naming it (and ``role``) and SIGKILL, no
    traceback, nothing of the launch left."""
    env = None
    if hold is not None:
        env = {"MEGARL_TRAIN_MODULE": "tests.trainer._held_rollout",
               "MEGARL_TEST_HOLD": str(hold), "MEGARL_TEST_ROLLOUT_STEP_S": "0.03"}  # fmt: skip
        Path(f"{hold}.reached").unlink(missing_ok=True)
        hold.touch()
    proc = _start(tiny, run_dir, *extra, env=env)
    if hold is None:
        _wait_for(lambda: _announced(run_dir), "the run to start")
    else:
        _wait_for(lambda: Path(f"{hold}.reached").exists() or proc.poll() is not None,
                  "an update interrupting responses")  # fmt: skip
        assert Path(f"{hold}.reached").exists(), proc.out_path.read_text()[-4000:]
    tree = _tree(proc)
    module = "megarl.trainer" if hold is None else "tests.trainer._held_rollout"
    victim = next(p for p in tree if p.environ().get("RANK") == str(rank) and module in p.cmdline())
    victim.kill()
    if hold is not None:
        hold.unlink()
    code, out = _finish(proc)
    lines = [ln for ln in out.splitlines() if ln.startswith("error")]
    assert code == 1 and len(lines) == 1, out[-4000:]
    assert f"rank {rank} (pid {victim.pid}{role})" in lines[0] and "SIGKILL" in lines[0], lines
    assert "Traceback" not in out
    assert _survivors(tree, timeout=40) == []


def _multi_turn(tiny: dict) -> tuple[str, ...]:
    """Overrides for a multi-turn run whose every model turn is one token (every id ends a
    turn) answered by :class:`tests.trainer._hold_interaction.HoldInteraction`, which waits
    while ``<root>/hold`` exists."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tiny["root"]
    model = root / "model_mt"
    if not model.exists():
        shutil.copytree(tiny["model"], model)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        (model / "generation_config.json").write_text(
            json.dumps({"eos_token_id": list(range(vocab))})
        )
        rows = pq.read_table(tiny["data"] / "train.parquet").to_pylist()
        for row in rows:
            row["extra_info"] = {**row["extra_info"],
                                 "interaction_kwargs": {"name": "hold", "hold": str(root / "hold")}}  # fmt: skip
        pq.write_table(pa.Table.from_pylist(rows), root / "train_mt.parquet")
        (root / "hold.yaml").write_text(
            "interaction:\n  - name: hold\n"
            "    class_name: tests.trainer._hold_interaction.HoldInteraction\n    config: {}\n"
        )
    mt = "actor_rollout_ref.rollout.multi_turn"
    return (f"actor_rollout_ref.model.path={model}", f"data.train_files={root / 'train_mt.parquet'}",
            f"{mt}.enable=true", f"{mt}.interaction_config_path={root / 'hold.yaml'}",
            f"{mt}.max_user_turns=3")  # fmt: skip


def test_kill_9_of_one_rank_in_a_multi_turn_step_names_it_and_rank_0_leaves_the_tool_turn(tiny):
    """Issue 53: rank 1 killed while rank 0 is in a multi-turn step's interaction turn (a slow
    tool's place). The launcher names rank 1 (torchrun's root cause; it named rank 0, which
    torchrun had SIGKILLed), and rank 0 leaves the turn itself: its exit status in torchrun's
    report is its own, not the SIGKILL torchrun sends 30 s after its SIGTERM."""
    run_dir, hold = tiny["root"] / "rank_killed", tiny["root"] / "hold"
    hold.touch()
    try:
        proc = _start(tiny, run_dir, *_multi_turn(tiny))
        _wait_for(Path(f"{hold}.waiting").exists, "rank 0 in the interaction turn")
        tree = _tree(proc)
        victim = next(p for p in tree
                      if p.environ().get("RANK") == "1" and "megarl.trainer" in p.cmdline())  # fmt: skip
        victim.kill()
        code, out = _finish(proc)
    finally:
        hold.unlink(missing_ok=True)
    lines = re.findall(r"error: .*", out)  # (after the progress bar's line, not ended)
    assert code == 1 and len(lines) == 1, out[-4000:]
    assert f"rank 1 (pid {victim.pid})" in lines[0] and "SIGKILL" in lines[0], lines
    report = (run_dir / "logs" / "torchrun.log").read_text()
    rank0 = report[report.index("rank      : 0") :].splitlines()[1]
    assert "exitcode" in rank0 and "SIGKILL" not in rank0, report[-3000:]
    assert "Traceback" not in out
    assert _survivors(tree, timeout=40) == []


def test_an_error_inside_the_ranks_is_one_line_and_exit_2(tiny):
    run_dir = tiny["root"] / "scorer_raises"
    raising = tiny["root"] / "hold.raise"
    raising.touch()
    try:
        proc = _start(tiny, run_dir)
        _wait_for(lambda: _announced(run_dir), "the run to start")
        tree = _tree(proc)
        code, out = _finish(proc)
    finally:
        raising.unlink()
    errors = [ln for ln in out.splitlines() if ln.startswith("error")]
    assert code == 2 and len(errors) == 1 and out.count("error") == 1, out[-4000:]
    assert "cannot score" in errors[0] and str(run_dir / "logs") in errors[0], errors
    assert "Traceback" not in out and "ChildFailedError" not in out
    assert "ChildFailedError" in (run_dir / "logs" / "torchrun.log").read_text()
    assert _survivors(tree, timeout=40) == []


FULLY_ASYNC = (
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "async_training.staleness_threshold=1",
    "async_training.trigger_parameter_sync_step=2",
    "async_training.partial_rollout=true",
)
"""vLLM on a rank of its own after the 2 training ranks, fully async (issue 55: weights every 2
updates, partial rollouts; issue 26's one step off takes the same failure path)."""


def test_kill_9_of_the_rollout_rank_names_it(tiny):
    """vLLM on a rank of its own, fully async with partial rollouts (issues 26, 55): killing that
    rank in an interrupted-and-continuing generation (held after loading a weight update between
    two tokens of unfinished responses) ends the run in one line naming it as the rollout rank
    (issue 40), and nothing of the launch is left."""
    run_dir = tiny["root"] / "rollout_rank_killed"
    _kill_9_names_it(
        tiny, run_dir, 2, *FULLY_ASYNC, "trainer.total_training_steps=500",
        role=", a rollout rank (vLLM)", hold=tiny["root"] / "hold_rollout",
    )  # fmt: skip
