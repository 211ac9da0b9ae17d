"""vLLM engines with routing capture on, one per tiny MoE family, in one process (world 1):
``python _routing_capture_worker.py OUT FAMILY...`` writes ``OUT/<family>.pt``: the engine's
routing source and a list of samples (prompt, response, routing) generated over a small token budget per engine step, so that
steps mix prefills of some requests with decodes of others. The budget asked for (32 tokens) is
below the longest prompt (41): the engine must raise it on CPU, where vLLM 0.32's runner fails
on a seeded request's partial (chunked) prefill ("CPU Generator does not use offset")."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

PROMPTS = [list(range(3, 3 + n)) for n in (5, 41, 17, 2)]
"""Token-id prompts of assorted lengths; 130 prompt tokens in all, over a 96-token budget (max_model_len)."""


def main() -> None:
    out, families = Path(sys.argv[1]), sys.argv[2:]
    from megarl.models.tiny import make_tiny_model
    from megarl.rollout.vllm_engine import VLLMEngine

    for family in families:
        path = make_tiny_model(out / family, family, num_layers=3, seed=5)
        engine = VLLMEngine(
            path,
            dtype="float32",
            max_model_len=96,
            kv_cache_memory_bytes=32 << 20,
            max_num_batched_tokens=32,
            capture_routing=True,
        )
        batch = engine.generate(PROMPTS, n=2, temperature=1.0, max_tokens=12, seed=3)
        samples = [
            {"prompt": s.prompt_token_ids, "response": s.response_token_ids, "routing": s.routing}
            for s in batch
        ]
        result = {"source": engine.routing_source, "samples": samples}
        result["update_in_place"] = engine._update_in_place  # MoE experts: a layerwise reload
        torch.save(result, out / f"{family}.pt")
        engine.shutdown()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
