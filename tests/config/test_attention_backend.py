"""Transformer Engine has no fp32 attention for packed rows or context parallelism (TE 2.9: flash
and cuDNN attention take 16-bit inputs only, its unfused attention refuses THD and CP): the run
would stop at its first forward with "No dot product attention backend", after start-up. The
pre-flight refuses it in one line naming the keys; ``auto`` is TE's spec on CUDA."""

from __future__ import annotations

from megarl.commands.train import main as train_main
from megarl.config import ConfigError, load_config, validate
from tests.config._bad_configs import GRPO

MEG = "actor_rollout_ref.actor.megatron"
ON_CUDA = ["trainer.device=cuda", "trainer.dtype=fp32", f"{MEG}.transformer_impl=auto",
           "actor_rollout_ref.ref.megatron.transformer_impl=local"]  # fmt: skip


def _problems(overrides: list[str]) -> list[str]:
    try:
        validate(load_config(GRPO, overrides), 2)
    except ConfigError as exc:
        return exc.problems
    return []


def test_fp32_te_with_packing_is_refused_in_one_line():
    expected = (
        f"trainer.dtype=fp32 with {MEG}.transformer_impl=auto (Transformer Engine on CUDA) and "
        f"packed sequences (use_remove_padding): TE has no fp32 attention for them; use "
        f"trainer.dtype=bf16 or {MEG}.transformer_impl=local, or {MEG}.use_remove_padding=false"
    )
    assert _problems(ON_CUDA) == [expected]


def test_fp32_te_with_context_parallelism_names_cp_and_every_model():
    problems = _problems([*ON_CUDA[:2], f"{MEG}.transformer_impl=transformer_engine",
                          f"{MEG}.tensor_model_parallel_size=1", f"{MEG}.context_parallel_size=2"])  # fmt: skip
    assert len(problems) == 1, problems
    assert f"{MEG}.transformer_impl=transformer_engine" in problems[0]
    assert "context_parallel_size=2" in problems[0]
    assert "(the same for actor_rollout_ref.ref)" in problems[0]  # ref: auto on CUDA


def test_what_te_runs_in_fp32_or_off_cuda_passes():
    assert _problems([*ON_CUDA, f"{MEG}.use_remove_padding=false"]) == []  # padded rows
    assert _problems([*ON_CUDA[:1], "trainer.dtype=bf16", *ON_CUDA[2:]]) == []
    assert _problems(["trainer.device=cpu", *ON_CUDA[1:]]) == []  # auto: the local spec
    assert _problems([*ON_CUDA[:2], f"{MEG}.transformer_impl=local"]) == []


def test_megarl_train_check_stops_before_launching(capsys, tiny_overrides):
    assert train_main(["--check", "--config", str(GRPO), *tiny_overrides,
                       *ON_CUDA]) == 2  # fmt: skip
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    # One line (here with the missing CUDA device beside it: this machine has none).
    assert len(err) == 1 and "trainer.dtype=fp32 with " in err[0], err
