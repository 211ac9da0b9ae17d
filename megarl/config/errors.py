"""``ConfigError`` and the "did you mean" helpers shared by loading and validation."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A configuration problem found before anything distributed starts.

    ``problems`` holds one message per problem; each names the keys and values involved.
    """

    def __init__(self, problems: str | Iterable[str]):
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(self._render())

    def _render(self) -> str:
        if len(self.problems) == 1:
            return self.problems[0]
        lines = [f"{len(self.problems)} problems in the configuration:"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


def close_matches(word: str, candidates: Iterable[str], n: int = 1) -> list[str]:
    """The ``n`` candidates closest to ``word`` (difflib ratio >= 0.6), best first."""
    return difflib.get_close_matches(word, list(candidates), n=n, cutoff=0.6)


def did_you_mean(word: str, candidates: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean 'prefix+match'?)`` for the closest candidate, or an empty string."""
    match = close_matches(word, candidates)
    return f" (did you mean '{prefix}{match[0]}'?)" if match else ""
