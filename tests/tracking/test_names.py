"""Sanitising, flattening and truncation against MLflow's own validators (no server)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from mlflow.utils.validation import _validate_metric_name, _validate_param_name

from megarl.tracking import names
from megarl.tracking.sinks import console_line


def test_a_at_b_and_a_underscore_b_stay_distinct():
    assert names.sanitize_name("a@b") != names.sanitize_name("a_b")
    assert names.sanitize_name("a_b") == "a_b"
    _validate_metric_name(names.sanitize_name("a@b"))


def test_verl_metric_names_are_kept():
    for key in ("actor/pg_loss", "critic/score/mean", "timing_s/gen", "perf/throughput"):
        assert names.sanitize_name(key) == key


def test_names_normpath_would_change_are_escaped():
    for raw in ("a//b", "/a", "a/", "./a", "a/../b", "..", ".", "", "a:b", "é/ü", "x" * 400):
        name = names.sanitize_name(raw)
        _validate_metric_name(name)
        _validate_param_name(name)


@given(st.lists(st.text(max_size=300), min_size=2, max_size=2, unique=True))
def test_sanitising_is_injective_and_valid(pair):
    a, b = (names.sanitize_name(x) for x in pair)
    assert a != b
    _validate_metric_name(a)
    assert len(a) <= names.MAX_KEY_LENGTH


def test_flatten_truncate_and_changed_keys():
    cfg = {"a": {"b": {"c": 1.5e-6}, "l": [1, 2], "d": {}}, "s": "x" * 7000, "n": None}
    params = names.config_params(cfg)
    assert params["a.b.c"] == "1.5e-06"
    assert params["a.l"] == "[1, 2]" and params["a.d"] == "{}" and params["n"] == "null"
    assert len(params["s"]) == names.MAX_PARAM_VALUE_LENGTH
    assert params["s"].endswith("[truncated, 7000 chars; full value in the config artifact]")
    changed = names.config_params({**cfg, "a": {**cfg["a"], "b": {"c": 2.0}}, "new": 1})
    assert names.changed_keys(params, changed) == ["a.b.c", "new"]


def test_console_line_shows_the_chosen_keys_present():
    line = console_line(3, {"actor/pg_loss": -0.0123, "critic/score/mean": 0.5, "other": 1.0})
    assert line == "step 3 | score 0.500 | pg_loss -0.0123"
