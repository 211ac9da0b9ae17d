"""The ``megarl_meta.json`` file beside a checkpoint's shards: its name and reader.

Torch- and Megatron-free, so that input checks read it without importing either.
"""

from __future__ import annotations

import json
from pathlib import Path

META_FILE = "megarl_meta.json"
"""File, beside the shards, holding what megarl saved with them (HF config, dtype, layout)."""


def read_checkpoint_meta(ckpt_dir: str | Path) -> dict:
    """The ``meta`` saved with the checkpoint (empty dict when there is none)."""
    f = Path(ckpt_dir) / META_FILE
    return json.loads(f.read_text()) if f.exists() else {}
