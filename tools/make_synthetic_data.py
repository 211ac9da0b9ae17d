"""Write train/test parquet files of megarl's synthetic verifiable task (``megarl data synth``).

python tools/make_synthetic_data.py [--out outputs/tiny-data] [--train-size N] [--test-size N]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.commands.data import main

if __name__ == "__main__":
    sys.exit(main(["synth", *sys.argv[1:]]))
