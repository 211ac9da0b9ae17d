"""LoRA mistakes caught by ``megarl train``'s pre-flight (issue 53, LoRA items; issue 52's
matching and output layer): each one line naming the key, value or file, exit 2, nothing
launched (the ``no_launch`` fixture fails a case that gets past it); and Megatron-Bridge's module
matcher over the model's linears as the pre-flight lists them from its shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.commands import train
from megarl.config import load_config, validate
from megarl.config import lora_modules as lm
from tests.trainer.test_preflight_faults import no_launch, tiny  # noqa: F401 -- fixtures

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "grpo_lora_tiny_cpu.yaml")
L = "actor_rollout_ref.model.lora"


def _write_peft(folder, *, r: int = 16, alpha: float = 32, hidden: int = 128, config=None):
    """A PEFT LoRA folder: one q_proj adapter of rank ``r`` for a model of width ``hidden``."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{key}.lora_A.weight": torch.zeros(r, hidden),
               f"{key}.lora_B.weight": torch.zeros(128, r)},
              str(folder / "adapter_model.safetensors"))  # fmt: skip
    if config is None:
        config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["q_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def _lora_checkpoint(root, *, rank: int):
    """A complete ``global_step_3`` whose actor meta records rank-``rank`` adapters, as
    ``megarl/checkpoint/trainer_ckpt.py`` writes it (``dataclasses.asdict(LoraSettings)``)."""
    step = root / "ckpt_run" / "global_step_3"
    (step / "actor").mkdir(parents=True, exist_ok=True)
    hf_config = json.loads((root / "model" / "config.json").read_text())
    lora = {"rank": rank, "alpha": 32.0, "dropout": 0.0, "dropout_position": "pre",
            "target_modules": list(lm.DEFAULT_TARGETS), "exclude_modules": [],
            "a_init": "xavier", "b_init": "zero", "seed": 0}  # fmt: skip
    meta = {"hf_config": hf_config, "lora": lora, "model_holds": "lora_adapters"}
    (step / "actor" / "megarl_meta.json").write_text(json.dumps(meta))
    (step / "trainer_state.json").write_text("{}")
    (step / "COMPLETE").write_text("")
    return step


@pytest.fixture(scope="module")
def lora_files(tiny):  # noqa: F811 -- the imported fixture
    from megarl.models.tiny import make_tiny_model

    root = tiny["root"]
    files = {
        "other_base": _write_peft(root / "peft_h64", hidden=64),
        "other_rank": _write_peft(root / "peft_r8", r=8),
        "not_peft": _write_peft(root / "not_peft", config={"model_type": "qwen2"}),
        "ckpt16": _lora_checkpoint(root, rank=16),
    }
    make_tiny_model(root / "tied", family="qwen2", tie_word_embeddings=True)
    return files


ALL = "[linear_qkv,linear_proj,linear_fc1,linear_fc2,output_layer]"
CASES = [
    ("alpha 0", [f"{L}.alpha=0"], f"{L}.alpha=0.0 scales every adapter's output by 0"),
    ("exclude every target", [f"{L}.target_modules=[]", f"{L}.exclude_modules={ALL}"],
     "leave no linear of"),
    ("target entry matching nothing", [f"{L}.target_modules=['*.layers.9.*']"],
     "'*.layers.9.*' matches no linear"),
    ("adapter of another base", [f"{L}.adapter_path={{other_base}}"],
     "self_attn.q_proj.lora_A.weight in"),
    ("adapter of another rank", [f"{L}.adapter_path={{other_rank}}"],
     f"holds an adapter of r=8, lora_alpha=32; set {L}.rank=8"),
    ("non-PEFT adapter_config.json", [f"{L}.adapter_path={{not_peft}}"],
     "adapter_config.json is not a PEFT LoRA adapter's (peft_type=null"),
    ("resume rank 16 with rank 8", [f"{L}.rank=8", "trainer.resume_mode=resume_path",
                                    "trainer.resume_from_path={ckpt16}"],
     f"holds LoRA adapters of rank 16 but {L}.rank=8"),
    ("output layer, adapter-only sync", [f"{L}.target_modules=[output_layer]"],
     f"adapts output_layer with {L}.merge=false"),
    ("output layer, tied embeddings", [f"{L}.target_modules=[output_layer]", f"{L}.merge=true",
                                       "actor_rollout_ref.model.path={root}/tied"],
     "tie_word_embeddings=true): not built; add output_layer to"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "named"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_lora_mistake_is_one_line_and_exit_2(tiny, lora_files, no_launch, capsys, overrides,  # noqa: F811
                                               named):  # fmt: skip
    root = tiny["root"]
    base = [f"actor_rollout_ref.model.path={root / 'model'}",
            f"data.train_files={root / 'data' / 'train.parquet'}",
            f"data.val_files={root / 'data' / 'test.parquet'}",
            f"trainer.default_local_dir={root / 'run'}"]  # fmt: skip
    given = [o.format(root=root, **lora_files) for o in overrides]
    code = train.main(["-c", CONFIG, *base, *given])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert named in lines[0] and "Traceback" not in err, lines[0]


def test_the_resumed_checkpoints_own_settings_pass(tiny, lora_files, no_launch, capsys):  # noqa: F811
    """The same checkpoint resumed with its rank gets past the LoRA check (to the shard
    files, which this hand-made checkpoint lacks: that refusal names the metadata)."""
    root = tiny["root"]
    code = train.main(["-c", CONFIG, f"actor_rollout_ref.model.path={root / 'model'}",
                       f"data.train_files={root / 'data' / 'train.parquet'}",
                       f"data.val_files={root / 'data' / 'test.parquet'}",
                       f"trainer.default_local_dir={root / 'run'}",
                       "trainer.resume_mode=resume_path",
                       f"trainer.resume_from_path={lora_files['ckpt16']}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and ".metadata" in err and "LoRA" not in err, err  # past the LoRA check


def _names(layers: int = 12) -> list[str]:
    return lm.linear_names({"num_layers": layers, "num_experts": 0})


def _layers(names: list[str]) -> list[int]:
    return sorted({int(n.split(".")[2]) for n in names if n.startswith("decoder.")})


def test_bridges_matcher_selects_what_verl_does():
    """Bridge's rules (peft/module_matcher.py, utils.wildcard_match): ``layers.1`` is neither a
    module's name nor a whole name, so it excludes nothing; ``*.layers.1.*`` is a regex whose
    dots match any character, so it excludes layer 1 and layers 10-19; the default targets are
    the four linears of every layer; ``target_modules: []`` adapts every linear, the output
    layer too."""
    names = _names()
    every = lm.targeted_names(names, [], [])
    assert len(every) == 4 * 12 + 1 and "output_layer" in every
    assert lm.targeted_names(names, [], ["layers.1"]) == every
    kept = lm.targeted_names(names, [], ["*.layers.1.*"])
    assert set(_layers(names)) - set(_layers(kept)) == {1, 10, 11}
    assert "output_layer" in kept
    assert lm.targeted_names(names, [], [r"*.layers\.1\.*"]) == [
        n for n in every if not n.startswith("decoder.layers.1.")
    ]
    default = lm.targeted_names(names, lm.DEFAULT_TARGETS, [])
    assert len(default) == 48 and "output_layer" not in default
    only = lm.targeted_names(names, ["*.layers.0.*.linear_qkv"], [])
    assert only == ["decoder.layers.0.self_attention.linear_qkv"]
    assert lm.targeted_names(names, [], ["linear_fc2", "output_layer"]) == [
        n for n in every if not n.endswith(("linear_fc2", "output_layer"))
    ]


def test_exclude_entries_that_surprise_are_warned_about():
    """verl's outcome stands; the pre-flight says what a user reading '.' as a dot, or a path
    prefix as a pattern, did not mean."""
    lora = [f"{L}.target_modules=[]", f"{L}.merge=true"]
    warned = validate(load_config(CONFIG, [*lora, f"{L}.exclude_modules=[layers.1]"]), 2)
    assert any("'layers.1' matches no linear" in w for w in warned), warned
    deep = ["actor_rollout_ref.model.architecture.num_hidden_layers=12"]
    warned = validate(load_config(CONFIG, [*lora, *deep, f"{L}.exclude_modules=['*.layers.1.*']"]),
                      2)  # fmt: skip
    said = [w for w in warned if "'*.layers.1.*' also matches decoder.layers.10." in w]
    assert len(said) == 1 and "\n" not in said[0], warned
