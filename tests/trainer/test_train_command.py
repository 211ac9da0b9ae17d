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

from tests.checkpoint.test_trainer_checkpoint import _survivors
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
        # issue 40: a directory as a config file; a chat message without a role (was jinja's
        # "'dict object' has no attribute 'role'", naming neither file nor row)
        ("-c configs", "configs is a directory, not a config file (it holds _base.yaml"),
        ("data.train_files={no_role}", "no_role.parquet row 3: message 0 of the prompt has no 'role'"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(tiny, tmp_path, override, named):
    if "{no_role}" in override:
        import pyarrow as pa
        import pyarrow.parquet as pq

        train = next(o.split("=", 1)[1] for o in tiny if o.startswith("data.train_files="))
        rows = pq.read_table(train).to_pylist()
        rows[3]["prompt"] = [{"content": "no role here"}]
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "no_role.parquet")
        override = override.format(no_role=tmp_path / "no_role.parquet")
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
    return None if os.path.exists(HOLD + ".none") else 0.0
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


TRIES = 4  # two launches of each refusal (each pair about 14 s)


def _held_launch(tiny: list[str], root: Path) -> subprocess.Popen:
    """``megarl train`` whose pre-flight waits at the reward file (``<root>/hold``) and whose
    ranks are late (tests/trainer/_late_rank.py: they mark themselves in ``<root>/late`` and
    arm nothing until their torchrun has died)."""
    root.mkdir()
    (root / "late").mkdir()
    (root / "tmp").mkdir()
    scorer = root / "scorer.py"
    scorer.write_text(f"HOLD = {str(root / 'hold')!r}\n" + SLOW_TO_CHECK)
    env = {**os.environ, "TMPDIR": str(root / "tmp"), "OMP_NUM_THREADS": "1",
           "MEGARL_TRAIN_MODULE": "tests.trainer._late_rank",
           "MEGARL_TEST_LATE_RANKS": str(root / "late")}  # fmt: skip
    env.pop("WORLD_SIZE", None)
    return subprocess.Popen(
        [sys.executable, "-m", "megarl.cli", "train", "-c", CONFIG, *tiny,
         "actor_rollout_ref.rollout.name=actor", f"trainer.default_local_dir={root / 'run'}",
         f"custom_reward_function.path={scorer}"],
        cwd=REPO, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def _held_tree(proc: subprocess.Popen, root: Path) -> list[psutil.Process]:
    """Once both late ranks have started and the pre-flight waits at the reward file: the
    launcher and everything it started."""
    _wait(lambda: len(list((root / "late").iterdir())) == 2, "both ranks started")
    _wait(lambda: (root / "hold.checking").exists(), "the pre-flight at the reward file")
    launcher = psutil.Process(proc.pid)
    tree = [launcher, *launcher.children(recursive=True)]
    assert len(tree) == 4, [p.cmdline()[:4] for p in tree]  # launcher, torchrun, 2 ranks
    return tree


def test_a_refused_preflight_leaves_no_rank_running(tiny, tmp_path):
    """Issue 40: ranks that have not armed their parent-death signal when the pre-flight refuses
    the run (late ranks: a loaded machine) do not outlive ``megarl train``. TRIES refusals, two
    launches at a time, alternately a reward file that fails to load and a reward function
    returning None (found by the pre-flight's sample call before anything starts): each is
    the pre-flight's line, exit 2, and when ``megarl train`` has returned nothing it started
    runs and its temporary directory is gone. Then ``kill -9`` of the launcher in the middle of
    the pre-flight: the late ranks exit as soon as they run, their torchrun gone."""
    for first in range(0, TRIES, 2):
        pair = [(i, _held_launch(tiny, tmp_path / f"try{i}")) for i in (first, first + 1)]
        try:
            for i, proc in pair:
                root = tmp_path / f"try{i}"
                tree = _held_tree(proc, root)
                (root / ("hold.fail" if i % 2 == 0 else "hold.none")).touch()
                (root / "hold").touch()
                _, err = proc.communicate(timeout=120)
                lines = [line for line in err.splitlines() if line.strip()]
                assert proc.returncode == 2 and len(lines) == 1, (i, err[-3000:])
                named = "sandbox" if i % 2 == 0 else "returned score None"
                assert named in lines[0] and lines[0].startswith("error: "), lines
                assert _survivors(tree, timeout=0) == [], i
                assert left_behind(root / "tmp") == [], i
        finally:
            for _, proc in pair:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
    root, tree = tmp_path / "killed", []
    proc = _held_launch(tiny, root)
    try:
        tree = _held_tree(proc, root)
        proc.kill()
        proc.wait()
        assert _survivors(tree, timeout=15) == []
    finally:
        (root / "hold").touch()
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


SPLIT_HERE = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
              "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
              "async_training.staleness_threshold=1"]  # fmt: skip
"""One machine, vLLM on one rank of its own after the 2 training ranks (docs/off-policy.md)."""


def test_check_on_one_machine_says_what_would_start_and_warns_of_empty_prompts(tiny, tmp_path):
    """Issue 40: ``megarl train --check`` of a one-machine split run is checked as ``megarl
    train`` launches it here (it was refused as a multi-node launch of uneven nodes): exit 0, the run
    directory on stdout, what would start on stderr. Prompts without text (every other row) are
    one warning naming how many and the first rows: verl trains on them as they are."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    train = next(o.split("=", 1)[1] for o in tiny if o.startswith("data.train_files="))
    rows = pq.read_table(train).to_pylist()
    for i, row in enumerate(rows[::2]):
        row["prompt"] = [{"role": "user", "content": " \n" * (i % 2)}]  # empty, whitespace
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "half_empty.parquet")
    done = subprocess.run(
        [sys.executable, "-m", "megarl.cli", "train", "--check", "-c", CONFIG, *tiny,
         *SPLIT_HERE, f"data.train_files={tmp_path / 'half_empty.parquet'}",
         f"trainer.default_local_dir={tmp_path / 'run'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == f"{tmp_path / 'run'}\n"
    blank = len(rows[::2])
    warning = (
        f"warning: data.train_files: {blank} of {len(rows)} prompts are empty or whitespace "
        f"only ({tmp_path / 'half_empty.parquet'} row(s) 0, 2, 4, 6, 8, ...); they train as "
        "they are, as in verl"
    )
    checked = (
        "megarl: checked; megarl train would start 3 process(es) here: 2 training rank(s) "
        "(TP 2 × PP 1), then 1 rollout rank(s) of vLLM's own (1 replica(s) of TP 1), one step "
        "off"
    )
    assert done.stderr.splitlines() == [warning, checked], done.stderr


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
    assert train._nodes([CONFIG], overrides) == (3, 1, 0)
    assert train.main(["--check", "--nodes", "2", "-c", CONFIG, *tiny, *ROLLOUT_NODE, *run]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "run")
    assert train.main(["--check", "--nodes", "1", "-c", CONFIG, *tiny, *ROLLOUT_NODE, *run]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --nodes 1") and "rollout.nnodes=1" in err and "\n" not in err
    # a split run of uneven nodes: refused in a job's check as before (issue 40)
    uneven = [*tiny, *SPLIT_HERE, *run]
    assert train.main(["--check", "--nodes", "2", "-c", CONFIG, *uneven]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: actor_rollout_ref.rollout.n_gpus_per_node=1: on several nodes")


def test_a_teachers_pool_on_a_node_of_its_own_comes_after_vllms(tiny, tmp_path, capsys):
    """A vLLM distillation teacher's pool of ``distillation.nnodes`` nodes: the job's last
    nodes, after vLLM's own; trainer.nnodes = N less both. Its nodes run as many processes as
    every node (torchrun), and megarl train on one machine runs a pool of one node only: each
    else one line."""
    from megarl.commands import train

    model = next(o.split("=", 1)[1] for o in tiny if o.startswith("actor_rollout_ref.model.path"))
    pool = ["distillation.enabled=true", "distillation.nnodes=1", "distillation.n_gpus_per_node=2",
            f"+distillation.teacher_models.teacher_model.model_path={model}",
            "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=1",
            f"trainer.default_local_dir={tmp_path / 'run'}"]  # fmt: skip
    overrides, problem = train._training_nodes([CONFIG], [*tiny, *ROLLOUT_NODE, *pool], 3)
    assert problem is None and overrides[-1] == "trainer.nnodes=1"
    assert train._nodes([CONFIG], overrides) == (3, 2, 1)
    assert train.main(["--check", "--nodes", "3", "-c", CONFIG, *tiny, *ROLLOUT_NODE, *pool]) == 0
    capsys.readouterr()
    assert train.main(["--check", "--nodes", "2", "-c", CONFIG, *tiny, *ROLLOUT_NODE, *pool]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("rollout.nnodes=1 and distillation.nnodes=1"), err
    narrow = [*pool, "distillation.n_gpus_per_node=1"]
    assert train.main(["--check", "--nodes", "3", "-c", CONFIG, *tiny, *ROLLOUT_NODE, *narrow]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: distillation.n_gpus_per_node=1: on several nodes"), err
    assert train.main(["-c", CONFIG, *tiny, *pool, "distillation.nnodes=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: distillation.nnodes=2: a teachers' pool on several nodes is launched "
                   "by Slurm (launch/*.slurm) or torchrun on every node, not by megarl train")  # fmt: skip
    # two teachers whose keys name no data_source of the data: the pre-flight's one line
    two = [f"+distillation.teacher_models.{name}.{key}={value}" for name in ("math", "gsm")
           for key, value in (("key", name), ("model_path", model), ("num_replicas", 1),
                              ("inference.tensor_model_parallel_size", 1))]  # fmt: skip
    assert train.main(["--check", "-c", CONFIG, *tiny, *pool, *two]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: distillation.teacher_key=data_source: data.train_files: "), err
    assert "row 0 has " in err and err.endswith(
        "which no teacher's key names (math -> math, gsm -> gsm)"
    )


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


def test_cpu_ranks_share_the_machines_cores(tiny, tmp_path):
    """A CPU run's rank alone on this machine gets all its cores as intra-op threads, unless the
    user set ``OMP_NUM_THREADS``, which wins; seen by the rank ``megarl train`` launches
    (tests/trainer/_thread_rank.py)."""
    cores = len(os.sched_getaffinity(0))
    for user, expected in ((None, cores), ("1", 1)):
        out = tmp_path / f"threads-{user}"
        out.mkdir()
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "WORLD_SIZE")}
        env.update({"MEGARL_TRAIN_MODULE": "tests.trainer._thread_rank",
                    "MEGARL_TEST_THREADS": str(out), **({"OMP_NUM_THREADS": user} if user else {})})  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "megarl.cli", "train", "-c", CONFIG, *tiny,
             "trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
             "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
             f"trainer.default_local_dir={out / 'run'}"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        reports = sorted(p.read_text() for p in out.glob("rank*"))
        assert reports == [f"{expected} {expected}"], (user, reports)
