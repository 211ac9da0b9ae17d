"""A real single-node Slurm for tests: installed from Debian when missing, started as root.

Recipe (../shared/DESIGN.md): ``munge slurmctld slurmd slurm-client`` from apt, munged run as
the ``munge`` user, ``slurmctld`` and ``slurmd`` in the foreground as root with
``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``, ``SelectType=select/cons_tres``,
no accounting, the node line from ``slurmd -C`` and every state directory under a temp dir.
There is no systemd: the daemons are started directly and stopped by PID. The node also
declares 8 GPUs backed by empty files, so a script's ``#SBATCH --gpus-per-node=8`` is honoured
as written on a machine without GPUs (``task/none`` puts no device cgroup around them).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")
BINARIES = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/bin/sbatch")
FAKE_GPUS = 8
SCHEDULER_PARAMETERS = "SchedulerParameters=batch_sched_delay=0"
"""A job submitted is started at once rather than at slurmctld's next batch pass: by default
(batch_sched_delay=3) a job submitted while the node finishes the one before waited up to 3 s,
which each of the suite's ~8 jobs paid (measured on sbatch of ``sleep 1`` back to back: 2.0-3.1 s
from submit to the end, 1.2-2.0 s with 0). Scheduling is otherwise Slurm's default."""


class SlurmSetupError(RuntimeError):
    """Slurm could not be installed or started (the message names the step)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_installed() -> None:
    """Install the Debian packages when any Slurm or munge binary is missing (needs root)."""
    if all(Path(b).exists() for b in BINARIES):
        return
    if os.geteuid() != 0:
        raise SlurmSetupError(f"Slurm is not installed and installing {PACKAGES} needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
    ):
        done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SlurmSetupError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")


@dataclass
class SlurmCluster:
    """A running single-node Slurm; ``env`` points Slurm's commands at its configuration."""

    root: Path
    node: str
    env: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)
    munged_pid: int | None = None

    def run(self, *cmd: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """Run a Slurm command (``sbatch``, ``squeue``, ...) against this cluster."""
        return subprocess.run(
            list(cmd),
            check=False,
            env=kw.pop("env", self.env),
            capture_output=True,
            text=True,
            timeout=timeout,
            **kw,
        )

    def stop(self) -> None:
        """Stop the daemons this cluster started, by PID."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self.munged_pid is not None:
            try:
                os.kill(self.munged_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def _start_munged() -> int | None:
    """Start munged unless one answers already; returns the PID of the one started here."""
    if (
        subprocess.run(
            "munge -n | unmunge", shell=True, capture_output=True, check=False
        ).returncode
        == 0
    ):
        return None
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        subprocess.run(["mungekey", "--create"], check=True, capture_output=True)
        shutil.chown(key, "munge", "munge")
    for d in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
        Path(d).mkdir(parents=True, exist_ok=True)
        shutil.chown(d, "munge", "munge")
    done = subprocess.run(
        ["runuser", "-u", "munge", "--", "/usr/sbin/munged"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SlurmSetupError(f"munged did not start: {done.stderr.strip()}")
    return int(Path("/run/munge/munged.pid").read_text().split()[0])


def _node_line() -> str:
    out = subprocess.run(["/usr/sbin/slurmd", "-C"], capture_output=True, text=True, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("NodeName="))
    return f"{line} Gres=gpu:{FAKE_GPUS} State=UNKNOWN"


def start(root: Path, *, timeout: float = 90) -> SlurmCluster:
    """Write a configuration under ``root``, start munged, slurmctld and slurmd; wait for idle."""
    ensure_installed()
    if os.geteuid() != 0:
        raise SlurmSetupError("the test Slurm runs its daemons as root")
    node = socket.gethostname().split(".")[0]
    for d in ("state", "spool", "log"):
        (root / d).mkdir(parents=True, exist_ok=True)
    gpus = root / "fake-gpu"
    gpus.mkdir(exist_ok=True)
    for i in range(FAKE_GPUS):
        (gpus / f"nvidia{i}").touch()
    conf = root / "slurm.conf"
    conf.write_text(
        f"""ClusterName=megarltest
SlurmctldHost={node}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
{SCHEDULER_PARAMETERS}
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
GresTypes=gpu
KillWait=10
{_node_line()}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
    )
    (root / "gres.conf").write_text(
        f"NodeName={node} Name=gpu File={gpus}/nvidia[0-{FAKE_GPUS - 1}]\n"
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    cluster = SlurmCluster(root=root, node=node, env=env)
    try:
        cluster.munged_pid = _start_munged()
        for daemon in ("slurmctld", "slurmd"):
            log = open(root / "log" / f"{daemon}.out", "w")  # noqa: SIM115 (lives with the daemon)
            cluster.procs.append(
                subprocess.Popen(
                    [f"/usr/sbin/{daemon}", "-D", "-f", str(conf)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            if daemon == "slurmctld":
                _wait(lambda: cluster.run("scontrol", "ping").returncode == 0, timeout, root)
        _wait(lambda: _node_state(cluster) == "idle", timeout, root)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _node_state(cluster: SlurmCluster) -> str:
    return cluster.run("sinfo", "-h", "-N", "-o", "%T").stdout.strip().rstrip("*")


def _wait(ready, timeout: float, root: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.5)
    logs = "".join(
        f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((root / "log").glob("*"))
    )
    raise SlurmSetupError(f"Slurm did not become ready within {timeout:.0f} s:\n{logs}")
