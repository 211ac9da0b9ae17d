"""``megarl convert`` on bad inputs, interrupted, and crashing: one line, exit 2 (or 128+signal),
no output directory, and no process of the command left (checked by PID over its session).

Each command runs in a new session (``start_new_session``); its ranks lead their own process
groups but stay in that session, as do the checkpoint writers and helpers they start, even once
orphaned. So "every process of the command" is "every process of the session".
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from torch.distributed.checkpoint import FileSystemReader

from megarl.checkpoint.dist_ckpt import HOLD_SAVE_ENV
from megarl.checkpoint.meta import META_FILE
from megarl.commands import convert
from megarl.commands.convert_inputs import shard_extents
from tests.models._convert_cli import ENV, REPO

GONE_WITHIN_S = 40


def one_error_line(stderr: str, *needles: str) -> str:
    """The one ``error:`` line of ``stderr`` (beside rank 0's ``[megarl convert]`` progress)."""
    lines = [
        line
        for line in stderr.splitlines()
        if line.strip() and not line.startswith("[megarl convert]")
    ]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def start_convert(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "megarl.cli", "convert", *args],
        env=env or ENV,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def session_processes(sid: int) -> list[psutil.Process]:
    """Every live process of session ``sid`` (the command and all it started, orphans too)."""
    found = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return found


def kill_session(sid: int) -> None:
    """Test clean-up: SIGKILL whatever of the command's session is still alive."""
    for p in session_processes(sid):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def assert_all_gone(procs: list[psutil.Process], sid: int) -> None:
    """Wait (on the processes themselves) up to GONE_WITHIN_S for each to end."""
    _, alive = psutil.wait_procs(procs, timeout=GONE_WITHIN_S)
    left = {p.pid for p in alive} | {p.pid for p in session_processes(sid)}
    left = {pid for pid in left if _running(pid)}
    assert not left, sorted(left)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def ckpt(qwen2_tp2) -> Path:
    """qwen2's TP=2 checkpoint (conftest.py), written with --force over an older checkpoint's
    files."""
    return qwen2_tp2[0]


def test_force_over_an_older_checkpoint_leaves_only_the_new_files(ckpt: Path):
    names = {p.name for p in ckpt.iterdir()}
    assert not names & {"__9_9.distcp", "stale.txt"}
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "metadata.json", META_FILE} <= names
    assert json.loads((ckpt / "metadata.json").read_text())  # the new one, not "old"
    assert {name for name in names if not name.endswith(".distcp")} == {
        ".metadata", "metadata.json", "common.pt", META_FILE, convert.HF_FILES_DIR,
    }  # fmt: skip
    assert not ckpt.with_name(ckpt.name + ".incomplete").exists()


# -- bad inputs: refused by the launcher before any rank starts --------------------------------


def _truncated(src: Path, dst: Path, name: str, size: int) -> Path:
    shutil.copytree(src, dst)
    with (dst / name).open("r+b") as fh:
        fh.truncate(size)
    return dst


def _random_bytes(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / "model.safetensors").write_bytes(os.urandom(100_000))
    return dst


def _edited_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            del cfg[key]
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


class _Touch:
    """Unpickled, this would create the file ``path`` (a stand-in for any code in a pickle)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def _index_that_runs_code(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / ".metadata").write_bytes(pickle.dumps(_Touch(dst / "ran")))
    return dst


BAD_INPUTS = {
    # case: (make the input from (qwen2, ckpt, dst), argv flag, words the one line must hold)
    "truncated safetensors": (
        lambda q, c, d: _truncated(q, d, "model.safetensors", 1_000_000),
        "--hf-path",
        ("model.safetensors", "is truncated"),
    ),
    "random-bytes safetensors": (
        lambda q, c, d: _random_bytes(q, d),
        "--hf-path",
        ("model.safetensors", "is not a safetensors file"),
    ),
    "config without num_attention_heads": (
        lambda q, c, d: _edited_config(q, d, num_attention_heads=None),
        "--hf-path",
        ("config.json", "num_attention_heads"),
    ),
    "model_type contradicts architectures": (
        lambda q, c, d: _edited_config(q, d, model_type="llama"),
        "--hf-path",
        ("config.json", "model_type='llama'", "Qwen2ForCausalLM"),
    ),
    "index .metadata naming code": (
        lambda q, c, d: _index_that_runs_code(c, d),
        "--ckpt",
        (".metadata", "cannot read its index", "pathlib"),
    ),
    "truncated .distcp shard": (
        lambda q, c, d: _truncated(c, d, "__0_1.distcp", 1000),
        "--ckpt",
        ("__0_1.distcp", "is truncated"),
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_leaves_no_output(
    case: str, qwen2: Path, ckpt: Path, tmp_path: Path, capsys
):
    make, flag, needles = BAD_INPUTS[case]
    bad = make(qwen2, ckpt, tmp_path / "bad")
    command = "hf-to-megatron" if flag == "--hf-path" else "megatron-to-hf"
    out = tmp_path / "out"
    assert convert.main([command, flag, str(bad), "--out", str(out)]) == 2
    one_error_line(capsys.readouterr().err, str(bad), *needles)
    assert not out.exists() and not (tmp_path / "out.incomplete").exists()
    assert not (bad / "ran").exists()


def test_the_launcher_reads_shard_extents_as_torch_does(ckpt: Path):
    """The launcher's torch-free reading of the index agrees with torch's own reader."""
    storage = FileSystemReader(str(ckpt)).read_metadata().storage_data
    want: dict[str, int] = {}
    for info in storage.values():
        want[info.relative_path] = max(want.get(info.relative_path, 0), info.offset + info.length)
    assert shard_extents(ckpt / ".metadata") == want
    # the shards hold exactly the ranges the index reads
    assert want == {f.name: f.stat().st_size for f in ckpt.glob("*.distcp")}


def test_only_input_errors_exit_2_a_bug_is_a_crash(monkeypatch, capsys):
    """A ValueError out of the conversion's own code is a bug (exit 3, traceback), not input."""

    def buggy(args):
        raise ValueError("mapping bug")

    monkeypatch.setattr(convert, "_run_command", buggy)
    args = convert.build_parser().parse_args(["verify", "--ckpt", "c", "--hf-path", "h"])
    assert convert.run_rank(args) == convert.EXIT_CRASH
    assert "Traceback" in capsys.readouterr().err

    def bad_input(args):
        raise convert.ConvertError("--ckpt c: shard x is unreadable")

    monkeypatch.setattr(convert, "_run_command", bad_input)
    assert convert.run_rank(args) == convert.EXIT_USAGE
    one_error_line(capsys.readouterr().err, "shard x")


# -- processes: a crash in the ranks, an interrupted save --------------------------------------


@pytest.mark.multirank
def test_a_crash_on_corrupt_shards_leaves_no_process_and_no_output(ckpt: Path, tmp_path: Path):
    """Shards of the right size but garbage content pass the launcher's checks; the ranks fail
    reading them (torch's CheckpointException, a BaseException) and report it in one line."""
    bad = tmp_path / "garbage"
    shutil.copytree(ckpt, bad)
    rng = random.Random(0)  # fixed garbage: os.urandom's once began 0x80 (pickle's PROTO), and
    for shard in sorted(bad.glob("*.distcp")):  # torch's unpickler added a warning line
        shard.write_bytes(b"\0" + rng.randbytes(shard.stat().st_size - 1))
    out = tmp_path / "out"
    proc = start_convert("megatron-to-hf", "--ckpt", str(bad), "--out", str(out), "--tp", "2")
    try:
        tree = [psutil.Process(proc.pid)]
        while proc.poll() is None and len(tree) < 3:  # the launcher and its two ranks
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 2, err
        one_error_line(err, str(bad), "cannot read checkpoint")
        assert_all_gone(tree, proc.pid)
    finally:
        kill_session(proc.pid)
    assert not out.exists() and not (tmp_path / "out.incomplete").exists()


@pytest.mark.multirank
@pytest.mark.parametrize("signals", [("SIGINT", "SIGTERM"), ("SIGTERM",)])
def test_interrupting_a_save_stops_every_process_and_removes_the_output(
    signals: tuple[str, ...], qwen2: Path, tmp_path: Path
):
    """SIGINT (as Ctrl-C; a SIGTERM right after must not cut the clean-up short), or SIGTERM,
    to the launcher while both ranks' checkpoint writers are inside the save."""
    markers = tmp_path / "writers"
    markers.mkdir()
    out = tmp_path / "out"
    proc = start_convert(
        "hf-to-megatron", "--hf-path", str(qwen2), "--out", str(out), "--tp", "2",
        env={**ENV, HOLD_SAVE_ENV: str(markers)},
    )  # fmt: skip
    try:
        # Writers are forked per rank inside the save; each marks its start, then waits.
        while proc.poll() is None and len(list(markers.iterdir())) < 2:
            time.sleep(0.2)  # polling a directory: there is no handle to wait on
        assert proc.poll() is None, proc.communicate()[1]
        tree = session_processes(proc.pid)
        writers = {int(m.name.split("-")[1]) for m in markers.iterdir()}
        assert writers <= {p.pid for p in tree}
        assert (tmp_path / "out.incomplete").is_dir()
        for name in signals:
            os.kill(proc.pid, getattr(signal, name))
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 128 + getattr(signal, signals[0]), err
        one_error_line(err, f"interrupted ({signals[0]})")
        assert_all_gone(tree, proc.pid)
    finally:
        kill_session(proc.pid)
    assert not out.exists() and not (tmp_path / "out.incomplete").exists()
