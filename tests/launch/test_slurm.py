"""megarl's Slurm script on a real single-node Slurm, with stand-ins for the trainer.

``launch/ppo_72b.slurm`` runs unchanged: command-line ``sbatch`` options (``--nodes=1``, an
output file) and the documented variables (2 processes per node, the interpreter, the module
torchrun runs) point it at this CPU-only node. The node declares 8 GPUs backed by empty files,
so the script's ``--gpus-per-node=8`` is granted as written.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

SCRIPT = "launch/ppo_72b.slurm"
CONFIG = "configs/ppo_tiny_cpu.yaml"


def sbatch_cmd(tmp_path: Path, tiny: list[str], *, wait: bool, script: str = SCRIPT) -> list[str]:
    """``tiny``: overrides naming a tiny model and data (the job's pre-flight reads them)."""
    return [
        "sbatch", *(["--wait"] if wait else []), "--nodes=1", "--time=60",
        f"--output={tmp_path}/batch-%j.out", script, CONFIG,
        f"trainer.default_local_dir={tmp_path}/run", *tiny,
    ]  # fmt: skip


def job_id(first_line: str) -> str:
    match = re.fullmatch(r"Submitted batch job (\d+)\s*", first_line)
    assert match, first_line
    return match.group(1)


def wait_for_job(slurm, job: str, timeout: float = 300) -> int:
    """The job's exit status once it ended, 128 + N when signal N killed the batch script
    (``sbatch --wait`` polls at growing intervals and returned ~30 s after the job here; this
    polls every 0.5 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = slurm.run("scontrol", "show", "job", "-o", job).stdout
        state = re.search(r"JobState=(\S+)", info)
        if state and state.group(1) not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            code, signal = re.search(r" ExitCode=(\d+):(\d+)", info).groups()
            return 128 + int(signal) if int(signal) else int(code)
        time.sleep(0.5)
    pytest.fail(f"job {job} did not end within {timeout:.0f} s")


def node_log(tmp_path: Path, job: str, node: str) -> Path:
    return tmp_path / "run" / "logs" / f"job-{job}-0" / f"{node}.log"


# torchrun reports a failed worker as its own exit status 1.
@pytest.mark.parametrize(
    ("script", "exit_code", "job_status"),
    [(SCRIPT, 0, 0), (SCRIPT, 3, 1), ("launch/grpo_7b.slurm", 0, 0)],
)
def test_sbatch_runs_torchrun_over_gloo(
    slurm, job_env, tmp_path, tiny_overrides, script, exit_code, job_status
):
    env = {**job_env, "MEGARL_TRAIN_MODULE": "tests.launch._gloo_payload",
           "PAYLOAD_EXIT": str(exit_code)}  # fmt: skip
    # Polled (sbatch --wait, what users and CI run, returns the job's status too: the mistake
    # test below shows it, on a job that ends at once instead of ~18 s of sbatch's back-off).
    cmd = sbatch_cmd(tmp_path, tiny_overrides, wait=False, script=script)
    done = slurm.run(*cmd, env=env, timeout=600, cwd=REPO)
    job = job_id(done.stdout.splitlines()[0])
    status = wait_for_job(slurm, job)
    batch_out = (tmp_path / f"batch-{job}.out").read_text()
    assert status == job_status, batch_out
    # The --time of 60 min exceeds the script's USR1 lead time (20 min): no stop was asked for.
    assert "USR1" not in batch_out and not (tmp_path / "run" / "STOP").exists()
    args = f"--config {CONFIG} trainer.default_local_dir={tmp_path}/run "
    args += " ".join(tiny_overrides) + " trainer.n_gpus_per_node=2 trainer.nnodes=1"
    for rank in (0, 1):  # the ranks' stdout is the job's output; torchrun's is the node log
        assert f"rank {rank} of 2: sum 3, args {args}" in batch_out, batch_out
    assert f"trainer exited with status {job_status}" in batch_out
    if exit_code:  # one line naming the failure, torchrun's report only in the node log
        assert "Traceback" not in batch_out and "ChildFailedError" not in batch_out, batch_out
        assert "ChildFailedError" in node_log(tmp_path, job, slurm.node).read_text()
        assert "error: the ranks failed (" in batch_out, batch_out


def test_a_mistake_is_one_line_and_exit_2_before_anything_runs(slurm, job_env, tmp_path):
    """The job's pre-flight (``megarl train --check``): no node launched, one line names it;
    ``sbatch --wait`` returns the job's exit status."""
    tiny = ["data.train_files=/no/such/train.parquet"]
    done = slurm.run(*sbatch_cmd(tmp_path, tiny, wait=True), env=job_env, timeout=300, cwd=REPO)
    job = job_id(done.stdout.splitlines()[0])
    batch_out = (tmp_path / f"batch-{job}.out").read_text()
    assert done.returncode == 2, batch_out
    errors = [line for line in batch_out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "/no/such/train.parquet" in errors[0], batch_out
    assert "Traceback" not in batch_out and "trainer exited" not in batch_out, batch_out


def test_usr1_writes_the_stop_file_and_the_job_exits_cleanly(
    slurm, job_env, tmp_path, tiny_overrides
):
    env = {**job_env, "MEGARL_TRAIN_MODULE": "tests.launch._loop_payload"}
    submitted = slurm.run(*sbatch_cmd(tmp_path, tiny_overrides, wait=False), env=env, cwd=REPO)
    job = job_id(submitted.stdout)
    log = tmp_path / f"batch-{job}.out"  # the ranks' stdout
    # a timeout on polling the job log (no handle to wait on), not a timing claim
    deadline = time.monotonic() + 300
    while not (log.exists() and "rank 0 step 3" in log.read_text()):
        assert time.monotonic() < deadline, "the job did not start stepping within 300 s"
        time.sleep(0.5)
    cancel = slurm.run("scancel", "--signal=USR1", "--batch", job)
    assert cancel.returncode == 0, cancel.stderr
    assert wait_for_job(slurm, job) == 0, (tmp_path / f"batch-{job}.out").read_text()
    assert (tmp_path / "run" / "STOP").exists()
    batch_out = log.read_text()
    assert "rank 0 stopping after step" in batch_out and "rank 1 stopping after step" in batch_out
    assert "USR1 received: the trainer stops after this step" in batch_out
    assert "trainer exited with status 0" in batch_out
