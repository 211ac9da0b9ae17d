"""``make test``'s runner (tools/run_tests.py): two pytest sessions over the two halves of
``tests/``, a failing lane failing the whole."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[1] / "tools" / "run_tests.py"
_spec = importlib.util.spec_from_file_location("run_tests", RUNNER)
run_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_tests)

pytestmark = pytest.mark.multirank  # two pytest processes


def test_each_lane_collects_its_half_and_a_lane_without_tests_fails_the_run(capfd):
    """Both lanes collect (more than 100 tests each), then deselect everything (pytest's exit 5,
    "no tests ran"): the run fails with 5."""
    code = run_tests.main(["--collect-only", "-m", "no_such_marker"])
    out = capfd.readouterr().out
    assert code == 5, out[-3000:]
    lane_1, lane_2 = out.split("---- lane 2:")
    counts = [re.search(r"(\d+) deselected", text) for text in (lane_1, lane_2)]
    assert all(counts) and all(int(c.group(1)) > 100 for c in counts), out[-3000:]
    assert "megarl tests: lane 1 exit 5, lane 2 exit 5" in lane_2
