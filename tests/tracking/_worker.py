"""A stand-in for the trainer's use of the tracker, run as real processes by the tracking tests.

_worker.py fail RUN_DIR URI      under torchrun, 2 ranks: rank 1 raises after a few steps
_worker.py outage RUN_DIR URI    1 process: 3 steps, waits for RUN_DIR/../server_down,
                                 5 more steps, finish while the server is down, exit
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from megarl.tracking import SenderOptions, make_sinks
from megarl.tracking.mlflow_ops import RunState

KEYS = ("actor/pg_loss", "critic/score/mean", "a@b")


def metrics(step: int) -> dict[str, float]:
    return {k: step + i / 10 for i, k in enumerate(KEYS)}


def wait_for_failed(run_dir: Path, timeout: float) -> str:
    """The state file's status once FAILED has reached the server, or what it is at timeout."""
    deadline = time.time() + timeout  # a timeout, not a timing claim
    while True:
        state = RunState.load(run_dir)
        if (state.status == "FAILED" and state.status_sent) or time.time() > deadline:
            return f"{state.status} sent={state.status_sent}"
        time.sleep(0.2)


def fail(run_dir: Path, uri: str) -> int:
    rank = int(os.environ["RANK"])
    stop = []
    # The trainer's stop protocol: SIGTERM (sent by torchrun once rank 1 died) only sets a flag.
    signal.signal(signal.SIGTERM, lambda *_: stop.append(time.time()))
    tracker = make_sinks(
        ["mlflow"], run_dir, rank=rank, world_size=2, project_name="failure",
        experiment_name="rank1-raises", tracking_uri=uri, options=SenderOptions(poll_s=0.5),
    )  # fmt: skip
    try:
        tracker.log_config({"trainer": {"seed": 1}}, "trainer:\n  seed: 1\n")
        for step in range(600):
            tracker.log_metrics(step, metrics(step))
            if rank == 1 and step == 10:
                (run_dir / "rank1_failed_at").write_text(repr(time.time()))
                raise RuntimeError("injected failure")
            if stop:  # a stuck logging rank: does the watcher record FAILED without its help?
                (run_dir / "rank0_saw").write_text(wait_for_failed(run_dir, 25))
                tracker.finish("KILLED")
                return 0
            time.sleep(0.2)
        tracker.finish("FINISHED")
        return 0
    except BaseException as exc:
        tracker.fail(exc)
        raise


def outage(run_dir: Path, uri: str) -> int:
    notes: list[str] = []
    tracker = make_sinks(
        ["mlflow"], run_dir, rank=0, world_size=1, project_name="outage",
        experiment_name="ends-while-down", tracking_uri=uri, notify=notes.append,
        options=SenderOptions(request_timeout_s=2, max_backoff_s=1, finish_timeout_s=3),
    )  # fmt: skip
    tracker.log_config({"trainer": {"seed": 2}}, "trainer:\n  seed: 2\n")
    for step in range(3):
        tracker.log_metrics(step, metrics(step))
    while not (run_dir.parent / "server_down").exists():
        time.sleep(0.1)
    for step in range(3, 8):
        tracker.log_metrics(step, metrics(step))
    tracker.finish("FINISHED")
    print("\n".join(notes), flush=True)
    return 0


if __name__ == "__main__":
    mode, run_dir, uri = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    sys.exit({"fail": fail, "outage": outage}[mode](run_dir, uri))
