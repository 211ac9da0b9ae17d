"""LoRA on the Megatron actor against HF transformers + ``peft`` at TP1/PP1, TP2, PP2, TP2×PP2
and TP2 with sequence parallelism (the adapters' sequence-parallel mappings and the TP all-reduce
of the replicated factor's gradient, ``sequence_parallel``-marked).

One 4-rank launch (``_lora_worker.py``) runs every layout; each layout exports its adapters as
a PEFT folder, which ``peft.PeftModel.from_pretrained`` loads onto the HF base model: its logits
are the reference for the Megatron logits of that layout, and the gradients of the same loss
through the PEFT model are the reference for the adapters' gradients.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_torchrun

pytestmark = pytest.mark.multirank

WORKER = Path(__file__).with_name("_lora_worker.py")
LAYOUTS = ["tp1_pp1", "tp2_pp1", "tp1_pp2", "tp2_pp2", "tp2_pp1_sp"]
LORA = {"rank": 4, "alpha": 1.6, "a_init": "xavier", "b_init": "normal", "seed": 5}
"""Random non-zero A and B: the adapters change the logits (B zero would hide a wrong B)."""


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> dict:
    from megarl.models.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp("lora")
    model = make_tiny_model(tmp / "qwen2", "qwen2", seed=21)  # q/k/v biases, 2 KV groups of 2
    g = torch.Generator().manual_seed(3)
    lengths, plen = torch.tensor([14, 9, 7, 12]), torch.tensor([3, 6, 2, 5])
    batch = {
        "input_ids": torch.randint(0, 1000, (4, 14), generator=g),
        "prompt_lengths": plen,
        "lengths": lengths,
        "w": torch.randn(4, int((lengths - plen).max()), generator=g),
    }
    torch.save(batch, tmp / "batch.pt")
    moe = make_tiny_model(tmp / "qwen3_moe", "qwen3_moe", num_layers=2, seed=22)
    spec = {"model": str(model), "batch": str(tmp / "batch.pt"), "tmp": str(tmp), "lora": LORA,
            "moe_model": str(moe)}  # fmt: skip
    (tmp / "spec.json").write_text(json.dumps(spec))
    run_torchrun(WORKER, 4, [str(tmp / "spec.json")])
    results = torch.load(tmp / "lora_results.pt", weights_only=False)
    return {"spec": spec, "batch": batch, "results": results}


def _hf_base(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _response_log_probs(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    ids, plen, lens = batch["input_ids"], batch["prompt_lengths"], batch["lengths"]
    logp = torch.log_softmax(logits, dim=-1)
    out = torch.zeros_like(batch["w"])
    for i in range(len(ids)):
        for k in range(int(lens[i] - plen[i])):
            t = int(plen[i]) + k
            out[i, k] = logp[i, t - 1, ids[i, t]]
    return out


@pytest.fixture(scope="module")
def peft_reference(lora_run) -> dict:
    """Per layout: the PEFT model's logits with that layout's exported adapters; for TP1/PP1
    also its adapter gradients of the worker's loss."""
    from peft import PeftModel

    spec, batch = lora_run["spec"], lora_run["batch"]
    ref: dict = {"base": None}
    for key in LAYOUTS:
        model = PeftModel.from_pretrained(
            _hf_base(spec["model"]), str(Path(spec["tmp"]) / f"peft_{key}"), is_trainable=True
        )
        model.train()  # dropout 0: train mode only turns on autograd bookkeeping
        logits = model(batch["input_ids"]).logits
        ref[key] = logits.detach()
        if key == "tp1_pp1":
            (_response_log_probs(logits, batch) * batch["w"]).sum().backward()
            ref["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}
            with torch.no_grad(), model.disable_adapter():
                ref["base"] = model(batch["input_ids"]).logits
    return ref


def test_logits_equal_hf_peft_at_every_layout(lora_run, peft_reference):
    vocab = peft_reference["base"].shape[-1]
    for key in LAYOUTS:
        got = lora_run["results"][key]["logits"][..., :vocab]
        print(f"{key}: logits vs HF + peft {(got - peft_reference[key]).abs().max():.3g}")
        assert (got - peft_reference[key]).abs().max() <= 1e-4, key
        # the adapters matter: far from the base model's logits
        assert (got - peft_reference["base"]).abs().max() > 1e-2, key


def test_exports_agree_across_layouts(lora_run, peft_reference):
    """Every layout exported the same adapters (same logits through PEFT as TP1/PP1)."""
    for key in LAYOUTS[1:]:
        assert (peft_reference[key] - peft_reference["tp1_pp1"]).abs().max() <= 1e-5, key


def test_adapters_off_is_the_base_model(lora_run, peft_reference):
    vocab = peft_reference["base"].shape[-1]
    for key in LAYOUTS:
        off = lora_run["results"][key]["logits_off"][..., :vocab]
        assert (off - peft_reference["base"]).abs().max() <= 1e-4, key


def _megatron_grads_as_peft(grads: dict, dims) -> dict:
    from megarl.models.lora_peft import adapters_to_hf

    return adapters_to_hf(grads, dims)


def test_adapter_grads_equal_peft_and_base_frozen(lora_run, peft_reference):
    """dA of a fused linear is the sum of PEFT's dA over q/k/v (gate/up): they share one A."""
    from megarl.config.model_dims import ModelDims, read_hf_config

    dims = ModelDims.from_hf_config(read_hf_config(lora_run["spec"]["model"]))
    ref = peft_reference["grads"]
    for key in LAYOUTS:
        r = lora_run["results"][key]
        assert r["base_grads"] == 0, key
        got = _megatron_grads_as_peft(r["grads"], dims)
        assert len(got) == len(ref), key
        worst = 0.0
        for name, g in got.items():
            peft_name = name.replace(".weight", ".default.weight")
            if ".lora_B." in name:
                want = ref[peft_name]
            else:  # shared A: sum the per-projection gradients of the same fused linear
                module = name.split(".lora_A.")[0]
                siblings = _fused_siblings(module)
                want = sum(ref[f"{m}.lora_A.default.weight"] for m in siblings)
            scale = max(1.0, want.abs().max().item())
            worst = max(worst, float((g - want).abs().max()) / scale)
            assert (g - want).abs().max() <= 1e-4 * scale, (key, name)
        print(f"{key}: adapter gradients vs peft, max relative difference {worst:.3g}")


def _fused_siblings(module: str) -> list[str]:
    head, leaf = module.rsplit(".", 1)
    if leaf in ("q_proj", "k_proj", "v_proj"):
        return [f"{head}.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    if leaf in ("gate_proj", "up_proj"):
        return [f"{head}.{p}" for p in ("gate_proj", "up_proj")]
    return [module]


def test_checkpoint_at_tp2_loads_at_pp2(lora_run):
    """The adapters saved by Megatron's distributed checkpoint at TP 2 (B of linear_qkv and
    linear_fc1 split by rows, A of linear_proj and linear_fc2 by columns) load bit-identically
    at PP 2 (over adapters initialised from another seed)."""
    from safetensors.torch import load_file

    tmp = Path(lora_run["spec"]["tmp"])
    saved = load_file(str(tmp / "peft_tp2_pp1" / "adapter_model.safetensors"))
    loaded = load_file(str(tmp / "peft_loaded" / "adapter_model.safetensors"))
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)


def test_hf_export_is_the_merged_policy(lora_run, peft_reference):
    """``export_hf_weights`` at TP 2 × PP 2 writes ``W + scaling·B·A``: transformers loads it
    with the logits of the base + adapters."""
    from transformers import AutoModelForCausalLM

    path = Path(lora_run["spec"]["tmp"]) / "merged_tp2_pp2"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(lora_run["batch"]["input_ids"]).logits
    assert (logits - peft_reference["tp1_pp1"]).abs().max() <= 1e-4


def test_adapter_path_loads_an_exported_adapter(lora_run, peft_reference):
    """``lora.adapter_path``: TP1/PP1's PEFT export loaded at TP 2 × PP 2 (over adapters of
    another seed) gives the logits of the same adapters at this layout (every layout started
    from the same full tensors: the same arithmetic) and HF + peft's; a PEFT adapter whose q/k/v
    A's differ (not one fused adapter) is refused in one line."""
    vocab = peft_reference["base"].shape[-1]
    r = lora_run["results"]["tp2_pp2"]
    got = r["logits_from_peft"][..., :vocab]
    assert (got - r["logits"][..., :vocab]).abs().max() <= 1e-6
    assert (got - peft_reference["tp1_pp1"]).abs().max() <= 1e-4
    said = r["untied_refusal"]
    assert said is not None and "\n" not in said and "different lora_A" in said, said
    said = r["other_base_refusal"]  # was torch's "The size of tensor a (64) must match ..."
    assert said is not None and "\n" not in said and "peft_hidden64" in said, said
    assert "q_proj.lora_A.weight has shape [4, 64]" in said and "takes [4, 128]" in said, said


def test_moe_lora_on_grouped_gemm_or_expert_tp_is_refused_in_one_line(lora_run):
    said = lora_run["results"]["moe_refusal"]
    assert said is not None and "\n" not in said and "grouped-GEMM" in said, said
    said = lora_run["results"]["etp_refusal"]
    assert said is not None and "\n" not in said, said
    assert "expert_tensor_parallel_size=1" in said, said


def _peft_moe_model(path: str, adapters: dict, lora: dict):
    """HF Qwen3-MoE + ``peft`` with megarl's adapters: q/k/v/o through ``target_modules``
    (PEFT form of the fused linear_qkv), each layer's fused expert parameters through
    ``target_parameters`` (peft's ``ParamWrapper``: A ``[E·r, in]`` read as ``(E, r, in)``, B
    ``[out, r·E]`` read as ``(out, r, E)``)."""
    import re

    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import ParamWrapper

    from megarl.config.model_dims import ModelDims, read_hf_config
    from megarl.models.lora_peft import adapters_to_hf

    dims = ModelDims.from_hf_config(read_hf_config(path))
    config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"],
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip
    model = get_peft_model(_hf_base(path), config)
    attention = {k: v for k, v in adapters.items() if ".experts." not in k}
    state = {k.replace(".weight", ".default.weight"): v
             for k, v in adapters_to_hf(attention, dims).items()}  # fmt: skip
    missing, _ = model.load_state_dict(state, strict=False)
    assert not [k for k in missing if ".lora_" in k and ".experts" not in k]
    seen = 0
    for name, module in model.named_modules():
        if not isinstance(module, ParamWrapper):
            continue
        layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
        which = "linear_fc1" if module.parameter_name == "gate_up_proj" else "linear_fc2"
        pairs = [adapters[f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{which}.weight"]
                 for e in range(dims.num_experts)]  # fmt: skip
        with torch.no_grad():
            module.lora_A["default"].weight.copy_(torch.cat([a for a, _ in pairs]))
            module.lora_B["default"].weight.copy_(
                torch.stack([b for _, b in pairs], dim=-1).flatten(1)
            )
        seen += 1
    assert seen == 2 * dims.num_layers
    return model


def test_moe_expert_adapters_equal_hf_peft(lora_run):
    """Adapters on attention and on every expert's fc1/fc2 (local spec's SequentialMLP) at
    EP 2 (each rank half the experts): logits = HF + peft (target_parameters on the fused
    expert weights) within 1e-4, and far from the base model's."""
    spec, moe = lora_run["spec"], lora_run["results"]["moe"]
    ids = lora_run["batch"]["input_ids"]
    model = _peft_moe_model(spec["moe_model"], moe["adapters"], spec["lora"])
    with torch.no_grad():
        want = model(ids).logits
        with model.disable_adapter():
            base = model(ids).logits
    got = moe["logits"][..., : want.shape[-1]]
    print(f"MoE LoRA logits vs HF + peft: {(got - want).abs().max():.3g}")
    assert (got - want).abs().max() <= 1e-4
    assert (got - base).abs().max() > 1e-2


def test_adapter_path_with_fused_expert_parameters_is_refused_in_one_line(tmp_path):
    """A PEFT folder of transformers 5's fused expert parameters (peft ``target_parameters``,
    what peft saves there) is refused naming the key, before any weight is read."""
    from megarl.models.lora import LoraError, LoraSettings
    from megarl.models.lora_peft import load_peft_adapter

    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    (tmp_path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 16, "target_modules": ["q_proj"],
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}))  # fmt: skip
    with pytest.raises(LoraError) as exc:
        load_peft_adapter([], None, LoraSettings(rank=4, alpha=16.0), tmp_path)
    said = str(exc.value)
    assert "\n" not in said and "lora.adapter_path" in said and "target_parameters" in said


def _layer_set(names: list[str]) -> set[int]:
    return {int(n.split(".")[2]) for n in names if n.startswith("decoder.layers.")}


def test_attach_adapters_selects_the_linears_verl_does(lora_run):
    """Megatron-Bridge's matcher through ``attach_adapters`` on a built 12-layer model at PP 2
    (layers by global index): ``exclude_modules: [layers.1]`` excludes nothing (no module is
    named so, and it is no whole name); ``[*.layers.1.*]`` is Bridge's regex, whose dots match
    any character: layers 1, 10 and 11 lose their adapters; both keep the output layer, which
    ``target_modules: []`` adapts; the default targets adapt the four linears of every layer
    and not the output layer."""
    got = lora_run["results"]["matching"]
    every = got["exclude layers.1"]
    assert len(every) == 4 * 12 + 1 and "output_layer.weight" in every
    kept = got["exclude *.layers.1.*"]
    assert _layer_set(every) - _layer_set(kept) == {1, 10, 11}
    assert "output_layer.weight" in kept and len(kept) == 4 * 9 + 1
    default = got["default targets"]
    assert len(default) == 48 and "output_layer.weight" not in default
    assert _layer_set(default) == set(range(12))


def test_adapters_are_created_on_their_weights_device(lora_run):
    """A model moved to the meta device gets its adapters there (was: always the CPU)."""
    assert lora_run["results"]["devices"] == [("meta", "meta", "meta")]


def test_output_layer_adapter_equals_hf_peft_at_tp2_pp2(lora_run, peft_reference):
    """``target_modules: []``: every linear and the (untied) output layer, vocab-parallel at
    TP 2 on the last of 2 stages: logits = HF + peft (lm_head's LoRA) within 1e-4; the merged
    HF export = the same; the TP2×PP2 checkpoint loaded at TP1×PP1 exports the same adapters
    bit for bit; ``lora.adapter_path`` of its PEFT export at TP1×PP1 = HF + peft too."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    spec, batch, out = lora_run["spec"], lora_run["batch"], lora_run["results"]["output_layer"]
    tmp = Path(spec["tmp"])
    assert "output_layer.weight" in out["adapted"]
    exported = load_file(str(tmp / "peft_out_tp2_pp2" / "adapter_model.safetensors"))
    lm_head = exported["base_model.model.lm_head.lora_B.weight"]
    assert lm_head.shape == (1000, spec["lora"]["rank"]) and lm_head.abs().max() > 0
    model = PeftModel.from_pretrained(_hf_base(spec["model"]), str(tmp / "peft_out_tp2_pp2"))
    with torch.no_grad():
        want = model(batch["input_ids"]).logits
        without_head = want - peft_reference["tp1_pp1"]
    vocab = want.shape[-1]
    got = out["logits"][..., :vocab]
    print(f"output-layer LoRA logits vs HF + peft: {(got - want).abs().max():.3g}")
    assert (got - want).abs().max() <= 1e-4
    assert without_head.abs().max() > 1e-2  # the head's adapter matters
    merged = AutoModelForCausalLM.from_pretrained(tmp / "merged_out_tp2_pp2", dtype=torch.float32)
    with torch.no_grad():
        assert (merged(batch["input_ids"]).logits - want).abs().max() <= 1e-4
    loaded = load_file(str(tmp / "peft_out_loaded" / "adapter_model.safetensors"))
    assert loaded.keys() == exported.keys()
    assert all(torch.equal(loaded[k], exported[k]) for k in loaded)
    assert (out["logits_from_peft"][..., :vocab] - want).abs().max() <= 1e-4  # at TP1×PP1


def _bridge_init(method: str, shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """Megatron-Bridge's ``ParallelLinearAdapter._get_init_fn`` at TP 1 (one shard: the
    whole ``[out, in]`` matrix): torch's own init functions on a tensor of that shape."""
    t = torch.empty(shape)
    if method == "xavier":
        return torch.nn.init.xavier_normal_(t, generator=g)
    if method == "kaiming":
        return torch.nn.init.kaiming_uniform_(t, a=5**0.5, generator=g)
    return torch.nn.init.normal_(t, mean=0.0, std=0.2, generator=g)


def test_init_scale_is_bridges_at_tp1_for_every_method(lora_run):
    """A and B of the row-parallel ``linear_proj`` and the column-parallel ``linear_fc1`` of
    12 layers (rank 8, hidden 128, fc1 rows 2·intermediate), as ``attach_adapters`` draws them,
    against torch's ``xavier_normal_`` / ``kaiming_uniform_(a=√5)`` / ``normal_(0, 0.2)`` on
    tensors of the same shapes: the same standard deviation within 5 % and, for kaiming, the
    same bound (1/√in)."""
    g = torch.Generator().manual_seed(0)
    for method, kinds in lora_run["results"]["init"].items():
        for kind, pairs in kinds.items():
            assert len(pairs) == 12, (method, kind)
            for which in (0, 1):  # A [r, in], B [out, r]
                got = torch.stack([p[which] for p in pairs])
                want = torch.stack([_bridge_init(method, tuple(got.shape[1:]), g) for _ in pairs])
                ratio = float(got.std() / want.std())
                assert abs(ratio - 1) < 0.05, (method, kind, which, ratio)
                if method == "kaiming":
                    bound = 1 / got.shape[2] ** 0.5
                    assert bound * 0.95 < float(got.abs().max()) <= bound, (kind, which)


def test_the_adapter_gather_goes_over_gloo(lora_run):
    """With the default group reading as NCCL, the whole-model adapter gather of an
    adapter-only sync creates a gloo group and sends its objects there (same adapters)."""
    got = lora_run["results"]["output_layer"]["object_group"]
    assert got == {"groups": 1, "backend": "gloo", "same": True}, got
