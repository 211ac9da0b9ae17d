"""The planner tests run hermetic, as the config tests do: no real HF cache is consulted."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _hermetic(hermetic):
    """Every test here is hermetic (tests/conftest.py)."""
