"""Rollout: the engine interface the trainer talks to (:mod:`.base`), the vLLM engine
(:mod:`.vllm_engine`) and an actor-sampling engine (:mod:`.actor_engine`), prompt distribution
between training and rollout layouts (:mod:`.distribute`), weight resharding from Megatron to
vLLM (:mod:`.reshard`), vLLM on ranks of its own (:mod:`.remote`), MoE routing capture
(:mod:`.routing_capture`) and the log-prob agreement check (:mod:`.consistency`)."""
