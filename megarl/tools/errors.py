"""The one error type of tool and interaction loading."""

from __future__ import annotations

__all__ = ["ToolConfigError"]


class ToolConfigError(ValueError):
    """A tool config, function-tool file or interaction config cannot be used: one line naming
    the file, the entry and what is wrong."""
