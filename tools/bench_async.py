"""Fully async RL against colocated training on a long-tail length mix (issue 55): tokens/s and
each side's idle time, five modes side by side in one invocation.

The model: the tiny Qwen2 of the README's main job, reshaped into a bigram model whose EOS
probability gives a long tail (:func:`long_tail_model`): attention and MLP outputs zeroed, so
each position's logits depend on its own token only; after the prompt's last token 80 % of the
first tokens are "short" ones, after which EOS comes with probability 1/4 (about 5 tokens in
all), and 20 % are "long" ones, after which EOS never comes (the response runs to the budget).

Each mode trains the same number of steps of the same batches (``--steps`` × 8 prompts × n=4,
``--budget`` tokens at most per response) with the synthetic task's reward, on the same two
processes:

- colocated: actor TP 1 × DP 2 and vLLM TP 1 (two replicas) in both processes;
- one step off: 1 training rank + 1 rollout rank, staleness 1, K = 1;
- fully async K=2: the same split, weights every 2 updates, staleness 1 (3 batches per window);
- fully async K=1 + partial, K=2 + partial: as above with partial rollouts.

Tokens/s: the response tokens generated for steps 2..N over the wall time from the end of
step 1 to the end of step N (start-up and the first step, which warms vLLM up, left out).
Idle: the training rank's wait for its batch (``async/wait_rollout_s``) and the rollout rank's
wait for a request (``async/rollout_idle_s``), as shares of that time.

    .venv/bin/python tools/bench_async.py [--steps 8] [--budget 128] [--out outputs/bench_async]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHORT = range(500, 700)
"""Token ids after which EOS follows with probability 1/4."""
LONG = range(700, 900)
"""Token ids after which EOS never follows."""
SPLIT = (
    "trainer.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "async_training.staleness_threshold=1",
)
MODES = {
    "colocated": ("trainer.n_gpus_per_node=2",),
    "one step off": SPLIT,
    "async K=2": (*SPLIT, "async_training.trigger_parameter_sync_step=2"),
    "async K=1 partial": (*SPLIT, "async_training.partial_rollout=true"),
    "async K=2 partial": (
        *SPLIT,
        "async_training.trigger_parameter_sync_step=2",
        "async_training.partial_rollout=true",
    ),
}


def long_tail_model(src: Path, dst: Path, short_share: float = 0.8, eos_after_short: float = 0.25):
    """Copy the tiny Qwen2 checkpoint ``src`` to ``dst`` as the bigram model of the module
    docstring: ``short_share`` of responses short, the rest to the budget."""
    import math

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    state = load_file(str(src / "model.safetensors"))
    for name in state:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            state[name] = torch.zeros_like(state[name])  # the residual stream: the embedding
    emb = state["model.embed_tokens.weight"]
    vocab, hidden = emb.shape
    root = math.sqrt(hidden)  # the embeddings' RMS is 1: the final norm leaves them as they are
    a, b, c = torch.eye(hidden)[:3]
    emb = c.repeat(vocab, 1) * root  # every other token: the prompts' group
    emb[SHORT.start : SHORT.stop] = a * root
    emb[LONG.start : LONG.stop] = b * root
    state["model.embed_tokens.weight"] = emb
    state["model.norm.weight"] = torch.ones(hidden)
    stay = 8.0  # logit of staying in one's group: 200 e^8 against ~800 others
    head = torch.zeros(vocab, hidden)
    first_long = stay  # logits after the prompt's last token (group c)
    first_short = stay + math.log(short_share / (1 - short_share))
    eos = stay + math.log(len(SHORT) * eos_after_short / (1 - eos_after_short))
    head[SHORT.start : SHORT.stop] = (stay * a + first_short * c) / root
    head[LONG.start : LONG.stop] = (stay * b + first_long * c) / root
    head[0] = (eos * a - 20.0 * b) / root  # EOS (id 0): after a short token only
    state["lm_head.weight"] = head
    save_file(state, str(dst / "model.safetensors"))
    return dst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--budget", type=int, default=128, help="max response tokens")
    parser.add_argument("--out", default="outputs/bench_async")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    from megarl.data.synthetic import write_synthetic_data
    from megarl.models.tiny import make_tiny_model

    base = out / "tiny-qwen2"
    if not (base / "config.json").exists():
        make_tiny_model(base, "qwen2", seed=0)
    if not (out / "tiny-data" / "train.parquet").exists():
        write_synthetic_data(out / "tiny-data")
    model = long_tail_model(base, out / "long-tail-qwen2")
    results = {}
    for name in args.modes.split(","):
        run_dir = out / "runs" / name.replace(" ", "_").replace("=", "")
        shutil.rmtree(run_dir, ignore_errors=True)
        done = subprocess.run(
            [sys.executable, "-m", "megarl.commands.quickstart", "--out", str(out),
             f"actor_rollout_ref.model.path={model}", f"trainer.total_training_steps={args.steps}",
             "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
             "trainer.resume_mode=disable", f"trainer.default_local_dir={run_dir}",
             "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
             "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
             f"data.max_response_length={args.budget}", "data.train_batch_size=8",
             "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
             "actor_rollout_ref.actor.use_kl_loss=false", *MODES[name]],
            check=False, cwd=REPO,
        )  # fmt: skip
        if done.returncode:
            print(f"bench_async: {name} failed (exit {done.returncode})", file=sys.stderr)
            return done.returncode
        results[name] = measure(run_dir, responses=8 * 4)
    report(results, args)
    (out / "bench_async.json").write_text(json.dumps(results, indent=1))
    return 0


def measure(run_dir: Path, responses: int) -> dict:
    """Tokens/s and idle shares over steps 2..N (the module docstring)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = sorted((r for r in rows if r["step"] > 0), key=lambda r: r["step"])
    later = steps[1:]
    wall = steps[-1]["time"] - steps[0]["time"]
    tokens = sum(r["metrics"]["response_length/mean"] * responses for r in later)
    at_budget = [r["metrics"].get("response_length/clip_ratio", 0.0) for r in later]

    def share(key: str) -> float:
        return sum(r["metrics"].get(key, 0.0) for r in later) / wall

    return {
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
        "tokens": tokens,
        "at_budget": sum(at_budget) / len(at_budget),
        "trainer_idle": share("async/wait_rollout_s"),
        "rollout_idle": share("async/rollout_idle_s"),
        "partial_fraction": sum(r["metrics"].get("async/partial_fraction", 0.0) for r in later)
        / len(later),
        "staleness_max": max(r["metrics"].get("async/staleness_max", 0.0) for r in later),
    }


def report(results: dict, args) -> None:
    ref = results.get("colocated", next(iter(results.values())))["tokens_per_s"]
    print(f"\nlong-tail mix, {args.steps} steps x 32 responses, budget {args.budget} tokens; "
          "steps 2.. on 2 processes")  # fmt: skip
    print(f"{'mode':<20}{'tok/s':>8}{'x coloc':>9}{'at budget':>10}{'train idle':>11}"
          f"{'roll idle':>10}{'partial':>9}{'stale':>7}")  # fmt: skip
    for name, r in results.items():
        print(
            f"{name:<20}{r['tokens_per_s']:>8.0f}{r['tokens_per_s'] / ref:>9.2f}"
            f"{r['at_budget']:>10.0%}{r['trainer_idle']:>11.0%}{r['rollout_idle']:>10.0%}"
            f"{r['partial_fraction']:>9.0%}{r['staleness_max']:>7.0f}"
        )


if __name__ == "__main__":
    sys.exit(main())
