"""``megarl data``: data-set utilities.

    megarl data synth [--out DIR] [--train-size N] [--test-size N] [--seed S] [--max-operand M]

``synth`` writes ``train.parquet`` and ``test.parquet`` of the synthetic verifiable task
``megarl/digit_sum`` (``megarl.data.synthetic``) in verl's schema; the tiny CPU configs read them
from ``outputs/tiny-data``.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl data", description="data-set utilities")
    commands = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    synth = commands.add_parser(
        "synth", help="write train/test parquet files of the synthetic digit_sum task"
    )
    synth.add_argument("--out", default="outputs/tiny-data", help="output directory")
    synth.add_argument("--train-size", type=int, default=4096, help="training prompts")
    synth.add_argument("--test-size", type=int, default=256, help="validation prompts")
    synth.add_argument("--seed", type=int, default=0, help="seed of the questions")
    synth.add_argument(
        "--max-operand", type=int, default=49, help="largest number in a question (>= 1)"
    )
    return parser


def main(argv: list[str]) -> int:
    """Run ``megarl data ARGV``; returns the exit status (2 for bad arguments)."""
    args = build_parser().parse_args(argv)
    from megarl.data.synthetic import write_synthetic_data

    try:
        train, test = write_synthetic_data(
            args.out,
            train_size=args.train_size,
            test_size=args.test_size,
            seed=args.seed,
            max_operand=args.max_operand,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {train} ({args.train_size} prompts) and {test} ({args.test_size} prompts)")
    return 0
