"""What a finished ``megarl train`` run left in its directory, read back by the end-to-end tests."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path


def read_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """``metrics.jsonl`` as {step: {metric: value}} (records of one step merged)."""
    steps: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], {}).update(record["metrics"])
    return steps


def rollout_prompts(run_dir: Path, step: int) -> list[str]:
    """The prompts of ``step``'s rollout dump (``trainer.rollout_data_dir=RUN/rollouts``)."""
    lines = (run_dir / "rollouts" / f"{step}.jsonl").read_text().splitlines()
    return [json.loads(line)["input"] for line in lines]


def assert_prompts_in_sampler_order(config: Path, out: Path, run_dir: Path, steps: int) -> None:
    """Every step's rollout dump holds the prompts the sampler gives an uninterrupted run of
    ``config`` (the trainer's own dataset and sampler, over ``out``'s tiny data and model): a
    resumed run repeated or dropped none."""
    from collections import Counter

    from transformers import AutoTokenizer

    from megarl.config import load_config
    from megarl.data.dataset import PromptDataset
    from megarl.data.sampler import GlobalBatchSampler

    cfg = load_config([str(config)], [f"data.train_files={out / 'tiny-data' / 'train.parquet'}"])
    tokenizer = AutoTokenizer.from_pretrained(out / "tiny-qwen2")
    seed = cfg.data.seed if cfg.data.seed is not None else cfg.trainer.seed
    data = PromptDataset.from_config(cfg.data, tokenizer, "train", cfg.trainer.seed)
    sampler = GlobalBatchSampler(len(data), cfg.data.train_batch_size, seed=seed,
                                 shuffle=cfg.data.shuffle)  # fmt: skip
    n = cfg.actor_rollout_ref.rollout.n
    for step in range(1, steps + 1):
        batch = next(sampler)
        want = Counter(tokenizer.decode(data[i].prompt_ids) for i in batch for _ in range(n))
        assert Counter(rollout_prompts(run_dir, step)) == want, step


def launch_quickstart(out: Path, overrides: list[str], env: dict | None = None) -> subprocess.Popen:
    """The README's main job (``megarl.commands.quickstart``) in ``out`` with ``overrides``,
    its rollouts dumped to the run directory's ``rollouts/``, its temporary files in
    ``out/tmp``, ``env`` added to its environment; stdout and stderr captured as text."""
    import os
    import sys

    repo = Path(__file__).resolve().parents[1]
    return subprocess.Popen(
        [sys.executable, "-m", "megarl.commands.quickstart", "--out", str(out), *overrides,
         "reward_model.dump_samples=-1",
         f"trainer.rollout_data_dir={out / 'runs' / 'grpo_tiny_cpu' / 'rollouts'}"],
        cwd=repo, env={**os.environ, "TMPDIR": str(out / "tmp"), **(env or {})}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def steps_done(run_dir: Path) -> int:
    """The last step in ``metrics.jsonl`` (0 before any)."""
    try:
        return max(read_metrics(run_dir), default=0)
    except (OSError, ValueError):  # not written yet, or a line half written
        return 0


def stop_and_resume(
    out: Path,
    overrides: list[str],
    stop_after: int,
    stop: Callable[[subprocess.Popen], dict],
    env: dict | None = None,
) -> dict:
    """Launch the quickstart (``env`` added to both launches' environment), call
    ``stop(process)`` once step ``stop_after`` is done (it sends the signal; what it returns
    joins the result), wait for a clean exit, relaunch to the end.
    Returns the two launches' (stdout, stderr), the step saved, the merged metrics, ``run_dir``
    and ``out``."""
    from tests.checkpoint.test_trainer_checkpoint import _wait_for

    (out / "tmp").mkdir(exist_ok=True)
    run_dir = out / "runs" / "grpo_tiny_cpu"
    first = launch_quickstart(out, overrides, env)
    _wait_for(lambda: first.poll() is not None or steps_done(run_dir) >= stop_after,
              f"step {stop_after}", timeout=900)  # fmt: skip
    extra = stop(first)
    stopped = first.communicate(timeout=600)
    assert first.returncode == 0, stopped[0][-3000:] + stopped[1][-5000:]
    extra = {**extra, **extra.pop("after_stop", dict)()}
    saved = int((run_dir / "latest_checkpointed_iteration.txt").read_text())
    second = launch_quickstart(out, overrides, env)
    done = second.communicate(timeout=1200)
    assert second.returncode == 0, done[0][-3000:] + done[1][-5000:]
    return {"stopped": stopped, "done": done, "saved": saved, "metrics": read_metrics(run_dir),
            "run_dir": run_dir, "out": out, **extra}  # fmt: skip
