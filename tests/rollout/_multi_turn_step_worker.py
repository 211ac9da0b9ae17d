"""One trainer step on multi-turn rollouts (torchrun, 2 ranks: actor TP 2, vLLM TP 2 in the same
ranks; tools run on rank 0 and the trajectories are broadcast): the warm-started tiny Qwen2 of
``_multi_turn_worker.py``, tools from a verl-style tool config file, Megatron actor + colocated
vLLM, ``first_sync`` then ``train_step``. Records the step's batch and metrics for
test_multi_turn_step.py.

``build_run`` attaches the loop to the engine (``engine.multi_turn``) as ``megarl train`` does;
everything is the trainer's own code.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.rollout._multi_turn_worker import SCRIPTS, BoomTool, SleepyTool, conversations

TOOLS_YAML = """\
tools:
  - class_name: megarl.tools.calculator_tool.CalculatorTool
    config: {}
  - class_name: tests.rollout._multi_turn_worker.BoomTool
    config: {}
    tool_schema: {type: function, function: {name: boom, description: boom,
                  parameters: {type: object, properties: {}, required: []}}}
  - class_name: tests.rollout._multi_turn_worker.SleepyTool
    config: {}
    tool_schema: {type: function, function: {name: sleepy, description: sleepy,
                  parameters: {type: object, properties: {}, required: []}}}
"""

SCORE = """\
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):
    return 1.0 if ground_truth in solution_str else 0.0
"""


def prepare(out: Path) -> None:
    """Model, data, tool config and reward file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megarl.models.tiny import make_tiny_model
    from megarl.tools.calculator_tool import CalculatorTool
    from megarl.tools.warm_start import warm_start_chat
    from tests.rollout._multi_turn_worker import _schema

    tools = {
        "calculator": CalculatorTool({}, None),
        "boom": BoomTool({}, _schema("boom")),
        "sleepy": SleepyTool({}, _schema("sleepy")),
    }
    model = make_tiny_model(out / "tiny", "qwen2", seed=0)
    warm_start_chat(model, conversations(tools), steps=300)
    rows = [
        {
            "data_source": "mt",
            "prompt": [{"role": "user", "content": user}],
            "ability": "tools",
            "reward_model": {"style": "rule", "ground_truth": "84"},
            "extra_info": {"index": i},
        }
        for i, user in enumerate(SCRIPTS)
    ]
    pq.write_table(pa.Table.from_pylist(rows), out / "train.parquet")
    (out / "tools.yaml").write_text(TOOLS_YAML)
    (out / "score.py").write_text(SCORE)


def overrides(out: Path) -> list[str]:
    """The config overrides that use what :func:`prepare` wrote (world 2: TP 2, one engine)."""
    return [
        f"actor_rollout_ref.model.path={out / 'tiny'}",
        f"data.train_files={out / 'train.parquet'}",
        f"data.val_files={out / 'train.parquet'}",
        "data.train_batch_size=4",
        "data.max_prompt_length=64",
        "data.max_response_length=256",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={out / 'tools.yaml'}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4",
        "actor_rollout_ref.rollout.multi_turn.tool_call_timeout_s=0.5",
        f"custom_reward_function.path={out / 'score.py'}",
        "custom_reward_function.name=compute_score",
        "algorithm.adv_estimator=reinforce_plus_plus",  # GRPO: identical samples, advantage 0
        "trainer.n_gpus_per_node=2",
        f"trainer.default_local_dir={out / 'ckpt'}",
    ]


def main() -> None:
    out = Path(sys.argv[1])
    done = out / "prepared"
    if os.environ.get("RANK", "0") == "0":
        prepare(out)
        done.touch()
    while not done.exists():  # the other rank waits for rank 0's model and files
        time.sleep(0.2)
    from megarl.config import load_config
    from megarl.parallel.init import destroy_distributed, init_distributed
    from megarl.trainer.console import Console
    from megarl.trainer.setup import build_run
    from megarl.trainer.step import first_sync, train_step

    init_distributed(seed=1)
    rank = dist.get_rank()
    cfg = load_config(
        [str(Path(__file__).resolve().parents[2] / "configs/_tiny_cpu.yaml")], overrides(out)
    )
    with Console(out / "logs", rank=rank) as console:
        run = build_run(cfg, console, out / "run")
        try:
            first_sync(run)
            prompts = [run.train_data[i] for i in next(run.sampler)]
            metrics, batch = train_step(run, 1, prompts)
        finally:
            run.rewards.close()
    record = {
        "metrics": metrics,
        "multi_turn": run.engine.multi_turn.last_metrics,
        "response_mask": batch.response_mask,
        "rollout_log_probs": batch.rollout_log_probs,
        "old_log_probs": batch.old_log_probs,
        "input_ids": batch.input_ids,
        "prompt_lengths": batch.prompt_lengths,
        "lengths": batch.lengths,
        "advantages": batch.advantages,
        "scores": batch.token_level_scores,
        "raw_prompts": [p.raw_prompt for p in prompts],
    }
    if rank == 0:
        torch.save(record, out / "step.pt")
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
