"""TRL's GRPO step on megarl's equal-work shape: the reference issue 59 measures megarl against.

Hugging Face TRL's ``GRPOTrainer`` on the tiny Qwen2 of ``tools/make_tiny_model.py`` (the
quickstart's ``outputs/tiny-qwen2``) and the synthetic task's prompts, one GRPO step =
``--prompts`` prompts x ``--n`` responses x ``--response-length`` tokens at most, fp32, no KL
(``beta=0``), one update per generation (old log-probs skipped, as megarl skips them on policy),
transformers' own ``generate``. Prints the median seconds per step over the steps after the
first (which warms up), with the mean response length so the two sides' work can be compared.

TRL is not one of megarl's dependencies: run this with a Python that has it, e.g.

    python3.11 -m venv /tmp/trl && /tmp/trl/bin/pip install torch==2.13.0 uv==0.13.9
    /tmp/trl/bin/uv pip install --python /tmp/trl/bin/python -c requirements/cpu-lock.txt \\
        transformers==5.19.0 trl==1.16.0 pyarrow
    /tmp/trl/bin/python tools/bench_trl.py --steps 8

``tools/bench_vs_trl.sh`` alternates it with ``tools/bench_step.py`` on the same shape.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=Path("outputs/tiny-qwen2"))
    parser.add_argument("--data", type=Path, default=Path("outputs/tiny-data/train.parquet"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("outputs/runs/bench_trl"))
    args = parser.parse_args()

    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    rows = pq.read_table(args.data).to_pylist()
    data = Dataset.from_list(
        [{"prompt": r["prompt"], "answer": r["reward_model"]["ground_truth"]} for r in rows]
    )

    def digits_reward(completions, answer, **_):
        """The fraction of the response's characters that are digits: a reward with spread on an
        untrained model, so every group has advantages and the update does real work."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]

    seconds: list[float] = []
    lengths: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            self.start = time.perf_counter()

        def on_step_end(self, *_a, **_k):
            seconds.append(time.perf_counter() - self.start)

        def on_log(self, _args, _state, _control, logs=None, **_k):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    config = GRPOConfig(
        output_dir=str(args.out),
        per_device_train_batch_size=args.prompts * args.n,
        num_generations=args.n,
        max_completion_length=args.response_length,
        max_steps=args.steps,
        beta=0.0,
        num_iterations=1,
        learning_rate=1e-4,
        temperature=1.0,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=digits_reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[Timer()],
    )
    trainer.train()
    rest = seconds[1:] or seconds
    length = statistics.mean(lengths[1:] or lengths) if lengths else float("nan")
    print(
        f"trl {args.prompts}x{args.n}x{args.response_length}: first step {seconds[0]:.3f} s; "
        f"steps 2..{len(seconds)}: median {statistics.median(rest):.3f} s per step "
        f"(mean response {length:.1f} tokens, {args.threads} threads)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
