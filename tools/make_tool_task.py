"""Write the tool task (``megarl/tool_sum``: add two 6-digit numbers; only a calculator call
gets the reward) and a tiny Qwen2 warm-started to call the calculator, for
``configs/grpo_tools_tiny_cpu.yaml``.

python tools/make_tool_task.py [--out outputs/tool-task] [--warm-examples 64] [--warm-steps 300]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/tool-task")
    parser.add_argument("--digits", type=int, default=6)
    parser.add_argument("--warm-examples", type=int, default=64)
    parser.add_argument("--warm-steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from megarl.data.tool_task import warm_start_conversations, write_tool_data
    from megarl.models.tiny import make_tiny_model
    from megarl.tools.warm_start import warm_start_chat

    out = Path(args.out)
    write_tool_data(out / "data", seed=args.seed, digits=args.digits)
    model = make_tiny_model(out / "tiny-qwen2", "qwen2", seed=args.seed)
    start = time.perf_counter()
    loss = warm_start_chat(
        model,
        warm_start_conversations(args.warm_examples, seed=args.seed + 1, digits=args.digits),
        steps=args.warm_steps,
    )
    print(f"{model}: warm start {args.warm_steps} steps, loss {loss:.4f}, "
          f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    return out


if __name__ == "__main__":
    main()
