"""Megatron builds (or refuses) one transformer layer per (heads, KV heads, head_dim) row at
TP = world size; run inside the multi-rank launches of ``_parallel_worker.py``.

``ROWS`` is shared with ``test_layout_rule.py``, which asserts that Megatron's verdict is the
one of megarl's rule (:func:`megarl.parallel.layout.layout_problems`) and that config
validation, ``convert``'s input check and the resharding plan say the same. Megatron is only
imported inside the check, so the test module can import ``ROWS`` cheaply.
"""

from __future__ import annotations

ROWS: tuple[tuple[int, int, int], ...] = (
    # (num_attention_heads, num_key_value_heads, head_dim)
    (4, 4, 8),  # MHA
    (4, 2, 8),  # GQA, groups = TP at 2, TP a multiple of the groups at 4
    (4, 1, 8),  # one KV head: every TP rank holds the one group
    (8, 2, 8),
    (2, 1, 8),  # heads below TP at 4
    (6, 6, 8),  # heads not divisible by TP 4
    (6, 3, 8),  # 3 groups: neither a divisor nor a multiple of 2 or 4
    (12, 3, 8),  # heads divisible by 4 but 3 groups
    (4, 1, 1),  # linear_qkv rows (4 + 2) × 1 = 6 not divisible by TP 4
)
FFN = 64
"""MLP width of every row (divisible by 2 and 4, so only attention decides)."""


def hf_config(heads: int, kv: int, head_dim: int) -> dict:
    """A Llama-shaped HF config of one layer for the row."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": heads * head_dim,
        "intermediate_size": FFN,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "vocab_size": 256,
        "max_position_embeddings": 64,
    }


def run_layout_rule_checks(results: dict) -> None:
    """For each row: build one layer at TP = world size and run it forward; record the verdict.

    ``results[f"layout_rule/tp{tp}"]`` maps each row to None (built and ran) or the error text.
    """
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.spec_utils import build_module

    from megarl.config.model_dims import ModelDims
    from megarl.models.gpt import build_transformer_config, layer_spec
    from megarl.models.runner import causal_mask
    from megarl.parallel.init import init_distributed, read_launch_env
    from megarl.parallel.layout import ParallelLayout

    tp = read_launch_env().world_size
    init_distributed(ParallelLayout(tp, 1), seed=5)  # parallel_state is per TP: start it again
    verdicts: dict[tuple[int, int, int], str | None] = {}
    for row in ROWS:
        dims = ModelDims.from_hf_config(hf_config(*row), tp_size=tp)
        try:
            config = build_transformer_config(dims, tensor_model_parallel_size=tp)
            layer = build_module(layer_spec(dims, "local"), config=config, layer_number=1)
            hidden = torch.randn(5, 2, dims.hidden_size, generator=torch.Generator().manual_seed(0))
            out, _ = layer(hidden, attention_mask=causal_mask(5, hidden.device))
            assert out.shape == hidden.shape, out.shape
            verdicts[row] = None
        except Exception as exc:  # noqa: BLE001 - the verdict is the point
            verdicts[row] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    boxes: list = [None] * tp
    dist.all_gather_object(boxes, verdicts)
    assert all(b == verdicts for b in boxes), boxes  # every rank agrees
    results[f"layout_rule/tp{tp}"] = verdicts
