"""``tools/gpu_check.py --bare-node``: a first look at megarl on a GPU node as it comes, in about
six minutes of one command.

The node as it comes: one H100 or H200, Python 3.12 with torch (CUDA), transformers, peft,
safetensors, triton, pyarrow, psutil and pyyaml installed; no vLLM, Transformer Engine,
Megatron-Core or apex; no network. What megarl needs beside that travels as wheels (``make
gpu-carry`` downloads them into ``.whl/``, about 5 MB: Megatron-Core and the pure-Python
packages the trainer imports) and is installed into a folder there (docs/gpu.md gives the
command to hand the machine). Sections, each ok / skipped with the reason / failed with the
error, the others still running:

- ``stack``: versions, and why Transformer Engine does not import;
- ``gpu_tests``: the ``gpu``-marked tests that run without vLLM and TE (:data:`GPU_TESTS`: NCCL
  groups after the cache filled the GPU, planner vs measured memory, LoRA on the device, the
  local spec's attention kernels), with a time limit;
- ``reshard``: the weight sync's executor on CUDA at Qwen2.5-0.5B's shape (bf16): every tensor
  the engine receives equals the HF checkpoint's, the bytes equal the plan's, GB/s against a
  device-to-device copy of the same bytes (CUDA-synchronised);
- ``grpo_lora``: GRPO with LoRA adapters through ``megarl.trainer`` (the actor as rollout, bf16,
  the local spec), each step's CUDA-synchronised phase seconds and measured peak memory beside
  ``megarl plan``'s figure for the phase;
- ``ppo_resume``: PPO with a critic, a distributed checkpoint at the last of ``--steps``, then
  a second launch that resumes from it and trains one step more (the checkpoint's size and save
  seconds).

``--device cpu --tiny`` runs the same sections at tiny shapes on CPU (the suite's
``tests/test_gpu_check.py``); the CUDA-only figures are None there.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("stack", "gpu_tests", "reshard", "grpo_lora", "ppo_resume")
GPU_TESTS = (
    "tests/parallel/test_nccl_gpu.py",
    "tests/planner/test_memory_gpu.py",
    "tests/models/test_lora_gpu.py",
    "tests/models/test_attention_gpu.py",
)
"""The ``gpu``-marked tests that need neither vLLM nor Transformer Engine."""
GPU_TESTS_TIMEOUT_S = 180
SHAPE_05B = {"num_layers": 24, "hidden_size": 896, "num_attention_heads": 14,
             "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 4864,
             "vocab_size": 32000, "tie_word_embeddings": True}  # fmt: skip
"""Qwen2.5-0.5B's shape with the synthetic task's 32k tokenizer."""
SHAPE_TINY = {"num_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
              "vocab_size": 1000}  # fmt: skip
GRPO_LORA = str(REPO / "configs" / "grpo_lora_tiny_cpu.yaml")
PPO = str(REPO / "configs" / "ppo_tiny_cpu.yaml")


def run_bare_node(out: Path, cuda: bool, tiny: bool, steps: int, wanted: list[str]) -> dict:
    """Every section of :data:`SECTIONS` in ``wanted``; returns the report (``sections`` by
    name)."""
    import gpu_check as gc  # tools/ is on sys.path: this module is imported by gpu_check

    report: dict = {"device": "cuda" if cuda else "cpu", "mode": "bare-node", "sections": {}}
    sections = report["sections"]
    if "stack" in wanted:
        sections["stack"] = gc._section(lambda: gc._stack(cuda))
    if "gpu_tests" in wanted:
        sections["gpu_tests"] = (
            gc._section(lambda: _gpu_tests(out))
            if cuda
            else {"status": "skipped", "why": "no CUDA: the gpu-marked tests skip"}
        )
    _save(report, out)
    model = out / "models" / ("tiny" if tiny else "qwen2.5-0.5b")
    made = gc._section(lambda: _make_model(model, SHAPE_TINY if tiny else SHAPE_05B, cuda))
    if made["status"] != "ok":
        sections["model"] = made
        return report
    if "reshard" in wanted:
        sections["reshard"] = gc._section(lambda: _reshard_section(model, cuda))
        _save(report, out)
    runs = {"grpo_lora": _grpo_lora_overrides, "ppo_resume": _ppo_overrides}
    for name in [n for n in runs if n in wanted]:
        sections[name] = gc._section(
            lambda n=name: _trainer_section(n, runs[n], model, out / n, cuda, steps)
        )
        _save(report, out)
    return report


def _save(report: dict, out: Path) -> None:
    """The report so far and its table (a command stopped at its time limit keeps them)."""
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "gpu_check.txt").write_text(table(report) + "\n")


def _make_model(path: Path, shape: dict, cuda: bool) -> dict:
    import torch

    from megarl.models.tiny import make_tiny_model

    if not (path / "config.json").exists():
        make_tiny_model(path, "qwen2", dtype=torch.bfloat16 if cuda else torch.float32, **shape)
    return {"path": str(path)}


def _gpu_tests(out: Path) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-ra", "-m", "gpu", "-p", "no:cacheprovider",
           *GPU_TESTS]  # fmt: skip
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                              timeout=GPU_TESTS_TIMEOUT_S, check=False)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        (out / "gpu_tests.log").write_text(str(exc.stdout or "") + str(exc.stderr or ""))
        return {"status": "failed", "why": f"over {GPU_TESTS_TIMEOUT_S} s"}
    (out / "gpu_tests.log").write_text(done.stdout + done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    failed = [ln.split()[1] for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    return {"status": "failed" if failed or done.returncode not in (0, 5) else "ok",
            "summary": lines[-1:], "failed": failed, "log": str(out / "gpu_tests.log")}  # fmt: skip


def _reshard_section(model: Path, cuda: bool) -> dict:
    """:func:`gpu_reshard.measure` in this process (a world of one), then its verdict."""
    import gpu_reshard

    report = gpu_reshard.measure(str(model), "cuda" if cuda else "cpu")
    wrong = [f"{len(report['mismatched'])} tensors differ from the checkpoint"] * bool(
        report["mismatched"]
    )
    if report["not_received"]:
        wrong.append(f"not received: {', '.join(report['not_received'][:3])}")
    if report["bytes"] != report["plan_bytes"]:
        wrong.append(f"received {report['bytes']} bytes, the plan says {report['plan_bytes']}")
    if report["buffer_bytes"] != report["plan_buffer_bytes"]:
        wrong.append(f"buffers {report['buffer_bytes']} bytes != {report['plan_buffer_bytes']}")
    if wrong:
        report.update(status="failed", why="; ".join(wrong))
    return report


def _base(model: Path, run_dir: Path, data: Path, cuda: bool, steps: int) -> list[str]:
    hf = json.loads((model / "config.json").read_text())
    arch = "actor_rollout_ref.model.architecture"
    out = [
        f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}",
        f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
        f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={steps}",
        "trainer.nnodes=1", "trainer.n_gpus_per_node=1", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.logger=[console]",
        "actor_rollout_ref.rollout.name=actor",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        *(f"{role}.megatron.{key}=1" for role in ("actor_rollout_ref.actor",
          "actor_rollout_ref.ref", "critic")
          for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size")),
        "actor_rollout_ref.actor.megatron.sequence_parallel=false",
        f"{arch}.num_attention_heads={hf['num_attention_heads']}",
        f"{arch}.num_key_value_heads={hf['num_key_value_heads']}",
        f"{arch}.num_hidden_layers={hf['num_hidden_layers']}",
        f"{arch}.hidden_size={hf['hidden_size']}", f"{arch}.vocab_size={hf['vocab_size']}",
    ]  # fmt: skip
    if cuda:  # no TE on a bare node: the local spec, with its CUDA attention kernels
        out += ["trainer.device=cuda", "trainer.dtype=bf16",
                *(f"{role}.megatron.transformer_impl=local" for role in
                  ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")),
                "data.max_response_length=32", "data.train_batch_size=16",
                "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
                "critic.ppo_micro_batch_size_per_gpu=8",
                "critic.ppo_mini_batch_size=8"]  # fmt: skip
    else:
        out += ["data.max_response_length=4", "data.train_batch_size=2",
                "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                "critic.ppo_micro_batch_size_per_gpu=4", "critic.ppo_mini_batch_size=2"]  # fmt: skip
    return out


def _grpo_lora_overrides(model, run_dir, data, cuda, steps) -> list[tuple[str, list[str]]]:
    base = [*_base(model, run_dir, data, cuda, steps), "trainer.save_freq=-1",
            "trainer.resume_mode=disable"]  # fmt: skip
    return [(GRPO_LORA, base)]


def _ppo_overrides(model, run_dir, data, cuda, steps) -> list[tuple[str, list[str]]]:
    """Two launches: steps 1..``steps`` with a checkpoint at the last, then a resume from it
    that trains one step more."""
    first = [*_base(model, run_dir, data, cuda, steps), f"trainer.save_freq={steps}",
             "trainer.resume_mode=disable"]  # fmt: skip
    second = [*_base(model, run_dir, data, cuda, steps + 1), "trainer.save_freq=-1",
              "trainer.resume_mode=auto"]  # fmt: skip
    return [(PPO, first), (PPO, second)]


def _trainer_section(name: str, launches, model: Path, run_dir: Path, cuda: bool, steps: int):
    import gpu_check as gc

    data = gc._data(run_dir)
    rows, all_metrics, logs = [], [], []
    for i, (config, overrides) in enumerate(launches(model, run_dir, data, cuda, steps)):
        log = run_dir.parent / f"{name}_{i}.log"
        file = run_dir / "metrics.jsonl"
        before = len(file.read_text().splitlines()) if file.exists() else 0
        start = time.perf_counter()
        gc._torchrun(["-m", "megarl.trainer", "--config", config, *overrides], log, {})
        records = [json.loads(line) for line in file.read_text().splitlines()[before:]]
        metrics = [r["metrics"] | {"step": r["step"]} for r in records if r["step"] > 0]
        rows.append({"launch_s": round(time.perf_counter() - start, 1),
                     "steps": [m["step"] for m in metrics]})  # fmt: skip
        logs.append(log.read_text())
        all_metrics = metrics
    later = all_metrics[1:] or all_metrics
    phases = sorted({k.split("/", 1)[1] for m in later for k in m if k.startswith("timing_s/")})
    result = {
        "config": launches(model, run_dir, data, cuda, steps)[-1][0],
        "overrides": launches(model, run_dir, data, cuda, steps)[-1][1],
        "launches": rows,
        "timing_s": {p: gc._median(later, f"timing_s/{p}") for p in phases},
        "phase_peaks_gib": {k.split("/", 2)[2]: max(m.get(k, 0) for m in all_metrics)
                            for k in all_metrics[-1] if k.startswith("memory/peak_gib/")},
        "phase_used_gib": {k.split("/", 2)[2]: max(m.get(k, 0) for m in all_metrics)
                           for k in all_metrics[-1] if k.startswith("memory/used_gib/")},
        "pg_loss": [m.get("actor/pg_loss") for m in all_metrics],
        "status": "ok",
    }  # fmt: skip
    if name == "ppo_resume":
        ckpt = run_dir / f"global_step_{steps}"
        size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file()) if ckpt.exists() else 0
        saved = re.search(r"megarl: saved \S+ in ([\d.]+) s", logs[0])
        resumed = re.search(r"megarl: resumed from (\S+)", logs[-1])
        result.update(checkpoint_gib=size / 2**30, resumed_steps=rows[-1]["steps"],
                      save_s=float(saved.group(1)) if saved else None,
                      resumed_from=resumed.group(1) if resumed else None)  # fmt: skip
        if rows[-1]["steps"] != [steps + 1]:
            result.update(status="failed", why=f"the resume trained steps {rows[-1]['steps']}")
    result["memory"] = gc._memory(result, str(model), cuda)
    return result


TABLE_KEYS = {
    "stack": ("torch", "cuda", "gpu", "megatron-core", "transformers", "transformer_impl_auto",
              "transformer_engine_imports"),
    "gpu_tests": ("summary", "failed"),
    "reshard": ("dtype", "tensors", "mismatched", "bytes", "plan_bytes", "sync_s", "sync_gbps",
                "copy_gbps"),
    "grpo_lora": ("launches", "timing_s", "pg_loss"),
    "ppo_resume": ("launches", "resumed_from", "resumed_steps", "checkpoint_gib", "save_s",
                   "timing_s"),
}  # fmt: skip


def table(report: dict) -> str:
    """The report as text: a line per section, its figures below, and per trainer run each
    phase's planned and measured peak memory."""
    import gpu_check as gc

    lines = [f"gpu_check --bare-node on {report['device']}"]
    for name, section in report["sections"].items():
        status = section.get("status", "ok")
        lines.append(
            f"{name:<12} {status:<8} {section.get('seconds', '')} s  {section.get('why', '')}"
        )
        for key in TABLE_KEYS.get(name, ()):
            if key in section:
                value = section[key]
                if isinstance(value, dict):
                    value = ", ".join(f"{k} {gc._fmt(v)}" for k, v in value.items())
                lines.append(f"    {key:<26} {gc._fmt(value)}")
        memory = section.get("memory", {})
        for phase, row in memory.get("phases", {}).items():
            lines.append(f"    memory {phase:<19} planned {row['planned_gib']:.2f} GiB, "
                         f"measured peak {gc._fmt(row['measured_peak_gib'])}")  # fmt: skip
        if memory.get("status") == "failed":
            lines.append(f"    memory: {memory.get('why')}")
    return "\n".join(lines)
