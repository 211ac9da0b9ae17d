"""Checkpoints: Megatron distributed checkpoints of model chunks, loadable at any layout
(:mod:`.dist_ckpt`), and the ``megarl_meta.json`` file saved beside their shards (:mod:`.meta`)."""
