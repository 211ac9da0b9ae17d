"""vLLM on ranks of its own, generating ahead of the trainer (off-policy by a bounded number of
steps): :mod:`.split_world` splits one launch into training and rollout ranks,
:mod:`.engine` is the trainer's handle on the rollout ranks (an
:class:`~megarl.rollout.base.AheadEngine`), :mod:`.serve` their serving loop, and
:mod:`.weights` carries each weight update across."""
