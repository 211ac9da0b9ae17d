"""Bad input to ``megarl train`` gets one line and exit 2 before any rank has done anything."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, left_behind

CONFIG = "configs/grpo_tiny_cpu.yaml"


@pytest.fixture
def tiny(tiny_overrides) -> list[str]:
    return tiny_overrides


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("data.train_files=/nonexistent/train.parquet", "/nonexistent/train.parquet"),
        (
            "data.max_prompt_length=4 data.filter_overlong_prompts=false data.truncation=error",
            "row",
        ),
        ("actor_rollout_ref.actor.ppo_mini_batch_size=3", "ppo_mini_batch_size"),
        ("reward_model.enable=true", "reward_model"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tiny, override, named):
    done = subprocess.run(
        [sys.executable, "-m", "megarl.cli", "train", "-c", CONFIG, *tiny, *override.split()],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert named in lines[0] and "Traceback" not in done.stderr


SLOW_TO_CHECK = """
import os, time

if "RANK" not in os.environ:  # the launcher's pre-flight loads this file: hold it there
    open(HOLD + ".checking", "w").close()
    while not os.path.exists(HOLD):
        time.sleep(0.05)
    if os.path.exists(HOLD + ".fail"):
        raise ImportError("no module named 'sandbox'")

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0
"""


def _wait(predicate, what: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_ranks_start_during_the_preflight_and_wait_for_it(tiny, tmp_path):
    """The ranks import while ``megarl train`` checks the run, then wait at its gate: held there
    by a pre-flight that has not finished, they have written nothing; when it then fails, the
    one line is the pre-flight's and no process, log or temporary file is left."""
    hold = tmp_path / "hold"
    scorer = tmp_path / "scorer.py"
    scorer.write_text(f"HOLD = {str(hold)!r}\n" + SLOW_TO_CHECK)
    run_dir, gates = tmp_path / "run", tmp_path / "tmp"
    gates.mkdir()
    env = {**os.environ, "TMPDIR": str(gates), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "megarl.cli", "train", "-c", CONFIG, *tiny,
         "actor_rollout_ref.rollout.name=actor", f"trainer.default_local_dir={run_dir}",
         f"custom_reward_function.path={scorer}", "custom_reward_function.name=compute_score"],
        cwd=REPO, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        _wait(lambda: Path(f"{hold}.checking").exists(), "the pre-flight to load the scorer")
        _wait(lambda: len(list(gates.glob("megarl-launch-*/go.waiting.rank*"))) == 2,
              "both ranks at the gate")  # fmt: skip
        tree = psutil.Process(proc.pid).children(recursive=True)
        ranks = [p for p in tree if "torch.distributed.run" not in " ".join(p.cmdline())]
        assert len(ranks) == 2
        time.sleep(2)  # a rank through the gate would open its log at once
        assert not (run_dir / "logs").exists(), list((run_dir / "logs").iterdir())
        Path(f"{hold}.fail").touch()
        hold.touch()
        _, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2, err[-3000:]
    assert len(lines) == 1 and "custom_reward_function.path=" in lines[0], lines
    assert "sandbox" in lines[0]
    _wait(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks),
          "the ranks to end", timeout=10)  # fmt: skip
    assert not (run_dir / "logs").exists() and left_behind(gates) == []


ROLLOUT_NODE = ["actor_rollout_ref.rollout.nnodes=1",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]  # fmt: skip
"""vLLM on a node of its own (issue 26): the node's ranks hold TP-1 replicas."""


def test_the_jobs_nodes_less_vllms_are_the_training_nodes(tiny, tmp_path, capsys):
    """``--nodes N`` (the Slurm job script's allocation): trainer.nnodes = N less rollout.nnodes,
    and the launch spans both; a job with no node left for training is one line, exit 2."""
    from megarl.commands import train

    run = [f"trainer.default_local_dir={tmp_path / 'run'}"]
    overrides, problem = train._training_nodes([CONFIG], [*tiny, *ROLLOUT_NODE], 3)
    assert problem is None and overrides[-1] == "trainer.nnodes=2"
    assert train._nnodes([CONFIG], overrides) == 3
    assert train.main(["--check", "--nodes", "2", "-c", CONFIG, *tiny, *ROLLOUT_NODE, *run]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "run")
    assert train.main(["--check", "--nodes", "1", "-c", CONFIG, *tiny, *ROLLOUT_NODE, *run]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --nodes 1") and "rollout.nnodes=1" in err and "\n" not in err


@pytest.mark.parametrize(
    ("override", "multinode", "named"),
    [
        ("actor_rollout_ref.rollout.nnodes=2", False, "actor_rollout_ref.rollout.nnodes=2"),
        ("actor_rollout_ref.rollout.n_gpus_per_node=1", True, "rollout.n_gpus_per_node=1"),
    ],
)
def test_vllms_nodes_need_a_multi_node_launch_of_even_nodes(tiny, override, multinode, named):
    """Nodes of vLLM's own come from a multi-node launch, whose nodes all run
    trainer.n_gpus_per_node processes (torchrun); on one node, rollout.nnodes=1 puts the rollout
    ranks after the training ones."""
    from megarl.commands import train

    cfg, problem = train._load([CONFIG], [*tiny, *ROLLOUT_NODE, override], multinode=multinode)
    assert cfg is None and named in problem, problem
    cfg, problem = train._load([CONFIG], [*tiny, *ROLLOUT_NODE], multinode=multinode)
    assert problem is None
