"""Transformer Engine spec on GPU: bf16 parity with HF and the TE-name mapping round trip.

Skipped without CUDA (conftest). Runs in-process as a world of one.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def te_model(tmp_path_factory):
    from megarl.parallel.spawn import free_port

    pytest.importorskip("transformer_engine.pytorch")
    from megarl.models.build import build_model
    from megarl.models.tiny import make_tiny_model
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    init_distributed(ParallelLayout(1, 1))
    path = make_tiny_model(tmp_path_factory.mktemp("te") / "qwen2", family="qwen2")
    built = build_model(
        path, ParallelLayout(1, 1), dtype=torch.bfloat16, transformer_impl="transformer_engine"
    )
    return path, built.dims, built.chunks


def test_te_names_map_onto_local_names(te_model):
    from megarl.models import hf_mapping as hm

    _, dims, chunks = te_model
    names = {n for n, _ in chunks[0].named_parameters()}
    assert any("linear_qkv.layer_norm_weight" in n for n in names), "TE spec not in use"
    local = {hm.from_te_name(n) for n in names}
    assert local == set(hm.megatron_param_names(dims))
    assert {hm.to_te_name(n) for n in local} == names


def test_te_bf16_logits_match_hf(te_model):
    from transformers import AutoModelForCausalLM

    from megarl.models.runner import causal_mask

    path, dims, chunks = te_model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    ids = torch.randint(0, dims.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    ids = ids.cuda()
    pos = torch.arange(16, device="cuda")[None].expand_as(ids)
    with torch.no_grad():
        ours = chunks[0](ids, pos, causal_mask(16, ids.device))[..., : dims.vocab_size].float()
        ref = hf(ids).logits.float()
    # bf16 across two implementations: compare relative to the logit scale.
    assert (ours - ref).abs().max() <= 0.05 * ref.abs().max()
    # Near-ties may flip under bf16; the greedy token must agree almost everywhere.
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95


def test_te_export_round_trip(te_model, tmp_path):
    from safetensors.torch import load_file

    from megarl.models.weights import HFCheckpointReader, export_hf_weights

    path, dims, chunks = te_model
    out = export_hf_weights(
        chunks, tmp_path / "export", dims, source_dir=path, dtype=torch.bfloat16
    )
    exported = {}
    for f in sorted(out.glob("*.safetensors")):
        exported.update(load_file(f))
    with HFCheckpointReader(path) as src:
        assert set(exported) == set(src.names())
        for name in src.names():
            assert torch.equal(exported[name], src.get(name).to(torch.bfloat16)), name


def test_te_spec_turns_the_fusions_on(te_model):
    """On the TE path the fusions the spec allows are on in the built TransformerConfig:
    bias-SwiGLU and RoPE always, gradient-accumulation fusion exactly when apex's fused
    weight-gradient kernel imports (Megatron's output layer needs it)."""
    from megarl.models.gpt import apex_fused_wgrad_available, unwrap

    _, _, chunks = te_model
    config = unwrap(chunks[0]).config
    assert config.transformer_impl == "transformer_engine"
    assert config.bias_activation_fusion and config.apply_rope_fusion
    assert config.gradient_accumulation_fusion == apex_fused_wgrad_available()


def test_te_packed_rows_match_padded_rows(te_model):
    """Transformer Engine's fused attention in THD format (packed rows, each sequence padded to
    what Megatron needs) gives the right-padded pass's log-probs and entropy: bf16, so within
    the same relative bound as the logits above; one-token responses and odd lengths included."""
    from megarl.models.runner import SequenceBatch, compute_log_probs

    _, dims, chunks = te_model
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([13, 7, 11, 5, 2, 13])
    prompts = torch.tensor([12, 3, 4, 2, 1, 6])
    ids = torch.randint(0, dims.vocab_size, (6, 13), generator=g)
    batch = SequenceBatch(ids, prompts, lengths)
    micro = [torch.tensor([0, 3]), torch.tensor([1, 2, 4, 5])]
    out = {
        pack: compute_log_probs(
            chunks, batch, vocab_size=dims.vocab_size, micro_batches=micro, pack=pack
        )
        for pack in (False, True)
    }
    scale = out[False].log_probs.abs().max()
    assert (out[True].log_probs - out[False].log_probs).abs().max() <= 0.05 * scale
    assert (out[True].entropy - out[False].entropy).abs().max() <= 0.05 * out[False].entropy.max()


def test_te_lora_logits_match_hf_peft(te_model, tmp_path):
    """LoRA on Transformer Engine's linears (fp32): the fused norm+linear's adapter takes TE's
    returned norm output. Logits equal HF + ``peft`` loading the actor's own PEFT export, the
    adapters off give the base model, and only the adapters get gradients."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megarl.models.build import build_model
    from megarl.models.lora import (
        LoraSettings,
        adapters_disabled,
        attach_adapters,
        freeze_base,
    )
    from megarl.models.lora_peft import export_peft_adapter
    from megarl.models.runner import causal_mask
    from megarl.parallel.layout import ParallelLayout

    path = te_model[0]
    built = build_model(
        path, ParallelLayout(1, 1), dtype=torch.float32, transformer_impl="transformer_engine"
    )
    chunks, dims = built.chunks, built.dims
    settings = LoraSettings(rank=4, alpha=1.6, a_init="xavier", b_init="normal", seed=5)
    assert attach_adapters(chunks, settings) == 4 * dims.num_layers
    freeze_base(chunks)
    ids = torch.randint(0, dims.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    ids = ids.cuda()
    pos = torch.arange(16, device="cuda")[None].expand_as(ids)
    mask = causal_mask(16, ids.device)
    ours = chunks[0](ids, pos, mask)[..., : dims.vocab_size].float()
    (ours * torch.linspace(-1, 1, dims.vocab_size, device="cuda")).sum().backward()
    with torch.no_grad(), adapters_disabled(chunks):
        off = chunks[0](ids, pos, mask)[..., : dims.vocab_size].float()
    export_peft_adapter(chunks, dims, settings, tmp_path / "peft")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    with torch.no_grad():
        base_logits = base(ids).logits.float()
        ref = PeftModel.from_pretrained(base, str(tmp_path / "peft"))(ids).logits.float()
    scale = ref.abs().max()
    print(f"TE LoRA vs HF + peft {(ours - ref).abs().max():.3g} (scale {scale:.3g})")
    assert (ours.detach() - ref).abs().max() <= 1e-3 * scale
    assert (ours.detach() - base_logits).abs().max() >= 1e-2 * scale  # the adapters matter
    assert (off - base_logits).abs().max() <= 1e-3 * scale
    grads = {n: p.grad for n, p in chunks[0].named_parameters()}
    assert all(g is not None for n, g in grads.items() if ".lora." in n)
    assert all(g is None for n, g in grads.items() if ".lora." not in n)


def test_te_has_no_fp32_attention_for_packed_rows(te_model):
    """Why the pre-flight refuses trainer.dtype=fp32 with TE's spec and packing (issue 54 item
    2; tests/config/test_attention_backend.py): TE's fp32 attention on THD rows finds no
    backend, while bf16 runs."""
    from megarl.models.build import build_model
    from megarl.models.packing import pack_rows
    from megarl.parallel.layout import ParallelLayout

    path, dims, _ = te_model
    ids = torch.randint(0, dims.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    rows = pack_rows(ids.cuda(), torch.tensor([16, 9]), multiple=8)
    for dtype in (torch.bfloat16, torch.float32):
        chunk = build_model(path, ParallelLayout(1, 1), dtype=dtype,
                            transformer_impl="transformer_engine").chunks[0]  # fmt: skip

        def run(chunk=chunk) -> torch.Tensor:
            with torch.no_grad():
                return chunk(rows.input_ids, rows.position_ids, None, packed_seq_params=rows.params)

        if dtype == torch.bfloat16:
            assert torch.isfinite(run().float()).all()
        else:
            with pytest.raises(Exception, match="(?i)no dot product attention backend"):
                run()
