"""Convert a Megatron distributed checkpoint (saved at any TP×PP) into a Hugging Face directory.

python tools/convert_megatron_to_hf.py --ckpt CKPT --out HF_DIR
    [--tp N --pp N] [--dtype auto|fp32|bf16] [--verify]

Same as ``megarl convert megatron-to-hf ...``; see :mod:`megarl.commands.convert`.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.commands.convert import main

if __name__ == "__main__":  # worker processes re-import this file: nothing may run on import
    sys.exit(main(["megatron-to-hf", *sys.argv[1:]]))
