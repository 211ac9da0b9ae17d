"""The GPU path's decisions, checked on CPU: which layer spec ``transformer_impl`` builds (and the
loud failure when Transformer Engine is wanted but does not import), which fusions the spec
allows, and that the config's fusion and overlap knobs reach the model and DDP settings.

CUDA availability and TE's import failure are the resolver's parameters, so no GPU is needed;
the fused kernels themselves run in ``test_te_gpu.py`` (GPU only).
"""

from __future__ import annotations

import pytest

from megarl.models.gpt import (
    Fusions,
    build_transformer_config,
    fusion_flags,
    resolve_transformer_impl,
)

TE_MISSING = "ImportError: libcudart.so.13: cannot open shared object file: No such file"


def _never_asked() -> str | None:
    raise AssertionError("Transformer Engine's import was tried where it is not needed")


@pytest.mark.parametrize("impl", ["auto", "local"])
def test_cpu_keeps_the_local_spec_without_trying_te(impl):
    assert resolve_transformer_impl(impl, cuda=False, te_import_error=_never_asked) == "local"


def test_local_is_local_even_on_cuda():
    assert resolve_transformer_impl("local", cuda=True, te_import_error=_never_asked) == "local"


@pytest.mark.parametrize("impl", ["auto", "transformer_engine"])
def test_te_on_cuda_when_it_imports(impl):
    assert resolve_transformer_impl(impl, cuda=True, te_import_error=None) == "transformer_engine"


@pytest.mark.parametrize(
    ("impl", "cuda", "error", "says"),
    [
        ("auto", True, TE_MISSING, "auto on CUDA expects Transformer Engine"),
        ("transformer_engine", True, TE_MISSING, "transformer_engine asks for Transformer Engine"),
        ("transformer_engine", False, TE_MISSING, "asks for"),
        ("transformer_engine", False, None, "CUDA is not available"),
    ],
)
def test_te_wanted_but_not_importable_fails_in_one_line(impl, cuda, error, says):
    with pytest.raises(RuntimeError) as info:
        resolve_transformer_impl(impl, cuda=cuda, te_import_error=error)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"megatron.transformer_impl={impl} ")  # the key and its value
    assert says in message
    assert error is None or error in message  # the import's own reason
    assert "make venv-gpu" in message and "transformer_impl=local" in message


def test_the_import_failure_reason_is_one_line():
    from megarl.models.gpt import _import_error

    def fails():
        raise OSError("libtransformer_engine.so:\n  undefined symbol: _ZN3c10")

    assert _import_error(fails) == "OSError: libtransformer_engine.so: undefined symbol: _ZN3c10"
    assert _import_error(lambda: None) is None


def test_an_unknown_impl_names_the_key():
    with pytest.raises(ValueError, match="megatron.transformer_impl must be"):
        resolve_transformer_impl("te", cuda=False)  # type: ignore[arg-type]


def test_fusions_follow_the_spec():
    on = Fusions()
    te = fusion_flags(on, "transformer_engine", pipeline_model_parallel_size=1, apex_wgrad=True)
    assert te.pop("attention_backend").name == "auto"  # TE's spec: Megatron picks (14f3372)
    assert te == {
        "bias_activation_fusion": True,
        "apply_rope_fusion": True,
        "gradient_accumulation_fusion": True,
        "deallocate_pipeline_outputs": False,  # nothing to free without a pipeline
    }
    no_apex = fusion_flags(on, "transformer_engine", pipeline_model_parallel_size=2,
                           apex_wgrad=False)  # fmt: skip
    assert not no_apex["gradient_accumulation_fusion"] and no_apex["deallocate_pipeline_outputs"]
    local = fusion_flags(on, "local", pipeline_model_parallel_size=2, apex_wgrad=True)
    assert local == {
        "bias_activation_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "deallocate_pipeline_outputs": True,
    }
    off = Fusions(False, False, False, False)
    off_flags = fusion_flags(off, "transformer_engine", pipeline_model_parallel_size=4,
                             apex_wgrad=True)  # fmt: skip
    assert off_flags.pop("attention_backend").name == "auto"
    assert not any(off_flags.values())


def test_the_flags_reach_the_transformer_config():
    """On CPU (local spec): the fused kernels stay off, deallocation follows PP and the knob."""
    from megarl.config.model_dims import ModelDims

    hf = {
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False,
    }  # fmt: skip
    dims = ModelDims.from_hf_config(hf)
    config = build_transformer_config(dims, pipeline_model_parallel_size=2)
    assert config.deallocate_pipeline_outputs
    assert not (config.bias_activation_fusion or config.apply_rope_fusion)
    assert not config.gradient_accumulation_fusion
    config = build_transformer_config(
        dims, pipeline_model_parallel_size=2, fusions=Fusions(deallocate_pipeline_outputs=False)
    )
    assert not config.deallocate_pipeline_outputs
    assert not build_transformer_config(dims).deallocate_pipeline_outputs


def test_config_knobs_reach_the_settings():
    """``*.megatron`` fusion switches and ``override_ddp_config`` (verl's section) become the
    model's Fusions and the DDP settings of actor and critic; the overlaps are on by default."""
    from megarl.config import load_config
    from megarl.trainer.setup import fusions, optimizer_settings

    cfg = load_config([], [])
    actor = optimizer_settings(cfg, 10)
    assert actor.overlap_grad_reduce and actor.overlap_param_gather
    assert actor.ddp_bucket_size is None
    assert fusions(cfg.actor_rollout_ref.actor.megatron) == Fusions()
    meg = "actor_rollout_ref.actor.megatron"
    cfg = load_config(
        [],
        [
            f"{meg}.override_ddp_config.overlap_grad_reduce=false",
            f"+{meg}.override_ddp_config.overlap_param_gather=false",  # verl's spelling, with +
            f"{meg}.override_ddp_config.bucket_size=1000",
            f"{meg}.apply_rope_fusion=false",
            "critic.megatron.deallocate_pipeline_outputs=false",
        ],
    )
    actor = optimizer_settings(cfg, 10)
    assert not actor.overlap_grad_reduce and not actor.overlap_param_gather
    assert actor.ddp_bucket_size == 1000
    assert fusions(cfg.actor_rollout_ref.actor.megatron) == Fusions(apply_rope_fusion=False)
    critic = optimizer_settings(cfg, 10, role="critic")
    assert critic.overlap_grad_reduce and critic.overlap_param_gather  # its own section
    assert fusions(cfg.critic.megatron) == Fusions(deallocate_pipeline_outputs=False)
