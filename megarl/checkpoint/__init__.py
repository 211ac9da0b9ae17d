"""Checkpoints: Megatron distributed checkpoints of model chunks, loadable at any layout
(:mod:`.dist_ckpt`, with ``megarl_meta.json`` beside them: :mod:`.meta`), the trainer's
crash-safe checkpoints (:mod:`.trainer_ckpt`, :mod:`.layout`, :mod:`.resume`, :mod:`.schedule`),
the stop protocol (:mod:`.stop`) and HF export (:mod:`.hf_export`).
"""
