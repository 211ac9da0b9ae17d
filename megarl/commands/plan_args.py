"""Argument parsing for ``megarl plan``: every bad input is one ``error:`` line and exit 2."""

from __future__ import annotations

import argparse
from typing import NoReturn


class InputError(ValueError):
    """Bad command-line input; ``main`` prints it as one line and returns 2."""


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors raise :class:`InputError` instead of printing usage."""

    def error(self, message: str) -> NoReturn:
        raise InputError(message)


def positive_int(text: str) -> int:
    """``type=`` for sizes: an integer >= 1 (argparse prefixes the flag's name)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """``type=`` for amounts: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value
