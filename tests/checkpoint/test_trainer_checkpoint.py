"""Trainer checkpoints against real uninterrupted runs (issue 13), on 2 CPU ranks, actor engine.

One 4-step reference run (TP 2, ``save_freq=2``) serves the checks; every other launch starts
from a copy of its ``global_step_2`` and must continue exactly as the reference did. Launches
are the cost (each imports Megatron on two ranks), so each one serves several checks — 6 in all
(the diamond of PPO with a critic, ``ppo_epochs`` 2 and adaptive KL, stopped by SIGTERM to one
rank among other stops, is tests/trainer/test_faults.py's):

- kill (2 launches): rank 1 SIGKILLed while its checkpoint writers are writing step 4 (a test
  hook makes them sleep); no process of that job survives; the next launch warns about the
  partial directory, resumes from step 2, matches the reference (metrics, prompts, final
  weights) and keeps one checkpoint (``max_actor_ckpt_to_keep=1``);
- layout (1): resumed at TP1×PP2 split unevenly (1 + 3 layers; distributed optimizer) with a
  changed lr under the checkpoint policy, stopped through the STOP file: step 3 equals the
  reference's;
- SIGINT (2): ``megarl train`` resumed with a changed lr runs step 3 with the config's lr
  (default policy), then SIGINT twice (the second: stop now, unsaved): every process gone, no new checkpoint; the next launch loads
  step 2 at DP2 (distributed optimizer) and its step 3 equals the reference's.

Small steps (4 prompts × 4 responses, two mini-batches) keep each launch short.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from itertools import count
from pathlib import Path

import psutil
import pytest
import torch

from tests._run_outputs import read_metrics, rollout_prompts
from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

CONFIG = "configs/grpo_tiny_cpu.yaml"
# Non-timing metrics every diamond compares (all other non-timing keys are compared too).
COMPARED = (
    "critic/score/mean",
    "critic/advantages/max",
    "response_length/mean",
    "prompt_length/mean",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/kl_loss",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "rollout/logprob_diff_max",
)
TIMING = ("timing_s/", "perf/")
# 16 responses a step in two mini-batches (of 2 prompts × 4), two micro-batches each at DP 1.
SMALL_STEPS = (
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
)
# Generous bounds on waits (2 loaded cores): a launch imports Megatron on two ranks (~30 s).
LAUNCH_TIMEOUT_S = 600
TORCHRUN_KILL_GRACE_S = 30  # torchrun SIGKILLs its workers 30 s after forwarding a signal
_LAUNCHES = count()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    from megarl.commands import data
    from megarl.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("ckpt")
    make_tiny_model(root / "model", family="qwen2")
    make_tiny_model(root / "llama", family="llama")
    assert data.main(["synth", "--out", str(root / "data"), "--train-size", "64"]) == 0
    return {"root": root, "model": root / "model", "data": root / "data"}


def _args(tiny: dict, run_dir: Path, *extra: str) -> list[str]:
    return [
        "-c", CONFIG,
        f"actor_rollout_ref.model.path={tiny['model']}",
        f"data.train_files={tiny['data'] / 'train.parquet'}",
        f"data.val_files={tiny['data'] / 'test.parquet'}",
        "actor_rollout_ref.rollout.name=actor",
        "trainer.total_training_steps=4",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=2",
        "reward_model.dump_samples=-1",
        f"trainer.rollout_data_dir={run_dir / 'rollouts'}",
        f"trainer.default_local_dir={run_dir}",
        *SMALL_STEPS,
        *extra,
    ]  # fmt: skip


def _start(tiny: dict, run_dir: Path, *extra: str, env: dict | None = None, launcher=False):
    """torchrun (or ``megarl train`` with ``launcher``) in its own session, output to a file."""
    run_dir.mkdir(parents=True, exist_ok=True)
    args = _args(tiny, run_dir, *extra)
    if launcher:
        cmd = [sys.executable, "-m", "megarl.cli", "train", *args]
    else:
        torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        cmd = [sys.executable, *torchrun, "-m", "megarl.train", *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full_env["PYTHONPATH"] = f"{REPO}{os.pathsep}{full_env.get('PYTHONPATH', '')}"
    out = open(run_dir.parent / f"{run_dir.name}-{next(_LAUNCHES)}.out", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
    proc.out_path = Path(out.name)  # type: ignore[attr-defined]
    return proc


def _finish(proc, timeout: float = LAUNCH_TIMEOUT_S) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"launch timed out:\n{proc.out_path.read_text()[-6000:]}")
    return code, proc.out_path.read_text()


def _run(tiny: dict, run_dir: Path, *extra: str, expect: int = 0) -> str:
    code, out = _finish(_start(tiny, run_dir, *extra))
    assert code == expect, out[-6000:]
    return out


def _largest_difference(
    a: dict[str, float], b: dict[str, float], required: tuple[str, ...] = COMPARED
) -> float:
    keys = [k for k in a if not k.startswith(TIMING)]
    assert set(required) <= set(keys) and set(keys) == {k for k in b if not k.startswith(TIMING)}
    return max(abs(a[k] - b[k]) for k in keys)


def _weights(run_dir: Path, step: int = 4) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    hf = run_dir / f"global_step_{step}" / "actor" / "huggingface"
    return {k: v for f in sorted(hf.glob("*.safetensors")) for k, v in load_file(f).items()}


def _weight_difference(a: Path, b: Path, step: int = 4) -> float:
    wa, wb = _weights(a, step), _weights(b, step)
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def _from_step_2(reference: Path, run_dir: Path) -> Path:
    """A fresh run directory holding a copy of the reference's step-2 checkpoint."""
    shutil.copytree(reference / "global_step_2", run_dir / "global_step_2")
    (run_dir / "latest_checkpointed_iteration.txt").write_text("2\n")
    return run_dir


def _wait_for(condition, what: str, timeout: float = LAUNCH_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout  # a timeout, not a timing claim
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def _family(proc) -> list[psutil.Process]:
    return [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]


def _survivors(processes: list[psutil.Process], timeout: float) -> list[str]:
    """Processes still running (not zombies) after waiting up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for p in processes:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{p.pid} {' '.join(p.cmdline()[:4])}")
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def _announced(run_dir: Path) -> bool:
    log = run_dir / "logs" / "rank0.log"
    return log.exists() and " rank(s), TP " in log.read_text(errors="replace")


def _stepped(run_dir: Path, step: int) -> bool:
    """Whether ``step``'s metrics are in metrics.jsonl (read while the run appends to it)."""
    try:
        return step in read_metrics(run_dir)
    except (FileNotFoundError, json.JSONDecodeError):
        return False


@pytest.fixture(scope="module")
def reference(tiny) -> Path:
    run_dir = tiny["root"] / "reference"
    out = _run(tiny, run_dir)
    assert "saved" in out and (run_dir / "global_step_2").is_dir()
    return run_dir


def test_kill_mid_write_then_resume_equals_the_uninterrupted_run(tiny, reference):
    run_dir = _from_step_2(reference, tiny["root"] / "killed")
    slow = {"MEGARL_TEST_SLOW_CHECKPOINT": "4:120:1"}  # rank 1's step-4 writers sleep 120 s
    proc = _start(tiny, run_dir, env=slow)
    pid_file = run_dir / "test_hooks" / "saving-rank1.pid"
    _wait_for(pid_file.exists, "rank 1 to start saving step 4")
    rank1 = psutil.Process(int(pid_file.read_text()))
    # Rank 1's Manager plus at least one forked writer: the kill lands mid-write.
    _wait_for(lambda: len(rank1.children()) >= 2, "rank 1's checkpoint writers")
    job = _family(proc)
    writers = rank1.children()
    rank1.kill()
    code, _ = _finish(proc)
    assert code != 0
    assert _survivors(job, timeout=TORCHRUN_KILL_GRACE_S + 30) == [], writers
    assert (run_dir / "global_step_4.tmp").is_dir()
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    out = _run(tiny, run_dir, "trainer.max_actor_ckpt_to_keep=1")
    assert f"incomplete checkpoint directory: {run_dir / 'global_step_4.tmp'}" in out, out
    assert f"resumed from {run_dir / 'global_step_2'}" in out
    ref, got = read_metrics(reference), read_metrics(run_dir)
    worst = max(_largest_difference(ref[s], got[s]) for s in (3, 4))
    weights = _weight_difference(reference, run_dir)
    print(f"diamond (ppo_epochs 1): metrics {worst:.3g}, weights {weights:.3g}")
    assert worst <= 1e-6 and weights <= 1e-6
    assert all(rollout_prompts(reference, s) == rollout_prompts(run_dir, s) for s in (3, 4))
    # Retention: only the newest complete checkpoint is left.
    assert sorted(p.name for p in run_dir.glob("global_step_*")) == ["global_step_4"]


def test_resume_at_tp1_pp2_continues_exactly_under_the_checkpoint_lr(tiny, reference):
    """The TP 2 checkpoint resumed at PP 2 split unevenly (stage 0: 1 of the 4 layers, verl's
    ``override_transformer_config.num_layers_in_first_pipeline_stage``), and saved there."""
    run_dir = _from_step_2(reference, tiny["root"] / "tp1_pp2")
    (run_dir / "STOP").write_text("")  # stop (with a checkpoint) after the first step
    out = _run(
        tiny,
        run_dir,
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "+actor_rollout_ref.actor.megatron.override_transformer_config."
        "num_layers_in_first_pipeline_stage=1",
        "actor_rollout_ref.actor.optim.lr=2e-4",
        "actor_rollout_ref.actor.optim.use_checkpoint_opt_param_scheduler=true",
    )
    assert "stopped after step 3" in out and not (run_dir / "STOP").exists()
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    saved = json.loads((run_dir / "global_step_3" / "actor" / "megarl_meta.json").read_text())
    assert saved["saved_layout"]["num_layers_in_first_pipeline_stage"] == 1
    got = read_metrics(run_dir)[3]
    worst = _largest_difference(read_metrics(reference)[3], got)
    print(f"tp1_pp2: step 3 differs by {worst:.3g}")
    assert worst <= 1e-5
    assert "actor_rollout_ref.actor.optim.lr: checkpoint 0.0001, config 0.0002" in out
    assert "using the checkpoint's" in out and got["actor/lr"] == 1e-4


def test_resume_at_cp2_continues_exactly(tiny, reference):
    """Context parallelism shards no weights: the TP 2 checkpoint resumes at TP 1 × CP 2
    (packed rows split over both ranks; the optimizer state resharded over DP × CP) and step 3
    is the uninterrupted run's."""
    run_dir = _from_step_2(reference, tiny["root"] / "cp2")
    (run_dir / "STOP").write_text("")  # stop (with a checkpoint) after the first step
    out = _run(
        tiny,
        run_dir,
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.megatron.context_parallel_size=2",
    )
    assert "stopped after step 3" in out and f"resumed from {run_dir / 'global_step_2'}" in out
    worst = _largest_difference(read_metrics(reference)[3], read_metrics(run_dir)[3])
    print(f"cp2: step 3 differs by {worst:.3g}")
    assert worst <= 1e-5


def test_sigint_exits_without_saving_and_the_last_checkpoint_loads_at_dp2(tiny, reference):
    run_dir = _from_step_2(reference, tiny["root"] / "sigint")
    # A changed lr: the config wins (default policy), named; step 3 runs with it. The step-4
    # save is held (test hook), so however late the SIGINT lands, no step-4 checkpoint completes.
    held = {"MEGARL_TEST_SLOW_CHECKPOINT": "4:120"}
    lr = "actor_rollout_ref.actor.optim.lr=2e-4"
    proc = _start(tiny, run_dir, lr, env=held, launcher=True)
    _wait_for(lambda: _stepped(run_dir, 3), "step 3")
    job = _family(proc)
    # To the launcher alone, during step 4: the first SIGINT asks for a stop with a checkpoint
    # (issue 23), the second one means now, unsaved: the launcher passes it on to torchrun.
    proc.send_signal(signal.SIGINT)
    _wait_for(lambda: "SIGINT received" in proc.out_path.read_text(), "the launcher's answer")
    proc.send_signal(signal.SIGINT)
    code, out = _finish(proc, timeout=TORCHRUN_KILL_GRACE_S + 60)
    assert code != 0
    assert _survivors(job, timeout=30) == []
    complete = [p.name for p in run_dir.glob("global_step_*") if p.suffix != ".tmp"]
    assert complete == ["global_step_2"]
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert "actor_rollout_ref.actor.optim.lr: checkpoint 0.0001, config 0.0002" in out
    assert "using the config's" in out
    got, ref = read_metrics(run_dir)[3], read_metrics(reference)[3]
    assert got["actor/lr"] == 2e-4
    for key in ("critic/score/mean", "response_length/mean"):  # rolled out before the update
        assert got[key] == ref[key]

    # The next launch loads step 2, at DP 2 with the distributed optimizer; it continues
    # exactly (its step-3 line is the later one in metrics.jsonl).
    (run_dir / "STOP").write_text("")
    out = _run(tiny, run_dir, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1")
    assert f"resumed from {run_dir / 'global_step_2'}" in out
    assert "TP 1 × PP 1 × DP 2" in out and "stopped after step 3" in out
    got = read_metrics(run_dir)[3]
    worst = _largest_difference(ref, got)
    print(f"tp1_dp2: step 3 differs by {worst:.3g}")
    assert worst <= 1e-5 and got["actor/lr"] == 1e-4


def test_final_hf_export_matches_the_actor_in_transformers(reference):
    ckpt = reference / "global_step_4" / "actor"
    done = subprocess.run(
        [sys.executable, "-m", "megarl.cli", "convert", "verify", "--ckpt", str(ckpt),
         "--hf-path", str(ckpt / "huggingface"), "--atol", "1e-4", "--rtol", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    hf = ckpt / "huggingface"
    assert (hf / "generation_config.json").is_file() and (hf / "tokenizer.json").is_file()


@pytest.mark.parametrize("case", ["architecture", "missing"])
def test_resume_errors_are_one_line(tiny, reference, case):
    if case == "architecture":
        extra = [
            f"actor_rollout_ref.model.path={tiny['root'] / 'llama'}",
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={reference / 'global_step_2'}",
        ]
        named = ["Qwen2ForCausalLM", "LlamaForCausalLM", str(reference / "global_step_2")]
    else:
        extra = ["trainer.resume_mode=resume_path", "trainer.resume_from_path=/nonexistent/ck"]
        named = ["trainer.resume_from_path=/nonexistent/ck"]
    args = _args(tiny, tiny["root"] / f"error_{case}")
    done = subprocess.run(
        [sys.executable, "-m", "megarl.cli", "train", *args, *extra],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert all(n in lines[0] for n in named), lines[0]
