"""Helpers of the tool tests: run a coroutine, write a file."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest


def run(coro):
    """The coroutine's result (each test runs its own event loop: no async plugin needed)."""
    return asyncio.run(coro)


@pytest.fixture
def write(tmp_path: Path):
    """``write(name, text)``: the dedented ``text`` as ``tmp_path/name``; its path."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text).lstrip("\n"))
        return path

    return _write
