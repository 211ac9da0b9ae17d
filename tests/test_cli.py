"""The megarl command: config show/validate/keys, train, forwarding; errors without tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import megarl.commands
from megarl.cli import main
from megarl.config import load_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
GRPO = str(CONFIGS / "grpo_tiny_cpu.yaml")
PPO = str(CONFIGS / "ppo_tiny_cpu.yaml")
MEG = "actor_rollout_ref.actor.megatron"
ROLL = "actor_rollout_ref.rollout"


@pytest.fixture(autouse=True)
def _hermetic(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_subprocess(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_CACHE": str(cwd / "hf-cache")}
    return subprocess.run(
        [sys.executable, "-m", "megarl.cli", *argv],
        check=False,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_paragraph_error(err: str, *names: str) -> None:
    assert err.startswith("error: "), err
    assert "Traceback" not in err
    assert "\n\n" not in err.strip(), "the message should be one paragraph"
    for name in names:
        assert name in err, f"{name!r} missing from {err!r}"


# -- config show / validate / keys ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_show_output_loads_back_to_an_identical_config(name, capsys, tmp_path):
    code, out, _ = run_cli(capsys, "config", "show", "--config", str(CONFIGS / name))
    assert code == 0
    (tmp_path / "shown.yaml").write_text(out)
    assert load_config(tmp_path / "shown.yaml") == load_config(CONFIGS / name)


def test_show_applies_overrides_given_anywhere(capsys, tmp_path):
    code, out, _ = run_cli(
        capsys, "config", "show", "data.train_batch_size=16", "-c", GRPO, "trainer.seed=3"
    )
    assert code == 0
    (tmp_path / "shown.yaml").write_text(out)
    cfg = load_config(tmp_path / "shown.yaml")
    assert (cfg.data.train_batch_size, cfg.trainer.seed) == (16, 3)


def test_later_config_files_override_earlier_ones(capsys, tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text("trainer: {experiment_name: from-extra}\n")
    code, out, _ = run_cli(capsys, "config", "show", "-c", GRPO, "-c", str(extra))
    assert code == 0 and "experiment_name: from-extra" in out


def test_validate_reports_the_layout(capsys):
    code, out, err = run_cli(capsys, "config", "validate", "--config", PPO, "--world-size", "2")
    assert code == 0
    assert out.startswith("ok: ") and "TP 1 × PP 2" in out and "critic on" in out
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["data.train_batch_size=abc"], ["data.train_batch_size", "'abc'"]),
        (["actor_rollout_ref.actor.clip_ratoi=0.3"], ["clip_ratoi", "clip_ratio"]),
        (["--world-size", "4"], ["world size 4", "trainer.nnodes", "trainer.n_gpus_per_node"]),
        ([f"{MEG}.tensor_model_parallel_size=4"], [f"{MEG}.tensor_model_parallel_size"]),
        ([f"{ROLL}.top_p=0.95"], [f"{ROLL}.top_p", "allow_non_unit_top_p_top_k"]),
        ([f"{ROLL}.n=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"],
         ["algorithm.adv_estimator=grpo", f"{ROLL}.n"]),
        (["critic.enable=false", "algorithm.adv_estimator=gae"], ["critic.enable", "gae"]),
        (["actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1"],
         ["actor_rollout_ref.ref.megatron.tensor_model_parallel_size", "Megatron-Core 0.16"]),
        (["data.train_batch_size=5"], ["data.train_batch_size=5", "ppo_mini_batch_size"]),
        (["actor_rollout_ref.model.architecture.num_hidden_layers=3",
          f"{MEG}.tensor_model_parallel_size=1", f"{MEG}.pipeline_model_parallel_size=2"],
         ["num_hidden_layers=3", "pipeline_model_parallel_size"]),
        (["+actor_rollout_ref.actor.fsdp_config.param_offload=true"], ["fsdp_config"]),
        (["actor_rollout_ref.rollout.engine_kwargs.x=1"], ["+actor_rollout_ref.rollout.engine_kwargs.x=1"]),
    ],
)  # fmt: skip
def test_validate_errors_exit_2_with_one_paragraph(argv, names, capsys):
    code, out, err = run_cli(capsys, "config", "validate", "-c", GRPO, *argv)
    assert code == 2 and out == ""
    assert_one_paragraph_error(err, *names)


def test_several_problems_stay_one_paragraph(capsys):
    code, _, err = run_cli(
        capsys, "config", "validate", "-c", GRPO, f"{ROLL}.top_p=0.5", "trainer.save_freq=0"
    )
    assert code == 2
    assert_one_paragraph_error(err, f"{ROLL}.top_p", "trainer.save_freq", "2 problems")


def test_missing_config_file(capsys, tmp_path):
    code, _, err = run_cli(capsys, "config", "validate", "-c", str(tmp_path / "nope.yaml"))
    assert code == 2
    assert_one_paragraph_error(err, "nope.yaml", "not found")


def test_unknown_option_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["config", "show", "--bogus"])
    assert info.value.code == 2
    assert "--bogus" in capsys.readouterr().err


def test_keys_lists_defaults_and_docs(capsys):
    code, out, _ = run_cli(capsys, "config", "keys", "algorithm.rollout_correction.rollout_is")
    assert code == 0
    assert "algorithm.rollout_correction.rollout_is = null" in out
    assert "per token or sequence" in out


def test_keys_show_resolved_defaults_of_following_keys(capsys):
    code, out, _ = run_cli(capsys, "config", "keys", "critic.")
    assert code == 0
    assert "critic.ppo_mini_batch_size = 256\n" in out  # the actor's, not null
    assert "critic.megatron.sequence_parallel = true\n" in out
    _, out, _ = run_cli(capsys, "config", "keys", "trainer.default_local_dir")
    assert "trainer.default_local_dir = checkpoints/verl_examples/gsm8k\n" in out


# -- train ----------------------------------------------------------------------------------


def _fake_trainer(monkeypatch) -> list:
    """Replace the rank's run (:func:`megarl.trainer.loop.run`, what :func:`megarl.trainer.start`
    hands the checked config to) by a recorder."""
    calls: list = []
    module = types.ModuleType("megarl.trainer.loop")
    module.run = lambda cfg: calls.append(cfg) or 0
    monkeypatch.setitem(sys.modules, "megarl.trainer.loop", module)
    # Also the package attribute: once an earlier test imported megarl.trainer.loop, `from
    # megarl.trainer import loop` finds the real one there and not in sys.modules.
    import megarl.trainer

    monkeypatch.setattr(megarl.trainer, "loop", module, raising=False)
    return calls


def _tiny_files(tmp_path: Path) -> None:
    model = tmp_path / "outputs/tiny-qwen2"
    model.mkdir(parents=True)
    (model / "config.json").write_text(
        json.dumps(
            {
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 4,
                "hidden_size": 128,
                "vocab_size": 1000,
                "max_position_embeddings": 512,
            }
        )
    )
    (tmp_path / "outputs/tiny-data").mkdir(parents=True)
    (tmp_path / "outputs/tiny-data/train.parquet").write_bytes(b"")
    (tmp_path / "outputs/tiny-data/test.parquet").write_bytes(b"")


def test_train_calls_the_trainer_with_the_validated_config(capsys, monkeypatch, tmp_path):
    calls = _fake_trainer(monkeypatch)
    _tiny_files(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")  # inside the launched world: train in this process
    code, _, err = run_cli(capsys, "train", "-c", GRPO, "trainer.seed=9")
    assert code == 0, err
    assert len(calls) == 1 and calls[0].trainer.seed == 9


def test_train_checks_files_and_world_size_before_starting(capsys, monkeypatch, tmp_path):
    calls = _fake_trainer(monkeypatch)
    code, _, err = run_cli(capsys, "train", "-c", GRPO)
    assert code == 2 and not calls
    assert_one_paragraph_error(err, "data.train_files")
    _tiny_files(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "4")  # as set by torchrun
    code, _, err = run_cli(capsys, "train", "-c", GRPO)
    assert code == 2 and not calls
    assert_one_paragraph_error(err, "world size 4")


# -- forwarded subcommands -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "module"),
    [
        ("convert", "megarl.commands.convert"),
        ("plan", "megarl.commands.plan"),
        ("data", "megarl.commands.data"),
        ("tracking", "megarl.commands.tracking"),
    ],
)
def test_forwarded_subcommands(command, module, monkeypatch):
    seen: list = []
    fake = types.ModuleType(module)
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, module, fake)
    monkeypatch.setattr(megarl.commands, module.rsplit(".", 1)[1], fake, raising=False)
    assert main([command, "sub", "--tp", "2"]) == 0
    assert seen == [["sub", "--tp", "2"]]


# -- as a process --------------------------------------------------------------------------


def test_process_errors_have_no_traceback(tmp_path):
    result = run_subprocess(
        "config", "validate", "-c", GRPO, "data.train_batch_size=abc", cwd=tmp_path
    )
    assert result.returncode == 2 and result.stdout == ""
    assert_one_paragraph_error(result.stderr, "data.train_batch_size")
    result = run_subprocess(
        "config", "validate", "-c", GRPO, "actor_rollout_ref.actor.clip_ratoi=0.3", cwd=tmp_path
    )
    assert result.returncode == 2
    assert_one_paragraph_error(result.stderr, "did you mean 'actor_rollout_ref.actor.clip_ratio'")


def test_process_show_round_trips_and_does_not_import_torch(tmp_path):
    result = run_subprocess("config", "show", "-c", PPO, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (tmp_path / "shown.yaml").write_text(result.stdout)
    assert load_config(tmp_path / "shown.yaml") == load_config(PPO)
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, megarl.cli; print('torch' in sys.modules)"],
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.stdout.strip() == "False", probe.stderr
