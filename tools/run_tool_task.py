"""GRPO on the tool task (``megarl/tool_sum``) with multi-turn rollouts: greedy validation
before and after, per-step tool-call metrics: the trainer's own build_run (which attaches the
multi-turn loop to the engine), first_sync, train_step and validate.

python -m torch.distributed.run --standalone --nproc_per_node 1 tools/run_tool_task.py \
    --task outputs/tool-task [--steps 20] [key=value ...]

``--task`` is what ``tools/make_tool_task.py`` wrote (data/, tiny-qwen2/). ``actor.optim.lr=0``
gives the control run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]

TOOLS_YAML = """\
tools:
  - class_name: megarl.tools.calculator_tool.CalculatorTool
    config: {}
"""


def overrides(task: Path, out: Path, steps: int) -> list[str]:
    (out / "tools.yaml").write_text(TOOLS_YAML)
    return [
        f"actor_rollout_ref.model.path={task / 'tiny-qwen2'}",
        f"data.train_files={task / 'data/train.parquet'}",
        f"data.val_files={task / 'data/test.parquet'}",
        "data.train_batch_size=8",
        "data.max_prompt_length=32",
        "data.max_response_length=192",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
        "actor_rollout_ref.actor.optim.lr=1.0e-4",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={out / 'tools.yaml'}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        f"custom_reward_function.path={REPO / 'megarl/data/tool_task.py'}",
        "custom_reward_function.name=compute_score",
        "algorithm.adv_estimator=grpo",
        "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={steps}",
        "trainer.val_before_train=true",
        f"trainer.default_local_dir={out / 'ckpt'}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="outputs/tool-task")
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("extra", nargs="*")
    args = parser.parse_args()
    task = Path(args.task).resolve()
    out = Path(args.out or task / "run").resolve()
    out.mkdir(parents=True, exist_ok=True)

    from megarl.config import load_config
    from megarl.parallel.init import destroy_distributed, init_distributed
    from megarl.trainer.console import Console
    from megarl.trainer.setup import build_run
    from megarl.trainer.step import first_sync, train_step, validate

    init_distributed(seed=1)
    cfg = load_config(
        [str(REPO / "configs/_tiny_cpu.yaml")], [*overrides(task, out, args.steps), *args.extra]
    )
    history = []
    with Console(out / "logs", rank=0) as console:
        run = build_run(cfg, console, out / "run")
        try:
            first_sync(run)
            before = validate(run, 0)
            start = time.perf_counter()
            for step in range(1, args.steps + 1):
                metrics, _ = train_step(run, step, [run.train_data[i] for i in next(run.sampler)])
                keep = {
                    k: v
                    for k, v in metrics.items()
                    if k.startswith(("multi_turn/", "critic/score"))
                }
                history.append({"step": step, **keep})
                print(json.dumps({"step": step, "score": keep.get("critic/score/mean"),
                                  "calls": keep.get("multi_turn/tool_calls/mean"),
                                  "ok": keep.get("multi_turn/tool_success_rate")}), flush=True)  # fmt: skip
            seconds = time.perf_counter() - start
            after = validate(run, args.steps)
        finally:
            run.rewards.close()
    result = {"val_before": before, "val_after": after, "steps": history, "seconds": seconds}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"val_before": before, "val_after": after, "seconds": round(seconds, 1)}))
    destroy_distributed()


if __name__ == "__main__":
    main()
