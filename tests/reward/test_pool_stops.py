"""Scoring workers and stops (issue 23): out of reach of torchrun's killpg of the rank, replaced
when a signal kills them anyway, and never outliving their rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from megarl.reward.loader import ScorerSpec
from megarl.reward.pool import ScoringPool
from tests.conftest import REPO
from tests.reward._files import CUSTOM


def _wait_ready(pool: ScoringPool) -> None:
    pool.score([(0, "src", "warm", "", None)] * len(pool.pids))


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # dead, not yet reaped
    except psutil.NoSuchProcess:
        return True


def _wait_dead(pid: int) -> None:
    deadline = time.monotonic() + 10  # a timeout on the wait, not a timing claim
    while not _dead(pid):
        assert time.monotonic() < deadline, f"worker {pid} still runs 10 s after SIGTERM"
        time.sleep(0.02)


def test_workers_have_their_own_session_and_a_killed_one_is_replaced(tmp_path):
    (tmp_path / "r.py").write_text(CUSTOM)
    with ScoringPool(ScorerSpec(str(tmp_path / "r.py"), "my_score"), 2, timeout_s=20) as pool:
        _wait_ready(pool)
        me = os.getsid(0)
        assert all(os.getsid(pid) == pid != me for pid in pool.pids)
        # What torchrun's killpg would have done to workers in the rank's session: an idle
        # worker killed by a signal is replaced before it gets a sample ...
        os.kill(pool.pids[0], signal.SIGTERM)
        _wait_dead(pool.pids[0])
        outcomes = pool.score([(i, "src", "abc", "", None) for i in range(4)])
        assert [o.status for o in outcomes] == ["ok"] * 4


def test_a_sample_whose_worker_is_killed_by_a_signal_is_scored_again(tmp_path):
    started = tmp_path / "started"  # the worker is in the sample: the kill lands mid-sample
    slow = CUSTOM.replace("time.sleep(600)", f"open({str(started)!r}, 'w').close(); time.sleep(2)")
    (tmp_path / "r.py").write_text(slow)
    with ScoringPool(ScorerSpec(str(tmp_path / "r.py"), "my_score"), 1, timeout_s=60) as pool:
        _wait_ready(pool)
        victim = pool.pids[0]
        killer = subprocess.Popen([sys.executable, "-c", (
            "import os, time\n"
            "deadline = time.monotonic() + 60  # a timeout on the wait, not a timing claim\n"
            f"while not os.path.exists({str(started)!r}) and time.monotonic() < deadline:\n"
            "    time.sleep(0.02)\n"
            f"os.kill({victim}, 15)\n"
        )])  # fmt: skip
        outcomes = pool.score([(0, "src", "sleep", "", None)])
        killer.wait()
        assert outcomes[0].status == "ok" and victim not in pool.pids


def test_busy_workers_die_with_their_rank(tmp_path):
    (tmp_path / "r.py").write_text(CUSTOM)
    script = textwrap.dedent(f"""
        import sys, time
        from megarl.reward.loader import ScorerSpec
        from megarl.reward.pool import ScoringPool
        pool = ScoringPool(ScorerSpec({str(tmp_path / "r.py")!r}, "my_score"), 2, timeout_s=20)
        pool.score([(0, "src", "a", "", None)] * 2)
        print(*pool.pids, flush=True)
        pool.score([(0, "src", "sleep", "", None)] * 2)  # both busy when the rank dies
    """)
    # the killed rank cannot remove its workers' directories: they go to tmp_path, not /tmp
    rank = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    pids = [int(p) for p in rank.stdout.readline().split()]
    assert len(pids) == 2
    rank.kill()
    rank.wait()
    deadline = time.monotonic() + 10  # a timeout on the wait, not a timing claim
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
        assert time.monotonic() < deadline, "scoring workers outlived their rank"
        time.sleep(0.1)
