"""In-process parts of the engine protocol: the call-order rules, and how ``VLLMEngine`` is built
from the config (no engine is started here; the conformance test on live engines runs in the
torchrun launches of test_reshard_sync.py, and test_vllm_engine.py checks that the values reach
vLLM's own config)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from megarl.config.loader import resolve_config
from megarl.config.schema import MegarlConfig, RolloutConfig
from megarl.rollout.base import CallOrder, update_weights
from megarl.rollout.vllm_engine import VLLMEngine, engine_args_from_config, vllm_dtype

# Config fields that are VLLMEngine constructor arguments under the same name.
SAME_NAMES = {
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "free_cache_engine",
    "enforce_eager",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "engine_kwargs",
    "limit_images",
}


def test_constructor_keeps_the_configs_names():
    params = set(inspect.signature(VLLMEngine).parameters)
    fields = {f.name for f in dataclasses.fields(RolloutConfig)}
    assert params & fields == SAME_NAMES


def test_engine_args_from_config():
    cfg = RolloutConfig(
        tensor_model_parallel_size=4,
        prompt_length=100,
        response_length=28,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=1 << 20,
        free_cache_engine=False,
        enforce_eager=True,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_num_batched_tokens=1024,
        max_num_seqs=8,
        engine_kwargs={"block_size": 16},
    )
    args = engine_args_from_config(cfg, dtype="bf16", seed=3)
    inspect.signature(VLLMEngine).bind("model", **args)  # every key is a constructor argument
    for name in SAME_NAMES - {"max_model_len"}:
        assert args[name] == getattr(cfg, name), name
    assert args["tensor_parallel_size"] == 4
    assert args["max_model_len"] == 128  # prompt_length + response_length
    assert args["dtype"] == "bfloat16" and args["seed"] == 3
    assert (
        engine_args_from_config(dataclasses.replace(cfg, max_model_len=77), dtype="fp32", seed=0)[
            "max_model_len"
        ]
        == 77
    )
    with pytest.raises(ValueError, match="not vllm"):
        engine_args_from_config(dataclasses.replace(cfg, name="sglang"), dtype="fp32", seed=0)  # type: ignore[arg-type]


def test_from_config_passes_config_and_overrides():
    class Recorder(VLLMEngine):
        def __init__(self, model_path, **kwargs) -> None:  # no vLLM start
            self.args = (model_path, kwargs)

    rollout = resolve_config(MegarlConfig()).actor_rollout_ref.rollout  # lengths follow data.*
    engine = Recorder.from_config(rollout, "m", dtype="fp32", seed=1, num_threads=2)
    path, kwargs = engine.args
    assert path == "m" and kwargs["num_threads"] == 2 and kwargs["dtype"] == "float32"
    assert kwargs["max_model_len"] == 1024  # data.max_prompt_length + max_response_length
    assert kwargs == {
        **engine_args_from_config(rollout, dtype="fp32", seed=1),
        "num_threads": 2,
    }


@pytest.mark.parametrize(
    "given,want",
    [
        ("bf16", "bfloat16"),
        ("fp32", "float32"),
        ("fp16", "float16"),
        ("bfloat16", "bfloat16"),
        ("float32", "float32"),
        (torch.bfloat16, "bfloat16"),
        (torch.float32, "float32"),
    ],
)
def test_vllm_dtype(given, want):
    assert vllm_dtype(given) == want


def test_vllm_dtype_refuses_unknown():
    with pytest.raises(ValueError, match="bf16, fp32"):
        vllm_dtype("int8")


def test_call_order_rules():
    order = CallOrder()
    order.check_can_generate()
    with pytest.raises(RuntimeError, match="without begin"):
        order.check_updating("load_weight_chunk")
    with pytest.raises(RuntimeError, match="without begin"):
        order.finish_update()
    order.begin_update()
    with pytest.raises(RuntimeError, match="already open"):
        order.begin_update()
    with pytest.raises(RuntimeError, match="open weight update"):
        order.check_can_generate()
    order.finish_update()
    order.check_can_generate()
    order.sleep(1)
    order.check_can_generate()
    order.sleep(2)
    with pytest.raises(RuntimeError, match="sleep\\(level=2\\)"):
        order.check_can_generate()
    order.begin_update()
    order.finish_update()
    order.check_can_generate()
    with pytest.raises(ValueError, match="1 or 2"):
        order.sleep(0)


def test_update_weights_is_one_session():
    calls = []

    class Sink:
        def begin_weight_update(self) -> None:
            calls.append("begin")

        def load_weight_chunk(self, named_tensors) -> None:
            calls.append([name for name, _ in named_tensors])

        def finish_weight_update(self) -> None:
            calls.append("finish")

    update_weights(Sink(), ((n, torch.zeros(1)) for n in ("a", "b")))
    assert calls == ["begin", ["a", "b"], "finish"]
