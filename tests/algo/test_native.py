"""Building, caching and running the C kernels of megarl.algo.native."""

from __future__ import annotations

import logging
import time

import torch

from megarl.algo import compute_gae_advantage_return, native
from megarl.algo.gae import gae_vectorized


def test_builds_into_the_cache_directory_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGARL_CACHE_DIR", str(tmp_path))
    assert native._build_and_load("gae_kernel") is not None
    (built,) = (tmp_path / "native").glob("gae_kernel-*.so")
    stamp = built.stat().st_mtime_ns
    assert native._build_and_load("gae_kernel") is not None
    assert [p.name for p in (tmp_path / "native").iterdir()] == [built.name]  # no leftovers
    assert built.stat().st_mtime_ns == stamp


def test_disabled_or_unbuildable_kernels_fall_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MEGARL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MEGARL_NATIVE", "0")
    assert native._build_and_load("gae_kernel") is None
    monkeypatch.delenv("MEGARL_NATIVE")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="megarl.algo.native"):
        assert native._build_and_load("gae_kernel") is None
    assert "torch implementation" in caplog.text
    assert not list((tmp_path / "native").glob("*"))  # no partial file left behind


def test_gae_without_the_kernel_uses_the_vectorized_code(monkeypatch):
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(4, 30, generator=g), torch.randn(4, 30, generator=g)
    mask = (torch.rand(4, 30, generator=g) > 0.3).float()
    monkeypatch.setattr(native, "load", lambda name: None)
    got = compute_gae_advantage_return(rewards, values, mask, gamma=0.99, lam=0.95)
    want = gae_vectorized(rewards, values, mask, gamma=0.99, lam=0.95)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_run_split_covers_the_range_in_order():
    assert native.run_split(lambda lo, hi: (lo, hi), 10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert native.run_split(lambda lo, hi: (lo, hi), 2, 8) == [(0, 1), (1, 2)]
    assert native.run_split(lambda lo, hi: (lo, hi), 5, 1) == [(0, 5)]


def test_a_forked_child_gets_fresh_threads():
    import multiprocessing

    native.run_split(lambda lo, hi: hi - lo, 4, 2)  # the parent's pool exists now
    time.sleep(0.2)  # ... and its threads are idle (the executor counts them as available)
    context = multiprocessing.get_context("fork")
    with context.Pool(1) as pool:
        result = pool.apply_async(native.run_split, (_width, 4, 2))
        assert result.get(timeout=60) == [2, 2]


def _width(lo: int, hi: int) -> int:
    return hi - lo
