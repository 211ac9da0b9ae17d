"""Multi-turn rollouts and training in one launch (torchrun, 2 ranks: Megatron actor TP 2 and
vLLM TP 2 in the same ranks; tools run on rank 0 and the trajectories are broadcast), for
test_multi_turn.py:

1. the loop: right after the first sync (vLLM holds the checkpoint's weights), 4 scripted
   prompts × 4 samples through :func:`run_multi_turn` on the run's engine; the trajectories,
   the trainer batch built from them and transformers' log-probs of every trajectory (the
   independent reference) go to ``record.json``;
2. a trainer step (``train_step``) on multi-turn rollouts: its batch and metrics go to
   ``step.pt``;
3. resume: the run saves step 1, runs step 2, loads the step-1 checkpoint, syncs and runs step 2
   again; both step 2s (metrics, batch, weights) go to ``resume.pt``.

``_multi_turn_launch.py OUT split`` (after the launch above, on its files): a split launch, 1
training rank (Megatron TP 1) and 1 rollout rank (vLLM TP 1) running the whole loop, tools
included, one step ahead (``async_training.staleness_threshold=1``): step 1 (asking for step 2's
trajectories as soon as its own are in) and step 2 (taking them) go to ``split.pt``.

The warm-started tiny Qwen2 (``_multi_turn_scripts.py``), tools from a verl-style tool config
file, ``build_run`` attaching the loop as ``megarl train`` does: everything is the trainer's code.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.rollout._multi_turn_scripts import (
    SCRIPTS,
    TEMPERATURE,
    TIMEOUT_S,
    conversations,
    hf_log_probs,
    make_tools,
)

TOOLS_YAML = """\
tools:
  - class_name: megarl.tools.calculator_tool.CalculatorTool
    config: {}
  - class_name: tests.rollout._multi_turn_scripts.BoomTool
    config: {}
    tool_schema: {type: function, function: {name: boom, description: boom,
                  parameters: {type: object, properties: {}, required: []}}}
  - class_name: tests.rollout._multi_turn_scripts.SleepyTool
    config: {}
    tool_schema: {type: function, function: {name: sleepy, description: sleepy,
                  parameters: {type: object, properties: {}, required: []}}}
"""

SCORE = """\
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):
    # what verl's reward managers add to a multi-turn response's extra_info, as numeric fields
    return {
        "score": 1.0 if ground_truth in solution_str else 0.0,
        "num_turns": float(extra_info["num_turns"]),
        "tool_rewards": float(len(extra_info["tool_rewards"])),
        "turn_scores": float(len(extra_info["turn_scores"])),
        "no_rollout_reward_scores": float(extra_info["rollout_reward_scores"] == {}),
        "index_kept": float(extra_info["index"] in range(4)),
    }
"""

RESPONSE_LENGTH, PROMPT_LENGTH = 256, 64


def prepare(out: Path) -> None:
    """Model, data, tool config and reward file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megarl.models.tiny import make_tiny_model
    from megarl.tools.warm_start import warm_start_chat

    model = make_tiny_model(out / "tiny", "qwen2", seed=0)
    loss = warm_start_chat(model, conversations(make_tools()), steps=300)
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
    (out / "warm_start.json").write_text(json.dumps({"loss": loss}))


def overrides(out: Path) -> list[str]:
    """The config overrides that use what :func:`prepare` wrote (world 2: TP 2, one engine)."""
    return [
        f"actor_rollout_ref.model.path={out / 'tiny'}",
        f"data.train_files={out / 'train.parquet'}",
        f"data.val_files={out / 'train.parquet'}",
        "data.train_batch_size=4",
        f"data.max_prompt_length={PROMPT_LENGTH}",
        f"data.max_response_length={RESPONSE_LENGTH}",
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
        f"actor_rollout_ref.rollout.multi_turn.tool_call_timeout_s={TIMEOUT_S}",
        f"custom_reward_function.path={out / 'score.py'}",
        "custom_reward_function.name=compute_score",
        "algorithm.adv_estimator=reinforce_plus_plus",  # GRPO: identical samples, advantage 0
        "trainer.n_gpus_per_node=2",
        f"trainer.default_local_dir={out / 'ckpt'}",
    ]


def loop_record(run, out: Path) -> None:
    """Part 1: the loop on the run's engine (its first-sync weights = the checkpoint's)."""
    from megarl.rollout.distribute import generate_on_replicas
    from megarl.rollout.multi_turn import (
        MultiTurnSettings,
        TrajectoryPrompt,
        multi_turn_metrics,
        rollout_samples,
        run_multi_turn,
    )
    from megarl.rollout.multi_turn_rollout import on_rank0
    from megarl.trainer.batch import batch_from_samples
    from megarl.trainer.residency import enter

    enter(run, "generate")
    engine = run.engine

    def generate(contexts, *, prompt_ids, max_tokens, seed):
        return generate_on_replicas(
            engine, contexts, prompt_ids=prompt_ids, n=1, temperature=TEMPERATURE,
            max_tokens=max_tokens, seed=seed, step=0,
        )  # fmt: skip

    prompts = [TrajectoryPrompt([{"role": "user", "content": u}], i) for i, u in enumerate(SCRIPTS)]
    settings = MultiTurnSettings(
        response_length=RESPONSE_LENGTH,
        max_assistant_turns=4,
        tool_call_timeout_s=TIMEOUT_S,
        max_model_len=PROMPT_LENGTH + RESPONSE_LENGTH,
    )
    n = 4
    trajs = run_multi_turn(
        generate, prompts, n=n, tokenizer=run.tokenizer, tools=make_tools(), settings=settings,
        seed=0, step=0, stop_token_ids=engine.eos_token_ids, run_env=on_rank0,
    )  # fmt: skip
    if run.rank != 0:
        return
    samples = rollout_samples(trajs, n)
    batch = batch_from_samples(samples, pad_token_id=1)
    reference = hf_log_probs(out / "tiny", trajs)
    record = {
        "warm_start_loss": json.loads((out / "warm_start.json").read_text())["loss"],
        "eos": engine.eos_token_ids,
        "metrics": multi_turn_metrics(trajs),
        "trajectories": [
            {
                "prompt_index": t.prompt_index,
                "prompt_ids": t.prompt_ids,
                "response_ids": t.response_ids,
                "logprobs": t.response_logprobs,
                "mask": t.response_mask,
                "messages": t.messages,
                "assistant_turns": t.assistant_turns,
                "user_turns": t.user_turns,
                "errors": [r.error.value for r in t.tool_results],
                "tool_texts": [r.text for r in t.tool_results],
                "tokenization_ok": t.tokenization_ok,
                "drifted_turns": t.drifted_turns,
                "hf_logprobs": ref,
                "batch_mask": batch.response_mask[i, : len(t.response_ids)].tolist(),
                "batch_mask_tail": batch.response_mask[i, len(t.response_ids) :].tolist(),
                "batch_logprobs": batch.rollout_log_probs[i, : len(t.response_ids)].tolist(),
            }
            for i, (t, ref) in enumerate(zip(trajs, reference, strict=True))
        ],
    }
    (out / "record.json").write_text(json.dumps(record))


def _weights(run) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in run.actor.chunks for p in chunk.parameters()]


def _batch(batch) -> dict:
    names = ("input_ids", "response_mask", "rollout_log_probs", "old_log_probs", "advantages")
    return {n: getattr(batch, n) for n in names}


def resume_record(run, out: Path) -> None:
    """Part 3: save after step 1, run step 2, load step 1's checkpoint, run step 2 again (the
    checkpoint holds everything step 2 depends on: weights, optimizer, sampler, KL state)."""
    from megarl.trainer.loop import _resume, _save
    from megarl.trainer.step import first_sync, train_step

    run.state.step = 1
    run.state.sampler = run.sampler.state_dict()
    run.state.save_kl_coef(run.kl_ctrl)
    _save(run, 1, SimpleNamespace(run_id=None))
    runs = []
    for again in (False, True):
        if again:
            assert _resume(run) and run.state.step == 1
            first_sync(run)
        prompts = [run.train_data[i] for i in next(run.sampler)]
        metrics, batch = train_step(run, 2, prompts)
        runs.append({"metrics": metrics, "batch": _batch(batch), "weights": _weights(run),
                     "prompts": [p.raw_prompt for p in prompts]})  # fmt: skip
    first, second = runs
    diff = max(float((a - b).abs().max()) for a, b in zip(first["weights"], second["weights"]))
    box = torch.tensor([diff], dtype=torch.float64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    if run.rank == 0:
        for r in runs:
            del r["weights"]
        torch.save({"runs": runs, "weight_diff_max": float(box)}, out / "resume.pt")


SPLIT = [
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
    "trainer.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "async_training.staleness_threshold=1",
]
"""The split launch's overrides (after :func:`overrides`)."""


def _step_record(run, metrics, batch, prompts) -> dict:
    return {
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


def split_main(out: Path) -> None:
    """The split launch (module docstring): rank 0 trains, rank 1 serves."""
    from megarl.config import load_config
    from megarl.config.loader import resolve_config
    from megarl.parallel.init import destroy_distributed
    from megarl.rollout.remote.split_world import split_world
    from megarl.trainer.console import Console
    from megarl.trainer.setup import build_run, serve_rollout
    from megarl.trainer.step import first_sync, train_step

    config = Path(__file__).resolve().parents[2] / "configs/_tiny_cpu.yaml"
    cfg = resolve_config(load_config([str(config)], overrides(out) + SPLIT))
    if split_world(1).role == "rollout":
        serve_rollout(cfg)
        return
    with Console(out / "split_logs", rank=0) as console:
        run = build_run(cfg, console, out / "split_run")
        try:
            first_sync(run)
            first, second = ([run.train_data[i] for i in next(run.sampler)] for _ in range(2))
            records = []
            for step, prompts, ahead in ((1, first, [(2, second)]), (2, second, [])):
                metrics, batch = train_step(run, step, prompts, ahead)
                records.append(_step_record(run, metrics, batch, prompts))
                records[-1]["version"] = (run.ahead.last_version, run.ahead.version)
            torch.save(records, out / "split.pt")
        finally:
            run.rewards.close()
            run.engine.shutdown()
    destroy_distributed()


def main() -> None:
    out = Path(sys.argv[1])
    if sys.argv[2:] == ["split"]:
        split_main(out)
        return
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
            loop_record(run, out)
            prompts = [run.train_data[i] for i in next(run.sampler)]
            metrics, batch = train_step(run, 1, prompts)
            record = _step_record(run, metrics, batch, prompts)
            if rank == 0:
                torch.save(record, out / "step.pt")
            resume_record(run, out)
        finally:
            run.rewards.close()
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
