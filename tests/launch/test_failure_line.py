"""The launcher's one line for a failed torchrun (:func:`megarl.commands.launch._failure_summary`)
on torchrun's own report: the rank it names is torchrun's root cause.

The report is torch 2.13's ``ChildFailedError`` text as a real launch wrote it
(``kill -9`` of rank 1 of a 2-rank multi-turn run): the other failures first, the root cause
(the first failure) last. When rank 0 sits where it cannot act on torchrun's SIGTERM, torchrun
SIGKILLs it after its grace period, so both ranks show SIGKILL and the launcher named rank 0.
"""

from __future__ import annotations

from megarl.commands.launch import _failure_summary

REPORT = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
megarl.trainer FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_23:52:35
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : {rank0} (pid: 16856) {rank0_signal}
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_23:52:04
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 16857)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 16857
============================================================
"""


def _line(tmp_path, rank0: str, rank0_signal: str = "") -> tuple[str, int]:
    log = tmp_path / "torchrun.log"
    log.write_text("earlier output\n" + REPORT.format(rank0=rank0, rank0_signal=rank0_signal))
    return _failure_summary(log, [], 1)


def test_the_root_cause_is_named_when_torchrun_sigkilled_a_survivor_too(tmp_path):
    line, code = _line(tmp_path, "-9", " (SIGKILL)")  # rank 0: torchrun's SIGKILL after 30 s
    assert code == 1 and line.startswith("error: rank 1 (pid 16857) on localhost died of SIGKILL")


def test_the_root_cause_is_named_when_the_survivor_exited_itself(tmp_path):
    line, code = _line(tmp_path, "1")  # rank 0 left on its own ("Connection closed by peer")
    assert code == 1 and line.startswith("error: rank 1 (pid 16857) on localhost died of SIGKILL")


def test_a_distillation_teachers_rank_is_named_as_such(tmp_path):
    """Rank 1 of 2 as the teacher's (one training rank, no rollout ranks) and as a rollout
    rank."""
    log = tmp_path / "torchrun.log"
    log.write_text(REPORT.format(rank0="1", rank0_signal=""))
    line, _ = _failure_summary(log, [], 1, training_ranks=1, first_teacher_rank=1)
    assert line.startswith("error: rank 1 (pid 16857, a distillation teacher's rank (vLLM)) on")
    line, _ = _failure_summary(log, [], 1, training_ranks=1)
    assert line.startswith("error: rank 1 (pid 16857, a rollout rank (vLLM)) on")
