"""``make demo-distill``: on-policy distillation on CPU, as verl's example runs it (issue 57).

    python -m megarl.commands.demo_distill [--out outputs] [KEY=VALUE ...]

The teacher is ``make demo``'s trained model (its final HF export; the main job is run first
when it is missing, about a minute), the student the fresh tiny model. Through ``megarl train``
with ``configs/opd_tiny_cpu.yaml``: one training rank (actor and vLLM at TP 1) and the teacher
served by vLLM on a rank of its own, ``forward_kl_topk`` over its top 32, the task's rewards
unused, 10 steps (about 30 s); the student's greedy validation before and after is printed
beside the teacher's (measured: 0.066 -> 0.586 against 0.582; docs/distillation.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "opd_tiny_cpu.yaml"
"""The distillation run's config (the teacher's path is set to ``--out``'s)."""


def _last_validation(run_dir: Path) -> float | None:
    """The last ``val/score/mean`` in a run's ``metrics.jsonl`` (None: none recorded)."""
    score = None
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        score = json.loads(line)["metrics"].get("val/score/mean", score)
    return score


def main(argv: list[str] | None = None) -> int:
    from megarl.commands import quickstart

    parser = argparse.ArgumentParser(
        prog="python -m megarl.commands.demo_distill", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", default="outputs", help="where models, data and runs go")
    args, overrides = parser.parse_known_args(argv)
    out = Path(args.out).resolve()
    main_run = out / "runs" / "grpo_tiny_cpu"
    teacher = main_run / "global_step_30" / "actor" / "huggingface"
    if not (teacher / "config.json").is_file():
        print("megarl: training the teacher first (make demo's main job)", flush=True)
        code = quickstart.main(["--out", str(out)])
        if code:
            return code
    print(f"megarl: the teacher ({teacher}) validates at {_last_validation(main_run):.4f}",
          flush=True)  # fmt: skip
    return quickstart.main([
        "--out", str(out), "--config", str(CONFIG), "--nproc", "1",
        f"distillation.teacher_models.teacher_model.model_path={teacher}",
        f"trainer.default_local_dir={out / 'runs' / 'distill'}",
        *overrides,
    ])  # fmt: skip


if __name__ == "__main__":
    from megarl.parallel.fast_exit import exit_process

    exit_process(main())
