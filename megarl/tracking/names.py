"""MLflow-safe names and values: injective sanitising, config flattening, truncation, batching.

MLflow (3.x) accepts metric and param names of at most 250 characters made of word characters
and ``/.- :`` that do not change under ``posixpath.normpath``, and param values of at most 6000
characters. Sanitising must be injective: two different megarl names must never become one
MLflow name, or one metric would silently overwrite another.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

MAX_KEY_LENGTH = 250
MAX_PARAM_VALUE_LENGTH = 6000
MAX_TAG_VALUE_LENGTH = 8000
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000

_ESCAPE = ":"
# ASCII only: the server validates with Python's \w too, but a name that differs from the
# user's only by an escaped letter is still readable, and ASCII keeps every backend happy.
_ALLOWED = re.compile(r"[A-Za-z0-9_/.\- ]")

T = TypeVar("T")


def _escape(char: str) -> str:
    return f"{_ESCAPE}{ord(char):x}{_ESCAPE}"


def sanitize_name(name: str) -> str:
    """``name`` in MLflow's allowed set, injectively.

    Every other character, and the escape character ``:`` itself, becomes
    ``:<hex code point>:`` ("a@b" → "a:40:b", distinct from "a_b"), as does a ``/`` or ``.`` that
    would make the name change under normpath (``a//b``, ``./a``, a leading or trailing ``/``).
    A name still longer than 250 characters keeps its first 238 and ends in ``:h`` + 10 hex
    digits of its SHA-1.
    """
    out = "".join(c if c != _ESCAPE and _ALLOWED.fullmatch(c) else _escape(c) for c in name)
    segments = out.split("/")
    # Dots that form a "." or ".." segment, and slashes that open, close or double a segment.
    segments = [s.replace(".", _escape(".")) if s in (".", "..") else s for s in segments]
    out = segments[0]
    for seg in segments[1:]:
        # An empty piece on either side: a leading, trailing or doubled slash.
        out += (_escape("/") if out == "" or seg == "" else "/") + seg
    if out == "":
        out = _ESCAPE + _ESCAPE  # the empty name: "::" (a real name never yields it)
    if len(out) > MAX_KEY_LENGTH:
        digest = hashlib.sha1(name.encode("utf-8", "surrogatepass")).hexdigest()[:10]
        out = f"{out[: MAX_KEY_LENGTH - 12]}{_ESCAPE}h{digest}"
    return out


def format_value(value: Any) -> str:
    """A config value as a param string: strings as is, everything else as JSON (``null``...)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def truncate(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters with a marker saying how long it was."""
    if len(text) <= limit:
        return text
    marker = f"...[truncated, {len(text)} chars; full value in the config artifact]"
    return text[: limit - len(marker)] + marker


def flatten_config(resolved: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config → ``{"a.b.c": value string}``; lists and empty dicts stay one value."""
    flat: dict[str, str] = {}
    for key, value in resolved.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, f"{dotted}."))
        else:
            flat[dotted] = format_value(value)
    return flat


def config_params(resolved: Mapping[str, Any]) -> dict[str, str]:
    """The resolved config as MLflow params: sanitised keys, values truncated with a marker."""
    return {
        sanitize_name(k): truncate(v, MAX_PARAM_VALUE_LENGTH)
        for k, v in flatten_config(resolved).items()
    }


def changed_keys(old: Mapping[str, str], new: Mapping[str, str]) -> list[str]:
    """Param keys whose value differs between two ``config_params`` results (or that one lacks)."""
    return sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))


def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """``items`` in consecutive slices of at most ``size`` (MLflow's per-batch limits)."""
    for start in range(0, len(items), size):
        yield items[start : start + size]
