"""One real ``mlflow server`` per test session (it takes ~10-20 s to answer), shared by tests."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import pytest

from tests.tracking.mlflow_server import MlflowServer


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> Iterator[MlflowServer]:
    """A running server; a test that stops it must start it again before it returns."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def client(mlflow_server):
    """An ``MlflowClient`` on the session server."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=mlflow_server.uri)


def wait_until(ready: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``ready()`` until it is truthy; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # the server may still be coming up
            if ready():
                return
        time.sleep(0.25)
    pytest.fail(f"{what} did not happen within {timeout:.0f} s")


def step_keys(client, run_id: str, keys: list[str]) -> set[tuple[int, str]]:
    """Every (step, key) the server holds for ``keys`` of ``run_id``."""
    return {(m.step, k) for k in keys for m in client.get_metric_history(run_id, k)}
