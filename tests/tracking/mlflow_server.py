"""A real ``mlflow server`` on 127.0.0.1 with a SQLite store, that a test can stop and restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.conftest import free_port


class MlflowServer:
    """``mlflow server`` on a free loopback port; ``stop``/``start`` keep the port and the store."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300) -> None:
        """Start the server and wait until ``/health`` answers (~20 s on 2 cores)."""
        cmd = [
            str(Path(sys.executable).parent / "mlflow"), "server",
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{self.root}/mlflow.db",
            "--artifacts-destination", str(self.root / "artifacts"),
        ]  # fmt: skip
        log = open(self.root / "server.log", "a")  # noqa: SIM115 (lives with the server)
        # Its own session: stop() signals the whole group (the server forks workers). Without
        # its job runner (GenAI jobs, unused here), whose store directory in /dev/shm the server
        # never removes: the suite left one per server start.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"mlflow server did not answer within {timeout:.0f} s:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """Stop the server (its process group, by PID) and wait until it is gone."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def log_tail(self) -> str:
        return (self.root / "server.log").read_text()[-3000:]
