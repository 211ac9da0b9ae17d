"""A rank's stop request (:mod:`megarl.checkpoint.stop`) in this process, signals included."""

from __future__ import annotations

import os
import signal

from megarl.checkpoint.stop import StopRequest


def test_repeated_stop_signals_are_one_request_and_the_stop_file_is_one_too(tmp_path):
    """Under Slurm each rank gets SIGTERM twice (slurmstepd and torchrun): still a save."""
    stop = StopRequest(tmp_path, rank=3).install()
    try:
        assert not stop.local()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # would raise KeyboardInterrupt if it escalated
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.local() and stop.reason == "SIGTERM on rank 3"
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is not stop._on_signal

    (tmp_path / "run").mkdir()
    relay = StopRequest(tmp_path / "run", rank=2, relay=True).install()  # a rollout rank
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert (tmp_path / "run" / "STOP").exists()  # what the training ranks read
    finally:
        relay.restore()
    relay.withdraw()  # at its end: no STOP left for a resumed run
    assert not (tmp_path / "run" / "STOP").exists()

    by_file = StopRequest(tmp_path, rank=0)
    (tmp_path / "STOP").touch()
    assert by_file.local() and by_file.reason == f"{tmp_path / 'STOP'} exists"
    by_file.consume_stop_file()
    assert not (tmp_path / "STOP").exists()
