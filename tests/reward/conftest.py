"""Fixtures: the tiny model's tokenizer (built in-process, nothing written)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    from megarl.models.tiny import build_tokenizer

    return build_tokenizer()
