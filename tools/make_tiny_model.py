"""Write a tiny random HF checkpoint for CPU tests.

python tools/make_tiny_model.py --family qwen2 --out outputs/tiny-qwen2 [--tie-word-embeddings]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.models.tiny import add_tiny_model_args, make_tiny_model_from_args


def main(argv: list[str] | None = None) -> Path:
    parser = add_tiny_model_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    path = make_tiny_model_from_args(parser.parse_args(argv))
    print(path)
    return path


if __name__ == "__main__":
    main()
