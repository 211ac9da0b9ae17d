"""Models: Megatron GPT actors and critics (:mod:`.gpt`, built by :mod:`.build`), the HF ↔
Megatron weight mapping (:mod:`.hf_mapping`, moved by :mod:`.weights`), the micro-batch runner
and log-probs (:mod:`.runner`, :mod:`.logprobs`), the trainable wrapper (:mod:`.trainable`),
logit verification against HF (:mod:`.verify`) and tiny random checkpoints (:mod:`.tiny`)."""
