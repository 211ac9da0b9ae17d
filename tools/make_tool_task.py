"""Write the tool task (``megarl/tool_mul``: multiply two 2-digit numbers; only a calculator
call gets the reward) and a tiny Qwen2 warm-started to call the calculator (3 times in 8), for
``configs/grpo_tools_tiny_cpu.yaml``.

python tools/make_tool_task.py [--out outputs/tool-task] [--warm-steps 200] [--warm-batch 16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_tool_task(out: str | Path, *, warm_steps: int = 200, warm_batch: int = 16,
                   warm_lr: float = 3e-3, seed: int = 0) -> dict:  # fmt: skip
    """``out/data/{train,test}.parquet`` and ``out/tiny-qwen2`` (random, then warm-started on
    ``warm_steps * warm_batch`` fresh conversations, one pass). Returns the warm start's loss
    and seconds."""
    from megarl.data.tool_task import warm_start_conversations, write_tool_data
    from megarl.models.tiny import make_tiny_model
    from megarl.tools.warm_start import warm_start_chat

    out = Path(out)
    write_tool_data(out / "data", seed=seed)
    model = make_tiny_model(out / "tiny-qwen2", "qwen2", seed=seed)
    start = time.perf_counter()
    conversations = warm_start_conversations(warm_steps * warm_batch, seed=seed + 1)
    loss = warm_start_chat(model, conversations, steps=warm_steps, lr=warm_lr,
                           batch_size=warm_batch, threads=1, seed=seed)  # fmt: skip
    return {"loss": loss, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/tool-task")
    parser.add_argument("--warm-steps", type=int, default=200)
    parser.add_argument("--warm-batch", type=int, default=16)
    parser.add_argument("--warm-lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    done = make_tool_task(args.out, warm_steps=args.warm_steps, warm_batch=args.warm_batch,
                          warm_lr=args.warm_lr, seed=args.seed)  # fmt: skip
    print(f"{args.out}: data, tiny-qwen2 warm-started ({args.warm_steps} steps of "
          f"{args.warm_batch}, loss {done['loss']:.4f}, {done['seconds']:.1f} s)")  # fmt: skip
    return Path(args.out)


if __name__ == "__main__":
    main()
