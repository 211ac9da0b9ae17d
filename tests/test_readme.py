"""The README stays a front door (at most 150 lines, its links resolve) and its cheap commands
run as written.

A cheap command is a line of a fenced code block that starts with ``megarl config`` or
``megarl plan`` once a leading ``.venv/bin/`` is dropped; backslash continuations are joined and
the ``# comment`` is cut off. The comment may state the documented outcome: ``exit N`` (else 0),
``DOES NOT FIT`` or ``FITS`` (the plan's verdict line). Each command runs as a process of the
installed ``megarl`` script beside this interpreter (``.venv/bin/megarl``, as the README writes
it) from the repository root, where the README's relative paths point.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_LINES = 150
CHEAP = ("megarl config ", "megarl plan ")
# So that the test cannot pass on a README that lost its examples: 2 validate, 3 plan today.
MIN_COMMANDS = {"megarl config validate": 1, "megarl plan": 2}


def code_blocks(text: str) -> list[str]:
    """The bodies of the fenced (```) code blocks of a Markdown text."""
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def cheap_commands(text: str) -> list[tuple[str, str]]:
    """(command without ``.venv/bin/``, its comment) of every cheap command in ``text``."""
    found = []
    for block in code_blocks(text):
        for line in re.sub(r"\\\n[ \t]*", " ", block).splitlines():
            command, _, comment = line.partition("#")
            command = command.strip().removeprefix(".venv/bin/")
            if command.startswith(CHEAP):
                found.append((" ".join(command.split()), comment.strip()))
    return found


COMMANDS = cheap_commands(README.read_text())


def megarl_argv() -> list[str]:
    """The ``megarl`` script installed beside this interpreter, else the module it runs."""
    script = Path(sys.executable).with_name("megarl")
    return [str(script)] if script.exists() else [sys.executable, "-m", "megarl.cli"]


def test_the_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES})"


def test_the_readme_links_resolve():
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [t for t in targets if "://" not in t]
    assert local, "no local links found"
    missing = [t for t in local if not (REPO / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_the_readme_has_cheap_commands():
    for prefix, least in MIN_COMMANDS.items():
        n = sum(command.startswith(prefix) for command, _ in COMMANDS)
        assert n >= least, f"README.md has {n} '{prefix}' commands, at least {least} expected"


@pytest.mark.parametrize(("command", "comment"), COMMANDS, ids=[c for c, _ in COMMANDS])
def test_readme_command_runs_as_written(command, comment, tmp_path):
    expected = re.search(r"\bexit (\d+)", comment)
    code = int(expected.group(1)) if expected else 0
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf-cache")}  # no model found by chance
    env.pop("WORLD_SIZE", None)
    result = subprocess.run(
        megarl_argv() + shlex.split(command)[1:],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    shown = f"$ {command}\nexit {result.returncode}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    assert result.returncode == code, shown
    assert "Traceback" not in result.stderr, shown
    if code:
        assert result.stderr.startswith("error: "), shown
    verdicts = [line for line in result.stdout.splitlines() if line.startswith("verdict: ")]
    if "DOES NOT FIT" in comment:
        assert verdicts and verdicts[0].startswith("verdict: DOES NOT FIT"), shown
    elif "FITS" in comment:
        assert verdicts and verdicts[0].startswith("verdict: FITS"), shown
