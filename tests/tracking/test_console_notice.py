"""An MLflow server that does not answer is announced on the trainer's console, once, and does
not hold up the exit."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from megarl.tracking import make_tracker
from megarl.tracking.mlflow_sink import SenderOptions


def test_a_dead_server_is_announced_once_on_the_console_with_the_sync_remedy(tmp_path):
    trainer = SimpleNamespace(
        logger=["mlflow"], default_local_dir=str(tmp_path), project_name="p",
        experiment_name="e", tracking_uri="http://127.0.0.1:9", nnodes=1,
    )  # fmt: skip
    lines: list[str] = []
    # finish_timeout_s: a bound no test would wait out; finish must not use it when the server
    # is known to be down
    options = SenderOptions(request_timeout_s=1, max_backoff_s=1, finish_timeout_s=3600)
    tracker = make_tracker(
        SimpleNamespace(trainer=trainer), rank=0, world_size=1, console_write=lines.append,
        options=options,
    )  # fmt: skip
    tracker.log_metrics(1, {"a": 1.0})
    deadline = time.monotonic() + 60  # a timeout on the wait, not a timing claim
    while not any("does not answer" in line for line in lines):
        assert time.monotonic() < deadline, lines
        time.sleep(0.1)
    time.sleep(2)  # more failed attempts: still one notice
    finishing = threading.Thread(target=tracker.finish, args=("FINISHED",), daemon=True)
    finishing.start()
    finishing.join(timeout=60)  # a bound on a hang, not a timing claim
    assert not finishing.is_alive(), "finish waited for a server announced as down"
    down = [line for line in lines if "does not answer" in line]
    assert len(down) == 1 and down[0].startswith("megarl tracking: MLflow at http://127.0.0.1:9")
    assert f"megarl tracking sync {tmp_path}" in down[0]
