"""Where the tiny CPU GRPO step spends its time: each phase's seconds and share, over several steps.

Runs the README's main job (``megarl.commands.quickstart``: 2 processes, actor TP 2, vLLM TP 2)
for ``--steps`` steps without validation, then reads ``timing_s/*`` from the run's
``metrics.jsonl``. The first step is reported apart (vLLM's first generation compiles and warms
up); the table averages the others. "bookkeeping" is the step minus its timed phases (metrics,
batch tensors, Python).

Beside each model phase: its tokens/s and the ideal tokens/s, the phase's matrix FLOPs (from the
model's ``config.json``: 2 per weight per token forward, 3x that for forward + backward, plus
causal attention's scores) at this machine's matmul rate, measured in this process on one
thread and multiplied by the processes (each rank holds one core); "of ideal" is the ratio. Generation
is counted as one forward per token (prefill and decode alike; prefix caching only lowers it),
the sync moves bytes and has no ideal here; update phases count one epoch (``ppo_epochs=1``).

    .venv/bin/python tools/bench_step.py [--steps 8] [--out outputs] [KEY=VALUE ...]
    .venv/bin/python tools/bench_step.py algorithm.adv_estimator=gae    # PPO: critic phases
    .venv/bin/python tools/bench_step.py --config configs/ppo_tiny_cpu.yaml  # the PPO tiny run
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

PHASES = (
    "gen", "gen_baseline", "reward", "old_log_prob", "ref", "values", "adv", "update_critic",
    "update_actor", "update_weights",
)  # fmt: skip
"""Timed phases of the step (``timing_s/<phase>``); those a run does not have are left out."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="outputs")
    parser.add_argument(
        "--from", dest="existing", metavar="RUN_DIR", help="report an existing run instead"
    )
    parser.add_argument("--nproc", type=int, default=2, help="processes (the quickstart's)")
    parser.add_argument(
        "--model-config", type=Path, help="the model's config.json (default: the quickstart's)"
    )
    args, overrides = parser.parse_known_args()
    model_config = args.model_config or Path(args.out) / "tiny-qwen2" / "config.json"
    if args.existing:
        return report(Path(args.existing), args.steps, args.model_config, args.nproc)
    run_dir = Path(args.out).resolve() / "runs" / "bench_step"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: no resume from an earlier bench
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "megarl.commands.quickstart",
            "--out",
            args.out,
            "--nproc",
            str(args.nproc),
            f"trainer.total_training_steps={args.steps}",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.resume_mode=disable",
            f"trainer.default_local_dir={run_dir}",
            *overrides,
        ],
        check=False,
    )
    if done.returncode:
        return done.returncode
    return report(run_dir, args.steps, model_config, args.nproc)


FORWARDS = {
    "gen": 1,
    "old_log_prob": 1,
    "ref": 1,
    "values": 1,
    "update_actor": 3,
    "update_critic": 3,
}
"""Forward-pass equivalents per token of each model phase (backward = 2 forwards)."""


def forward_flops_per_token(config: dict, context: float) -> float:
    """Matrix FLOPs of one token's forward through the HF causal LM ``config`` (``config.json``):
    2 per weight of the projections, MLP and LM head, and the attention's scores and weighted
    sum over ``context`` keys."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    kv = config.get("num_key_value_heads", heads)
    ffn = config["intermediate_size"]
    per_layer = h * heads * head_dim * 2 + h * kv * head_dim * 2 + 3 * h * ffn
    weights = layers * per_layer + h * config["vocab_size"]
    return 2 * weights + 4 * layers * heads * head_dim * context


def matmul_flops_per_second(size: int = 256, repeats: int = 50) -> float:
    """This machine's fp32 matmul rate on one thread (the ranks' setting), best of 3."""
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(4 * size, size), torch.randn(size, size)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(repeats):
                a @ b
            best = min(best, time.perf_counter() - start)
        return 2 * 4 * size * size * size * repeats / best
    finally:
        torch.set_num_threads(threads)


def report(run_dir: Path, last: int, model_config: Path | None = None, nproc: int = 2) -> int:
    """Print the phase table of the last ``last`` steps of the run in ``run_dir`` (with the
    ideal tokens/s where ``model_config``, the model's ``config.json``, is given)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["metrics"] for r in records if r["step"] > 0 and "timing_s/step" in r["metrics"]]
    steps = steps[-last:]
    first, rest = steps[0], steps[1:] or steps
    step_time = statistics.mean(m["timing_s/step"] for m in rest)
    print(
        f"\nfirst step {first['timing_s/step']:.2f} s (vLLM warm-up: gen {first['timing_s/gen']:.2f} s)"
    )
    median = statistics.median(m["timing_s/step"] for m in rest)
    print(f"steps 2..{len(steps)}: {step_time:.3f} s per step (median {median:.3f} s)\n")
    tokens = statistics.mean(m["perf/total_num_tokens"] for m in rest)
    per_token = rate = None
    if model_config is not None and model_config.is_file():
        length = statistics.mean(
            m.get("prompt_length/mean", 0) + m.get("response_length/mean", 0) for m in rest
        )
        per_token = forward_flops_per_token(json.loads(model_config.read_text()), length / 2)
        rate = matmul_flops_per_second() * nproc
        print(f"matmul rate {rate / 1e9:.1f} GFLOP/s ({nproc} processes x 1 thread)\n")
    print(f"{'phase':<16}{'seconds':>10}{'share':>9}{'tokens/s':>11}{'ideal':>11}{'of ideal':>10}")
    timed = 0.0
    for phase in PHASES:
        if not any(f"timing_s/{phase}" in m for m in rest):
            continue
        values = [m.get(f"timing_s/{phase}", 0.0) for m in rest]
        mean = statistics.mean(values)
        timed += mean
        line = f"{phase:<16}{mean:>10.3f}{mean / step_time:>9.1%}"
        if per_token is not None and phase in FORWARDS and mean > 0:
            ideal = rate / (per_token * FORWARDS[phase])
            line += f"{tokens / mean:>11.0f}{ideal:>11.0f}{tokens / mean / ideal:>10.1%}"
        print(line)
    other = step_time - timed
    print(f"{'bookkeeping':<16}{other:>10.3f}{other / step_time:>9.1%}")
    print(f"\n{tokens:.0f} tokens per step; {tokens / step_time:.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
