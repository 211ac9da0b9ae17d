"""One stop protocol for preemption, time limits and operators.

The first SIGTERM or SIGUSR1 on any rank, or a ``STOP`` file in the run directory (the Slurm
USR1 trap in launch/_slurm_job.sh and ``megarl train`` on a signal write it, with the signal as
its text, which the stop line gives), asks the run to stop: the request is all-reduced
once per step (:meth:`StopRequest.agreed`), so every rank finishes the step, saves a checkpoint
and exits 0 together; the honoured ``STOP`` file is then removed, so a requeued job trains on.
SIGINT means exit now without saving (``KeyboardInterrupt``). A rank outside the training world
(``relay``: a rollout rank of a split launch) passes a signal on as the ``STOP`` file instead.
torchrun SIGKILLs its workers 30 s after forwarding SIGTERM; for large models size the Slurm
lead time (``--signal=B:USR1@<s>``), which has no such timer.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

from megarl.tracking.paths import STOP_FILE

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """This rank's view of a stop request (the protocol: the module docstring).

    ``install()`` must run in the main thread (Python delivers signals there).
    """

    def __init__(self, run_dir: Path, rank: int, *, relay: bool = False) -> None:
        self.stop_file = Path(run_dir) / STOP_FILE
        self.rank = rank
        self.relay = relay
        """Pass a signal on as the ``STOP`` file (a rank the training ranks stop)."""
        self._relayed = False
        self.reason: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequest:
        """Take over SIGTERM and SIGUSR1 (SIGINT keeps Python's KeyboardInterrupt)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def restore(self) -> None:
        """Give the signals back to their previous handlers."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.reason is not None:
            # The same request again, not an escalation: under Slurm each rank gets SIGTERM from
            # slurmstepd and once more from torchrun; the launchers turn an operator's second
            # signal into SIGINT (megarl.commands.launch).
            return
        self.reason = f"{name} on rank {self.rank}"
        # os.write, not print: a handler may interrupt a print in progress.
        message = f"megarl: {name} received: stopping after this step with a checkpoint\n"
        if self.relay:
            try:
                self.stop_file.write_text(f"{self.reason}\n")  # the training ranks' reason
                self._relayed = True
                message = (f"megarl: {name} received on rank {self.rank}: the training ranks stop "
                           "after this step with a checkpoint\n")  # fmt: skip
            except OSError as exc:  # never raise here: the handler runs at any line of the rank
                message = f"megarl: {name} received on rank {self.rank}, not passed on: {exc}\n"
        os.write(2, message.encode())

    def local(self) -> bool:
        """This rank has been asked to stop (a signal, or the STOP file exists)."""
        if self.reason is None and self.stop_file.exists():
            self.reason = _stop_file_reason(self.stop_file)
        return self.reason is not None

    def agreed(self) -> bool:
        """Whether any rank was asked to stop (collective: call it once per step everywhere)."""
        flag = torch.tensor([1.0 if self.local() else 0.0])
        if dist.is_initialized():
            flag = flag.to(_flag_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def withdraw(self) -> None:
        """Remove the ``STOP`` file this rank wrote (``relay``), if it is still there: the
        training ranks honoured it or are gone, and a resumed run must not stop on it."""
        if self._relayed:
            self.stop_file.unlink(missing_ok=True)

    def consume_stop_file(self) -> None:
        """Remove the honoured STOP file (rank 0, after the checkpoint is complete)."""
        self.stop_file.unlink(missing_ok=True)


def _stop_file_reason(stop_file: Path) -> str:
    """Why the run stops, from a ``STOP`` file: its first line (which signal, to whom), else
    that the file exists (an operator's ``touch``)."""
    try:
        with open(stop_file, encoding="utf-8", errors="replace") as f:
            text = " ".join(f.readline(200).split())
    except OSError:  # removed meanwhile (honoured by another rank): still a request
        text = ""
    return text or f"{stop_file} exists"


def _flag_device() -> torch.device:
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
