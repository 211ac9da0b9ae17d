"""FAILED from a failing non-logging rank within a bound; no metric lost across server outages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.tracking import SenderOptions, make_sinks
from megarl.tracking.mlflow_ops import RunState
from tests.conftest import REPO, free_port
from tests.tracking.conftest import step_keys, wait_until

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("_worker.py")
NAMES = ["actor/pg_loss", "critic/score/mean", "a:40:b"]  # the worker's keys, sanitised
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def test_exception_on_rank_1_ends_the_run_failed_within_a_bound(tmp_path, mlflow_server, client):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(WORKER), "fail", str(run_dir), mlflow_server.uri,
    ]  # fmt: skip
    done = subprocess.run(cmd, env=ENV, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0, done.stderr[-3000:]
    assert "RuntimeError: injected failure" in done.stderr

    run = client.get_run(RunState.load(run_dir).run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["megarl.failure"] == "rank 1: RuntimeError: injected failure"
    failed_at = float((run_dir / "rank1_failed_at").read_text())
    # The bound: the sender polls markers every 0.5 s here and a request to a live server
    # takes well under a second; 30 s is generous for 2 busy cores and far below the
    # 30-minute process-group timeout this replaces.
    assert run.info.end_time / 1000 - failed_at < 30
    # Recorded by the logging rank's watcher while that rank was busy elsewhere (it waited for
    # it before calling finish("KILLED")), and the later KILLED did not overwrite it.
    assert (run_dir / "rank0_saw").read_text() == "FAILED sent=True"


def test_server_restarted_mid_run_loses_no_metric(tmp_path, mlflow_server, client):
    notes: list[str] = []
    options = SenderOptions(request_timeout_s=2, max_backoff_s=1, queue_size=4,
                            finish_timeout_s=120, poll_s=0.2)  # fmt: skip
    tracker = make_sinks(
        ["mlflow"], tmp_path, rank=0, world_size=1, project_name="outage",
        experiment_name="restart", tracking_uri=mlflow_server.uri, options=options,
        notify=notes.append,
    )  # fmt: skip
    try:
        for step in range(5):
            tracker.log_metrics(step, {k: float(step) for k in ("actor/pg_loss", "a@b")})
        wait_until(lambda: tracker.run_id and
                   len(client.get_metric_history(tracker.run_id, "a:40:b")) == 5, 60,
                   "steps 0-4 reaching the server")  # fmt: skip
        mlflow_server.stop()
        for step in range(5, 15):  # more steps than the queue holds: some are re-read later
            tracker.log_metrics(step, {k: float(step) for k in ("actor/pg_loss", "a@b")})
    finally:
        mlflow_server.start()
    for step in range(15, 20):
        tracker.log_metrics(step, {k: float(step) for k in ("actor/pg_loss", "a@b")})
    tracker.finish("FINISHED")

    names = ["actor/pg_loss", "a:40:b"]
    assert step_keys(client, tracker.run_id, names) == {(s, k) for s in range(20) for k in names}
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert any("does not answer" in n for n in notes) and any("answers again" in n for n in notes)


def test_run_ending_while_server_is_down_is_completed_by_sync(tmp_path, mlflow_server, client):
    run_dir = tmp_path / "run"
    worker = subprocess.Popen(
        [sys.executable, str(WORKER), "outage", str(run_dir), mlflow_server.uri],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: RunState.load(run_dir).run_id and
                   len(client.get_metric_history(RunState.load(run_dir).run_id, "a:40:b")) == 3,
                   60, "steps 0-2 reaching the server")  # fmt: skip
        mlflow_server.stop()
        (tmp_path / "server_down").touch()
        out, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err[-3000:]
    finally:
        worker.kill()
        mlflow_server.start()
    assert f"megarl tracking sync {run_dir}" in out
    run_id = RunState.load(run_dir).run_id
    assert step_keys(client, run_id, NAMES) == {(s, k) for s in range(3) for k in NAMES}
    assert client.get_run(run_id).info.status == "RUNNING"

    sync = [sys.executable, "-m", "megarl.commands.tracking", "sync", str(run_dir)]
    done = subprocess.run(sync, env=ENV, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "uploaded 15 metric value(s) of 5 step(s)" in done.stdout
    assert step_keys(client, run_id, NAMES) == {(s, k) for s in range(8) for k in NAMES}
    assert client.get_run(run_id).info.status == "FINISHED"
    again = subprocess.run(sync, env=ENV, check=False, capture_output=True, text=True, timeout=120)
    assert "uploaded 0 metric value(s) of 0 step(s)" in again.stdout


def test_sync_of_a_directory_without_mlflow_names_it(tmp_path):
    """A directory that is not a run, and a run without MLflow, are the input's mistakes: one
    line each, exit 2 (issue 40: exit 1, as for a server that does not answer)."""

    def sync() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "megarl.cli", "tracking", "sync", str(tmp_path)],
            env=ENV, check=False, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    done = sync()
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"error: {tmp_path} is not a run directory (no metrics.jsonl); `megarl tracking run-dir "
        "-c CONFIG` prints a config's\n"
    )
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "time": 0, "metrics": {}}\n')
    done = sync()
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"error: {tmp_path}/mlflow_run.json does not exist: {tmp_path} is the run directory of "
        "a run without trainer.logger mlflow, nothing to sync\n"
    )


def test_sync_to_a_dead_server_says_so_in_one_line(tmp_path):
    RunState(f"http://127.0.0.1:{free_port()}", "p", "e").save(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "megarl.commands.tracking", "sync", str(tmp_path), "--timeout=2"],
        env=ENV, check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.startswith("error: MLflow at http://127.0.0.1:")
    assert done.stderr.endswith(
        "does not answer (Connection refused); start it or pass --tracking-uri\n"
    )
