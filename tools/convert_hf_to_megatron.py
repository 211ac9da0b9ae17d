"""Convert a Hugging Face safetensors directory into a Megatron distributed checkpoint.

python tools/convert_hf_to_megatron.py --hf-path HF_DIR --out CKPT
    [--tp N --pp N --vpp N] [--dtype auto|fp32|bf16] [--verify]

Same as ``megarl convert hf-to-megatron ...``; see :mod:`megarl.commands.convert`.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.commands.convert import main

if __name__ == "__main__":  # worker processes re-import this file: nothing may run on import
    sys.exit(main(["hf-to-megatron", *sys.argv[1:]]))
