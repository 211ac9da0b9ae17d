"""Conversion and weight-sync demo on CPU (``make demo-convert``; ``make demo`` trains).

Makes a tiny randomised Qwen2 checkpoint → validates the tiny GRPO config at world size 2 →
converts HF → Megatron at TP=2 and verifies logits against ``transformers`` → converts back at
PP=2, verifies, and checks the round trip is bit-identical → starts Megatron TP=2 and vLLM TP=2
in one torchrun world, perturbs the actor, syncs the weights into vLLM and reports the log-prob
agreement. Each step prints its command and time; the first failure stops the demo with its exit
code. Outputs go to ``outputs/`` (``--out``); a re-run replaces them.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(title: str, cmd: list[str]) -> float:
    print(f"\n=== {title}\n$ {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, check=False)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        print(f"demo: step '{title}' failed with exit code {proc.returncode}", file=sys.stderr)
        sys.exit(proc.returncode)
    print(f"--- {title}: ok in {took:.1f} s", flush=True)
    return took


def _same_tensors(a: Path, b: Path) -> tuple[bool, int]:
    import torch

    from megarl.models.weights import HFCheckpointReader

    with HFCheckpointReader(a) as ra, HFCheckpointReader(b) as rb:
        if set(ra.names()) != set(rb.names()):
            return False, 0
        return all(torch.equal(ra.get(n), rb.get(n)) for n in ra.names()), len(ra.names())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megarl.commands.demo", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", default="outputs", help="directory for the demo's files")
    args = parser.parse_args(argv)
    out = (REPO / args.out).resolve()
    py = sys.executable
    model = out / "tiny-qwen2"
    timings = {}
    timings["tiny model"] = _run(
        "make a tiny randomised Qwen2 checkpoint",
        [py, "tools/make_tiny_model.py", "--family", "qwen2", "--out", str(model)],
    )
    timings["config"] = _run(
        "validate configs/grpo_tiny_cpu.yaml at world size 2",
        [
            py,
            "-m",
            "megarl.cli",
            "config",
            "validate",
            "--config",
            "configs/grpo_tiny_cpu.yaml",
            "--world-size",
            "2",
            f"actor_rollout_ref.model.path={model}",
        ],
    )
    ckpt = out / "tiny-qwen2-megatron"
    back = out / "tiny-qwen2-roundtrip"
    for previous in (ckpt, back):  # the demo's own outputs from an earlier run
        shutil.rmtree(previous, ignore_errors=True)
    timings["hf→megatron"] = _run(
        "convert HF → Megatron dist checkpoint at TP=2, verify logits",
        [
            py,
            "-m",
            "megarl.cli",
            "convert",
            "hf-to-megatron",
            "--hf-path",
            str(model),
            "--out",
            str(ckpt),
            "--tp",
            "2",
            "--verify",
        ],
    )
    timings["megatron→hf"] = _run(
        "convert the checkpoint back to HF at PP=2, verify logits",
        [
            py,
            "-m",
            "megarl.cli",
            "convert",
            "megatron-to-hf",
            "--ckpt",
            str(ckpt),
            "--out",
            str(back),
            "--pp",
            "2",
            "--verify",
        ],
    )
    same, count = _same_tensors(model, back)
    print(f"\nround trip HF → Megatron(TP=2) → HF(PP=2): {count} tensors, bit-identical: {same}")
    if not same:
        return 1
    timings["rollout+sync"] = _run(
        "Megatron TP=2 actor + vLLM TP=2 in one torchrun world: generate, perturb, sync",
        [
            py,
            "-m",
            "torch.distributed.run",
            "--standalone",  # a free rendezvous port, not the fixed default 29500
            "--nproc_per_node",
            "2",
            "-m",
            "megarl.commands.demo_sync",
            "--model",
            str(model),
        ],
    )
    print("\nsummary:")
    for step, took in timings.items():
        print(f"  {step:<14} {took:6.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
