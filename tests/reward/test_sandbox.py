"""The OS sandbox model-written code runs in (megarl/reward/scorers/sandbox.py).

Each hostile program runs through the code runner the scorers and ``PythonTool`` use; each
attempt fails inside the sandbox and the next program runs normally. Where it says so, the same
program is run once without the sandbox (``MEGARL_CODE_SANDBOX=0``) to show the attempt would
have worked: the failure is the sandbox's doing. The fork bomb is bounded by RLIMIT_NPROC (the
bounded count is checked first, so a sandbox that stopped binding it never starts the bomb).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from megarl.reward.scorers import sandbox
from megarl.reward.scorers.code_runner import run_program
from megarl.tools.python_tool import PythonTool

LIMITS = {"fn_name": None, "timeout_s": 30.0, "memory_limit_mb": 512}


def run(program: str, **limits):
    return run_program(program, "", **{**LIMITS, **limits})


@pytest.fixture
def unsandboxed(monkeypatch):
    monkeypatch.setenv(sandbox.ENV_KEY, "0")


def _try(expr: str) -> str:
    """A program printing ``ok`` when ``expr`` runs, else the exception's class name."""
    return f"try:\n    {expr}\n    print('ok')\nexcept Exception as e:\n    print(type(e).__name__)"


@pytest.fixture
def run_dir(tmp_path):
    secret = tmp_path / "run" / "checkpoints" / "secret.txt"
    secret.parent.mkdir(parents=True)
    secret.write_text("weights")
    return secret


def test_the_run_directory_is_not_visible(run_dir):
    assert run(_try(f"open({str(run_dir)!r}).read()")).output == "FileNotFoundError\n"
    assert run(_try("open('/work/main/pyproject.toml').read()")).output == "FileNotFoundError\n"


def test_the_run_directory_is_readable_without_the_sandbox(run_dir, unsandboxed):
    assert run(_try(f"open({str(run_dir)!r}).read()")).output == "ok\n"


def test_only_the_scratch_directory_is_writable(tmp_path):
    for target in ("/etc/megarl_x", "/usr/megarl_x", "/megarl_x", str(tmp_path / "x")):
        out = run(_try(f"open({target!r}, 'w').write('x')")).output
        assert out in ("OSError\n", "PermissionError\n", "FileNotFoundError\n"), (target, out)
        assert not (tmp_path / "x").exists()
    assert run(_try("open('mine.txt', 'w').write('x'); open('/tmp/also', 'w')")).output == "ok\n"


def test_no_network_not_even_the_hosts_loopback(unused_tcp_listener):
    port = unused_tcp_listener.getsockname()[1]
    connect = f"__import__('socket').create_connection(('127.0.0.1', {port}), timeout=5)"
    assert run(_try(connect)).output == "ConnectionRefusedError\n"


def test_the_hosts_loopback_is_reachable_without_the_sandbox(unused_tcp_listener, unsandboxed):
    port = unused_tcp_listener.getsockname()[1]
    connect = f"__import__('socket').create_connection(('127.0.0.1', {port}), timeout=5)"
    assert run(_try(connect)).output == "ok\n"


@pytest.fixture
def unused_tcp_listener():
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server


def test_no_other_process_is_visible():
    program = "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
    pids = json.loads(run(program).output)
    assert len(pids) <= 3  # the sandbox's init, the program (and a process it may be forking)


def test_a_fork_bomb_is_bounded_and_the_run_goes_on():
    counted = (
        "import posix, time\nn = 0\ntry:\n    while n < 200:\n"
        "        if posix.fork() == 0:\n            time.sleep(20)\n            posix._exit(0)\n"
        "        n += 1\nexcept OSError as e:\n    print(n, type(e).__name__)"
    )
    n, error = run(counted).output.split()
    assert error == "BlockingIOError" and 0 < int(n) < sandbox.MAX_PROCESSES
    bomb = "import posix\nwhile True:\n    try:\n        posix.fork()\n    except OSError:\n        pass"
    assert run(bomb, timeout_s=2.0).status == "timeout"
    assert run("print(6 * 7)").output == "42\n"


def test_allocating_past_the_limit_fails_and_the_run_goes_on():
    assert run("x = bytearray(700 * 2**20)").status == "runtime_error"
    assert run(_try("x = bytearray(700 * 2**20)")).output == "MemoryError\n"
    assert run("x = bytearray(100 * 2**20)\nprint(len(x) >> 20)").output == "100\n"


def test_python_tool_runs_its_code_in_the_sandbox(run_dir):
    import asyncio

    tool = PythonTool({"default_timeout": 30, "memory_limit_mb": 512})
    code = f"print(open({str(run_dir)!r}).read())"
    response, _, _ = asyncio.run(tool.execute("i", {"code": code}))
    assert "FileNotFoundError" in response.text and "weights" not in response.text


def test_an_interpreter_under_tmp_runs_sandboxed(tmp_path, run_dir):
    """A checkout (and its venv) under /tmp: the scratch directory mounted on /tmp must not hide
    the interpreter's prefix, and shows nothing else of the host's /tmp (the run directory)."""
    venv = tmp_path / "clone" / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "megarl_dev.pth").write_text("\n".join(sys.path[1:]) + "\n")  # megarl and its deps
    probe = (
        "from megarl.reward.scorers import sandbox\n"
        "from megarl.reward.scorers.code_runner import run_program\n"
        "assert sandbox.sandbox_problem() is None, sandbox.sandbox_problem()\n"
        f"program = {_try(f'open({str(run_dir)!r}).read()')!r} + '\\nprint(6 * 7)'\n"
        "print(run_program(program, '', fn_name=None, timeout_s=30.0, memory_limit_mb=512).output)"
    )
    # TMPDIR 0700, as a scoring worker's (megarl/reward/pool.py): the probe must not need it
    tmpdir = tempfile.mkdtemp(dir=tmp_path)
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe],
        capture_output=True, text=True, check=False, env={**os.environ, "TMPDIR": tmpdir},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["FileNotFoundError", "42"]


def test_a_machine_without_bubblewrap_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap there
    sandbox.sandbox_problem.cache_clear()
    try:
        with pytest.raises(sandbox.SandboxError) as err:
            sandbox.require_sandbox()
        message = str(err.value)
        assert "\n" not in message and "bwrap is not on PATH" in message
        assert sandbox.OPT_OUT in message
        with pytest.raises(sandbox.SandboxError):
            PythonTool({})
        # a tool config naming verl's sandbox tool: the pre-flight's one ToolConfigError line
        from megarl.tools.errors import ToolConfigError
        from megarl.tools.registry import load_all_tools

        tools = tmp_path / "tools.yaml"
        tools.write_text(
            "tools:\n  - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool\n"
            "    config: {type: native}\n"
        )
        with pytest.raises(ToolConfigError, match=r"tools\[0\].*SandboxError: .*code_sandbox"):
            load_all_tools(tools, None)
        # megarl train's pre-flight, for a code data source (the ranks are never started)
        from megarl.commands import train
        from megarl.config import load_config

        cfg = load_config(["configs/grpo_tiny_cpu.yaml"], [])
        line = train._check_reward(cfg, {"apps"}, None)
        assert line.startswith("data: data_source 'apps': model-written code cannot be sandboxed")
        assert train._check_reward(cfg, {"openai/gsm8k"}, None) is None  # no code runs
        monkeypatch.setenv(sandbox.ENV_KEY, "0")  # the opt-out
        sandbox.require_sandbox()
        PythonTool({})
        assert train._check_reward(cfg, {"apps"}, None) is None
    finally:
        sandbox.sandbox_problem.cache_clear()


def test_per_call_overhead_benchmark():
    """A benchmark line (-s shows it), not a timed assertion."""
    argv = [sys.executable, "-I", "-c", "pass"]
    times = {}
    for name in ("plain", "sandboxed"):
        start = time.perf_counter()
        for _ in range(5):
            with tempfile.TemporaryDirectory() as tmp:
                cmd = sandbox.sandbox_argv(argv, tmp) if name == "sandboxed" else argv
                assert subprocess.run(cmd, check=False).returncode == 0
        times[name] = (time.perf_counter() - start) / 5
    print(f"\nsandbox per call: {1e3 * (times['sandboxed'] - times['plain']):.0f} ms over "
          f"{1e3 * times['plain']:.0f} ms for a bare interpreter start")  # fmt: skip
