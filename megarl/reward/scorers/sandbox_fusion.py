"""A client of a Sandbox Fusion service (https://github.com/bytedance/SandboxFusion), as verl
0.9.1's ``verl.utils.reward_score.sandbox_fusion`` calls it (written from its behaviour).

:func:`call_sandbox_api` POSTs ``{code, language, stdin, compile_timeout, run_timeout,
memory_limit_MB, files: {}, fetch_files: []}`` as JSON to the URL given (the full
``.../run_code`` address, as in verl), with verl's request timeout (compile + run + 10 s) and
retries (a 504 Gateway Timeout is retried up to three attempts in all, 1 s then 2 s apart; any
other failure is final). It returns ``(reply, None)`` or ``(None, error)``, the error one line
naming the URL. :class:`SandboxFusionClient` adds the concurrency bound (``max_concurrent``
calls at once on this machine, across processes: :class:`MachineSlots`) and reports a failed call
in one log line, as verl logs it (the test fails; no traceback). :func:`run_program_remote` runs
the code scorer's driver (:func:`~.code_runner.driver_script`) there and maps the reply onto the
local runner's :class:`~.code_runner.Run`, so the scorer's rules and results are the same either
way: ``Success``/``Finished`` is the program's exit code as locally, ``TimeLimitExceeded`` a
timeout, a failed compile step a compile error; ``SandboxError``, any other state or a failed
call is a ``service_error`` (the test fails; verl's -1).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from megarl.config.sandbox_fusion_checks import config_problems, url_problem
from megarl.reward.scorers.code_runner import Run, driver_script, program_stdin, run_of_exit

__all__ = [
    "DEFAULT_MAX_CONCURRENT",
    "SUPPORTED_LANGUAGES",
    "MachineSlots",
    "SandboxFusionClient",
    "call_sandbox_api",
    "client_for",
    "config_problems",
    "run_program_remote",
    "url_problem",
]

logger = logging.getLogger(__name__)

MAX_RETRIES = 3
"""Attempts of one call when the service answers 504 (verl's)."""
INITIAL_RETRY_DELAY_S = 1.0
"""Wait before the second attempt; the n-th retry waits n times this (verl's linear backoff)."""
API_TIMEOUT_S = 10.0
"""Added to compile + run timeout for the HTTP request's own timeout (verl's)."""
DEFAULT_MAX_CONCURRENT = 64
"""verl's ``reward.sandbox_fusion.max_concurrent``."""
REPORT_EVERY_S = 10.0
"""A process logs a failed call at most this often (the count of failures goes with it)."""
SLOTS_DIR = Path("/tmp")
"""Where the concurrency slots' lock files live (scoring workers each get a TMPDIR of their own,
so it is fixed)."""

_LANGUAGES = (
    "python cpp nodejs go go_test java php csharp bash typescript sql rust cuda lua R perl D_ut "
    "ruby scala julia pytest junit kotlin_script jest verilog python_gpu lean swift racket"
)
SUPPORTED_LANGUAGES = tuple(_LANGUAGES.split())
"""Languages verl sends to the service (anything else is refused before a call)."""


def call_sandbox_api(
    url: str,
    code: str,
    stdin: str | None,
    compile_timeout: float,
    run_timeout: float,
    memory_limit_mb: int,
    language: str = "python",
) -> tuple[dict[str, Any] | None, str | None]:
    """One ``/run_code`` call with verl's timeout and retries (module docstring): ``(reply,
    None)``, or ``(None, error)`` with ``error`` one line naming ``url``."""
    where = f"Sandbox Fusion at {url}"
    if language not in SUPPORTED_LANGUAGES:
        return None, f"{where}: unsupported language {language!r}"
    payload = json.dumps(
        {
            "compile_timeout": compile_timeout,
            "run_timeout": run_timeout,
            "code": code,
            "stdin": stdin,
            "memory_limit_MB": memory_limit_mb,
            "language": language,
            "files": {},
            "fetch_files": [],
        }
    ).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    timeout = compile_timeout + run_timeout + API_TIMEOUT_S
    error = f"{where}: no attempt made"
    for attempt in range(1, MAX_RETRIES + 1):
        request = urllib.request.Request(url, data=payload, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 504:
                error = f"{where}: Gateway Timeout (504) on attempt {attempt}/{MAX_RETRIES}"
                if attempt < MAX_RETRIES:
                    time.sleep(INITIAL_RETRY_DELAY_S * attempt)
                continue
            return None, f"{where}: HTTP {exc.code} {exc.reason}"
        except (urllib.error.URLError, OSError) as exc:  # refused, unknown host, timed out
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):
                return None, f"{where}: no reply within {timeout:g} s"
            return None, f"{where}: unreachable ({_one_line(reason)})"
        try:
            reply = json.loads(body)
        except ValueError as exc:
            return None, f"{where}: the reply is not JSON ({_one_line(exc)})"
        if not isinstance(reply, dict):
            return None, f"{where}: the reply is not a JSON object"
        return reply, None
    return None, error


def _one_line(value: Any) -> str:
    return " ".join(str(value).split())


class MachineSlots:
    """At most ``count`` holders at once on this machine, across processes and threads: a holder
    locks one of ``count`` files (``flock``; a dead holder's lock goes with it)."""

    def __init__(self, key: str, count: int) -> None:
        if count < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {count}")
        digest = hashlib.sha1(key.encode()).hexdigest()[:16]
        self.dir = SLOTS_DIR / f"megarl-sandbox-fusion-{os.getuid()}-{digest}-{count}"
        self.count = count
        # flock is per open file: threads of one process need their own exclusion too
        self._taken = [threading.Lock() for _ in range(count)]
        self._fds: dict[int, int] = {}

    def _fd(self, slot: int) -> int:
        if slot not in self._fds:
            self.dir.mkdir(mode=0o700, exist_ok=True)
            self._fds[slot] = os.open(self.dir / f"slot-{slot}", os.O_RDWR | os.O_CREAT, 0o600)
        return self._fds[slot]

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Wait for a free slot and hold it for the ``with`` block."""
        delay = 0.002
        while True:
            for slot in random.sample(range(self.count), self.count):
                if not self._taken[slot].acquire(blocking=False):
                    continue
                try:
                    fcntl.flock(self._fd(slot), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    self._taken[slot].release()
                    continue
                try:
                    yield
                finally:
                    fcntl.flock(self._fds[slot], fcntl.LOCK_UN)
                    self._taken[slot].release()
                return
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


class SandboxFusionClient:
    """Calls to one service, at most ``max_concurrent`` at once on this machine (``slots_key``
    names the bound's group: the reward's and a tool's are separate, as in verl), each failure
    logged in one line (:data:`REPORT_EVERY_S` apart at most)."""

    def __init__(
        self, url: str, max_concurrent: int = DEFAULT_MAX_CONCURRENT, slots_key: str = "reward"
    ) -> None:
        if (problem := url_problem(url)) is not None:
            raise ValueError(f"sandbox_fusion url: {problem}")
        self.url = url
        self.slots = MachineSlots(f"{slots_key} {url}", int(max_concurrent))
        self._failures = 0
        self._reported = -REPORT_EVERY_S
        self._lock = threading.Lock()

    def run(
        self,
        code: str,
        stdin: str | None,
        timeout_s: float,
        memory_limit_mb: int,
        language: str = "python",
        semaphore: AbstractContextManager | None = None,
    ) -> dict[str, Any] | None:
        """The service's reply to running ``code`` (compile and run limits ``timeout_s`` each,
        as verl sends them), or None after reporting why there is none. ``semaphore`` (verl's
        ``concurrent_semaphore``) replaces the machine-wide bound when given."""
        with semaphore if semaphore is not None else self.slots.hold():
            reply, error = call_sandbox_api(
                self.url, code, stdin, timeout_s, timeout_s, memory_limit_mb, language
            )
        if error is None and reply.get("status") == "SandboxError":
            error = f"Sandbox Fusion at {self.url}: SandboxError: {_one_line(reply.get('message'))}"
        if error is not None:
            self.report(error)
            return None
        return reply

    def report(self, error: str) -> None:
        """Log ``error`` (one line) unless this process logged one within REPORT_EVERY_S."""
        with self._lock:
            self._failures += 1
            now = time.monotonic()
            if now - self._reported < REPORT_EVERY_S:
                return
            self._reported = now
            failures = self._failures
        logger.error("%s; the run counts as failed (%d failed call(s) here)", error, failures)


@functools.cache
def client_for(url: str, max_concurrent: int, slots_key: str = "reward") -> SandboxFusionClient:
    """This process's client of ``url`` (one per URL and bound)."""
    return SandboxFusionClient(url, max_concurrent, slots_key)


def run_program_remote(
    client: SandboxFusionClient,
    source: str,
    test_input: str | list[str],
    *,
    fn_name: str | None,
    timeout_s: float,
    memory_limit_mb: int,
    load_only: bool = False,
    semaphore: AbstractContextManager | None = None,
) -> Run:
    """:func:`~.code_runner.run_program`, run by the service (module docstring)."""
    code = driver_script(source, fn_name, load_only)
    stdin = program_stdin(test_input, fn_name)
    reply = client.run(code, stdin, timeout_s, memory_limit_mb, semaphore=semaphore)
    if reply is None:
        return Run("service_error")
    status = reply.get("status")
    compiled, ran = reply.get("compile_result") or {}, reply.get("run_result") or {}
    if status == "Failed" and (
        compiled.get("status") in ("Error", "TimeLimitExceeded")
        or (compiled.get("status") == "Finished" and compiled.get("return_code") != 0)
    ):
        return Run("compile_error")
    if status in ("Success", "Failed") and ran.get("status") == "TimeLimitExceeded":
        return Run("timeout")
    if status in ("Success", "Failed") and ran.get("status") == "Finished":
        return run_of_exit(True, ran.get("return_code"), ran.get("stdout") or "")
    if status == "Failed" and ran.get("status") == "Error":
        return Run("runtime_error")
    client.report(
        f"Sandbox Fusion at {client.url}: unexpected reply (status {status!r}, run status "
        f"{ran.get('status')!r})"
    )
    return Run("service_error")
