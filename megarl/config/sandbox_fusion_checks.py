"""Checks of a Sandbox Fusion endpoint's settings (``reward.sandbox_fusion.*``, a tool's
``sandbox_fusion_url``), each problem one line; pure, so config validation runs them without the
client (:mod:`megarl.reward.scorers.sandbox_fusion`, which re-exports them)."""

from __future__ import annotations

import urllib.parse
from typing import Any

__all__ = ["config_problems", "url_problem"]


def url_problem(url: Any) -> str | None:
    """Why ``url`` cannot be a Sandbox Fusion endpoint (None: it can), checked at start-up."""
    if not isinstance(url, str) or not url.strip():
        return f"{url!r} is not a URL"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 -- raises on a port that is not a number
    except ValueError as exc:
        return f"{url!r} is not a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return (
            f"{url!r} is not an http(s) URL with a host (Sandbox Fusion's endpoint, e.g. "
            "http://localhost:8080/run_code)"
        )
    return None


def config_problems(section: Any, key: str = "reward.sandbox_fusion") -> list[str]:
    """One line per bad setting of a ``reward.sandbox_fusion`` section (url, max_concurrent,
    memory_limit_mb); an empty or null url means no service."""
    problems = []
    if section.url and (problem := url_problem(section.url)) is not None:
        problems.append(f"{key}.url: {problem}")
    for name in ("max_concurrent", "memory_limit_mb"):
        if getattr(section, name) < 1:
            problems.append(f"{key}.{name} must be >= 1, got {getattr(section, name)}")
    return problems
