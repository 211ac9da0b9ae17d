"""A real single-node Slurm per test session (installed from Debian when missing)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from tests.conftest import REPO
from tests.launch import slurm_cluster


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> Iterator[slurm_cluster.SlurmCluster]:
    """munge + slurmctld + slurmd, stopped by PID at the end. Never skips: a CI without Slurm
    installs it (root and Debian's apt needed), and a failure to start fails the tests."""
    cluster = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


@pytest.fixture
def job_env(slurm) -> dict[str, str]:
    """Environment for ``sbatch`` of megarl's scripts on this CPU-only node (2 processes)."""
    return job_environment(slurm)


def job_environment(slurm) -> dict[str, str]:
    """See :func:`job_env` (for fixtures of a wider scope)."""
    return {
        **slurm.env,
        "MEGARL_PYTHON": sys.executable,
        "MEGARL_GPUS_PER_NODE": "2",
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
    }
