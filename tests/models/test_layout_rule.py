"""One rule for legal layouts, anchored to Megatron itself.

Megatron-Core builds and runs one transformer layer (local spec, CPU emulation) for every row of
``_layout_rule_checks.ROWS`` at TP = 2 and TP = 4, inside the existing multi-rank launches; it
must succeed exactly for the rows megarl's rule accepts. Config validation, ``megarl convert``'s
input check and the resharding plan (``megarl plan``) must give the rule's verdict on every row.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from megarl.commands import plan as plan_cli
from megarl.commands.convert_inputs import ConvertError, check_inputs
from megarl.config import ConfigError, load_config, validate
from megarl.parallel.layout import ParallelLayout, layout_problems
from tests.models._layout_rule_checks import FFN, ROWS, hf_config

GRPO = Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny_cpu.yaml"
ARCH = "actor_rollout_ref.model.architecture"


def rule_accepts(row: tuple[int, int, int], tp: int) -> bool:
    heads, kv, head_dim = row
    problems = layout_problems(
        ParallelLayout(tp),
        num_attention_heads=heads,
        num_query_groups=kv,
        num_layers=1,
        ffn_hidden_size=FFN,
        head_dim=head_dim,
    )
    return not problems


def validation_accepts(row: tuple[int, int, int], tp: int) -> bool:
    hf = hf_config(*row)
    overrides = [
        "actor_rollout_ref.model.path=/nonexistent/layout-rule-model",
        f"trainer.n_gpus_per_node={tp}",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"{ARCH}.architecture={hf['architectures'][0]}",
        f"{ARCH}.max_position_embeddings=512",
    ] + [
        f"{ARCH}.{key}={hf[key]}"
        for key in ("num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                    "hidden_size", "head_dim", "intermediate_size", "vocab_size")
    ]  # fmt: skip
    try:
        validate(load_config(GRPO, overrides), tp)
    except ConfigError:
        return False
    return True


def convert_accepts(row: tuple[int, int, int], tp: int, tmp_path: Path) -> bool:
    model = tmp_path / "-".join(map(str, row))
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(hf_config(*row)))
    # an empty but well-formed safetensors file: its header is checked, not its tensors
    (model / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    args = argparse.Namespace(
        command="hf-to-megatron", hf_path=str(model), out=str(tmp_path / "out"), force=False,
        tp=tp, pp=1, vpp=None, num_sequences=1, seq_len=8,
    )  # fmt: skip
    try:
        check_inputs(args)
    except ConvertError:
        return False
    return True


def plan_accepts(row: tuple[int, int, int], tp: int, tmp_path: Path) -> bool:
    path = tmp_path / f"plan-{'-'.join(map(str, row))}.json"
    path.write_text(json.dumps(hf_config(*row)))
    code = plan_cli.main(["reshard", "--model", str(path), "--tp", str(tp), "--rollout-tp", "1"])
    assert code in (0, 2)
    return code == 0


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_megatron_builds_exactly_the_layouts_the_rule_accepts(world, request):
    verdicts = request.getfixturevalue(f"ws{world}")[f"layout_rule/tp{world}"]
    assert set(verdicts) == set(ROWS)
    for row in ROWS:
        built = verdicts[row] is None
        assert built == rule_accepts(row, world), (row, f"TP={world}", verdicts[row])
    accepted = [row for row in ROWS if rule_accepts(row, world)]
    assert 0 < len(accepted) < len(ROWS)  # the table holds both verdicts at each TP
    assert (4, 1, 8) in accepted  # TP above the KV heads: each rank holds the one group


@pytest.mark.parametrize("tp", [2, 4])
def test_validation_convert_and_plan_give_the_rule_verdict(tp, tmp_path, capsys):
    for row in ROWS:
        expected = rule_accepts(row, tp)
        assert validation_accepts(row, tp) == expected, (row, tp, "config validation")
        assert convert_accepts(row, tp, tmp_path) == expected, (row, tp, "convert inputs")
        assert plan_accepts(row, tp, tmp_path) == expected, (row, tp, "resharding plan")
    capsys.readouterr()
