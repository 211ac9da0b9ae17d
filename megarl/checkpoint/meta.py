"""``megarl_meta.json`` beside a checkpoint's shards (defined in
:mod:`megarl.config.checkpoint_meta`, the lowest layer, so that config checks read it too).
"""

from megarl.config.checkpoint_meta import META_FILE, read_checkpoint_meta

__all__ = ["META_FILE", "read_checkpoint_meta"]
