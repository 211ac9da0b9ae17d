"""The step's model passes right-padded and packed (THD), side by side: seconds and peak memory.

One process builds a tiny Qwen2 actor and critic and runs, through the trainer's own functions,
the passes of one PPO step on the same batch twice, right-padded and packed
(``use_remove_padding``): the old-log-prob pass, the critic's value pass, the actor update and
the critic update. Response lengths are spread uniformly between 10 % and 100 % of the budget,
the micro-batches are the same rows either way. Each pass runs ``--repeat`` times (the median is
printed) after a warm-up. Peak memory: on a GPU the allocator's peak above the pass's start; on
the CPU the process's resident memory sampled every millisecond (after ``malloc_trim``), above
the pass's start. On the CPU padding is pure waste, so the ratios should approach padded tokens
/ real tokens (printed).

    .venv/bin/python tools/bench_packing.py [--responses 32] [--prompt 64] [--budget 1024]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Self

import torch

PASSES = ("old_log_prob", "values", "update_actor", "update_critic")


class PeakMemory:
    """Peak memory above the start while open: CUDA's allocator peak, else sampled RSS."""

    def __enter__(self) -> Self:
        self.peak = 0
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
            return self
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # return freed pages, so RSS starts low
        except OSError:
            pass
        self.start = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss() - self.start)
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.start
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss() - self.start)


def batch_of(responses: int, prompt: int, budget: int, vocab: int):
    """A step's batch: random prompts of ``prompt`` tokens, responses of 10 %..100 % of
    ``budget`` tokens (evenly spread), advantages, old log-probs, values and returns."""
    from megarl.trainer.batch import rollout_batch

    g = torch.Generator().manual_seed(0)
    lengths = torch.linspace(0.1 * budget, budget, responses).round().long().tolist()
    prompts = [torch.randint(10, vocab, (prompt,), generator=g).tolist() for _ in lengths]
    answers = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]
    batch = rollout_batch(prompts, answers, [[0.0] * n for n in lengths], list(range(responses)),
                          [False] * responses, pad_token_id=0)  # fmt: skip
    shape = batch.response_mask.shape
    batch.advantages = torch.randn(shape, generator=g) * batch.response_mask
    batch.old_log_probs = -torch.rand(shape, generator=g) * batch.response_mask
    batch.values = torch.randn(shape, generator=g) * batch.response_mask
    batch.returns = torch.randn(shape, generator=g) * batch.response_mask
    return batch


def run_passes(actor, critic, batch, micro: int, repeat: int) -> dict[str, tuple[float, int]]:
    """``{pass: (median seconds, largest peak bytes)}`` of the four passes on ``batch``."""
    from megarl.trainer.passes import critic_values, global_log_probs
    from megarl.trainer.update import PolicyUpdate, ValueUpdate, update_critic, update_policy

    vocab = actor.model.dims.vocab_size
    clip = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
    policy = PolicyUpdate(responses_per_mini_batch=len(batch), micro_batch_size=micro,
                          policy_loss_kwargs=clip)  # fmt: skip
    value = ValueUpdate(responses_per_mini_batch=len(batch), micro_batch_size=micro)

    def old_log_prob():
        global_log_probs(actor.chunks, batch, vocab_size=vocab, temperature=1.0,
                         micro_batches=micro, pack=actor.pack)  # fmt: skip

    runs = {
        "old_log_prob": old_log_prob,
        "values": lambda: critic_values(critic, batch, micro_batches=micro, max_token_len=None),
        "update_actor": lambda: update_policy(
            actor, batch, policy, vocab_size=vocab, seed=0, step=1
        ),
        "update_critic": lambda: update_critic(critic, batch, value, seed=0, step=1),
    }
    out = {}
    for name in PASSES:
        runs[name]()  # warm-up
        seconds, peaks = [], []
        for _ in range(repeat):
            with PeakMemory() as memory:
                start = time.perf_counter()
                runs[name]()
                seconds.append(time.perf_counter() - start)
            peaks.append(memory.peak)
        out[name] = (statistics.median(seconds), max(peaks))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--responses", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--budget", type=int, default=1024, help="max response tokens")
    parser.add_argument("--micro-batch", type=int, default=8, help="responses per micro-batch")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from megarl.models.build import build_model
    from megarl.models.tiny import make_tiny_model
    from megarl.models.trainable import OptimizerSettings, TrainableModel
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    init_distributed()
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(Path(tmp) / "model", "qwen2",
                               max_position_embeddings=args.prompt + args.budget)  # fmt: skip
        sgd = OptimizerSettings(lr=1e-6, optimizer="sgd", use_distributed_optimizer=False)
        actor = TrainableModel(build_model(path, ParallelLayout()), sgd)
        critic = TrainableModel(build_model(path, ParallelLayout(), role="critic"), sgd)
    batch = batch_of(args.responses, args.prompt, args.budget, actor.model.dims.vocab_size)
    real = int(batch.lengths.sum())
    padded = len(batch) * int(batch.lengths.max())
    print(f"{len(batch)} sequences, {real} tokens, {padded} right-padded "
          f"(padded / real = {padded / real:.2f}); micro-batches of {args.micro_batch}\n")  # fmt: skip
    results = {}
    for pack in (False, True):
        actor.model.pack = critic.model.pack = pack
        results[pack] = run_passes(actor, critic, batch, args.micro_batch, args.repeat)
    print(f"{'pass':<16}{'padded s':>10}{'packed s':>10}{'ratio':>8}"
          f"{'padded MiB':>12}{'packed MiB':>12}{'ratio':>8}")  # fmt: skip
    for name in PASSES:
        (t0, m0), (t1, m1) = results[False][name], results[True][name]
        print(f"{name:<16}{t0:>10.3f}{t1:>10.3f}{t0 / t1:>8.2f}"
              f"{m0 / 2**20:>12.1f}{m1 / 2**20:>12.1f}{m0 / max(m1, 1):>8.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
