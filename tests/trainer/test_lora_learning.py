"""``configs/grpo_lora_tiny_cpu.yaml`` learns, and what it writes is the policy it trained.

Real runs (actor TP 2 on 2 ranks with rank-16 adapters, vLLM TP 2): 6 steps validating before
and after (saving at 3 and 6) with adapter-only syncs (``lora.merge=false``: the base once, then
the adapters as a vLLM LoRA adapter) to vLLM on 2 ranks of its own (a split launch, on-policy), 2
steps at lr 0 from its final adapters (``lora.adapter_path``: its PEFT export) with vLLM
colocated (adapter-only syncs too) validating at 0 and 2 (σ from three evaluations of those
adapters, as test_grpo_learning does of the initial weights), and a colocated run resumed from
the first one's step-3 checkpoint (adapters, their optimizer state; the base from the model path)
syncing merged weights (``lora.merge=true``). The final save's PEFT folder loaded onto the HF
base by ``peft`` gives the logits of its merged HF export.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._run_outputs import read_metrics

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "grpo_lora_tiny_cpu.yaml"
PEFT_EXPORT = Path("global_step_6") / "actor" / "lora_adapter"  # the main run's final save
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.multirank]
SPLIT = ("actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=2")
"""vLLM on 2 rollout ranks of its own after the 2 training ranks (docs/off-policy.md)."""


def _quickstart(out: Path, run: str, *overrides: str) -> Path:
    (out / "tmp").mkdir(exist_ok=True)
    run_dir = out / "runs" / run
    proc = subprocess.run(
        [sys.executable, "-m", "megarl.commands.quickstart", "--out", str(out),
         "--config", str(CONFIG), f"trainer.default_local_dir={run_dir}", *overrides],
        cwd=REPO, env={**os.environ, "TMPDIR": str(out / "tmp")},
        capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_quickstart")
    # vLLM on 2 ranks of its own (TP 2, as colocated), on-policy (staleness 0): the training
    # ranks send it the base once, then the adapters alone
    main = _quickstart(out, "main", "trainer.total_training_steps=6", "trainer.test_freq=6",
                       "trainer.save_freq=3", *SPLIT)  # fmt: skip
    resumed = _quickstart(out, "resumed", "trainer.total_training_steps=6",
                          "trainer.test_freq=6", "trainer.save_freq=6",
                          "trainer.resume_mode=resume_path",
                          f"trainer.resume_from_path={main / 'global_step_3'}",
                          "actor_rollout_ref.model.lora.merge=true")  # fmt: skip
    # the lr-0 control starts from the main run's final adapters (lora.adapter_path: the PEFT
    # folder its final save exported), so it also checks that path through the trainer
    frozen = _quickstart(out, "lr0", "actor_rollout_ref.actor.optim.lr=0",
                         "trainer.total_training_steps=2", "trainer.test_freq=2",
                         "trainer.save_freq=-1",
                         f"actor_rollout_ref.model.lora.adapter_path={main / PEFT_EXPORT}")  # fmt: skip
    return {"main": main, "frozen": frozen, "resumed": resumed, "model": out / "tiny-qwen2"}


def test_lora_run_learns_and_vllm_follows_the_adapters(runs):
    main, frozen = read_metrics(runs["main"]), read_metrics(runs["frozen"])
    r0, final = main[0]["val/score/mean"], main[6]["val/score/mean"]
    # three evaluations of the final adapters: the main run's own, and the lr-0 run's (loaded
    # from its PEFT export by lora.adapter_path) before and after its two steps
    assert frozen[0]["val/score/mean"] == final
    sigma = statistics.pstdev([final, frozen[0]["val/score/mean"], frozen[2]["val/score/mean"]])
    print(f"r0={r0:.4f} sigma={sigma:.4g} final={final:.4f} gain={final - r0:.4f}")
    assert final - r0 >= max(0.15, 3 * sigma)
    # every step's rollout came from vLLM holding the actor's policy: the base and the adapters
    # (merge=false) in the main run (vLLM on ranks of its own, on-policy) and the lr-0 run
    # (colocated), merged weights in the resumed run's steps 4-6
    resumed = read_metrics(runs["resumed"])
    for step in range(1, 7):
        assert main[step]["async/staleness_max"] == 0.0, step  # split, each batch after its sync
        assert main[step]["rollout/logprob_diff_max"] <= 1e-4, step
    for step in range(1, 3):
        assert frozen[step]["rollout/logprob_diff_max"] <= 1e-4, step
    for step in range(4, 7):
        assert resumed[step]["rollout/logprob_diff_max"] <= 1e-4, step


def _tensor_bytes(*files: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() * t.element_size() for f in files for t in load_file(str(f)).values())


def test_adapter_only_syncs_send_the_adapters(runs):
    """merge=false: each step's sync hands vLLM the PEFT adapter's bytes (the saved folder's
    tensors), far below the model's (15 % at this tiny width, about 1 % for a 7B model at rank
    32): to each of the main run's 2 rollout ranks, and to the lr-0 run's colocated engine; the
    merged syncs of the resumed run send the model's."""
    main, resumed = read_metrics(runs["main"]), read_metrics(runs["resumed"])
    frozen = read_metrics(runs["frozen"])
    adapter = _tensor_bytes(runs["main"] / "global_step_6" / "actor" / "lora_adapter" /
                            "adapter_model.safetensors")  # fmt: skip
    model = _tensor_bytes(*runs["model"].glob("*.safetensors"))
    print(f"sync/bytes: adapters {adapter}, model {model} ({adapter / model:.3f})")
    for step in range(1, 7):
        assert main[step]["sync/bytes"] == adapter, step
        assert main[step]["async/update_weights_bytes"] == 2 * adapter, step
    for step in range(1, 3):
        assert frozen[step]["sync/bytes"] == adapter, step
    for step in range(4, 7):  # the model's tensors (embedding and output padded to 1024 rows)
        assert model <= resumed[step]["sync/bytes"] <= 1.01 * model, step
    assert adapter < 0.2 * model


def test_a_lora_checkpoint_holds_the_adapters_alone(runs):
    """Model tensors of the step-3 checkpoint: the adapters only (the base stays at the model
    path; resuming from it is checked below), so it is smaller than the base itself."""
    from torch.distributed.checkpoint import FileSystemReader

    actor = runs["main"] / "global_step_3" / "actor"
    keys = list(FileSystemReader(str(actor)).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if not k.startswith("optimizer.")]
    assert model_keys and all(".lora." in k for k in model_keys), model_keys[:5]
    assert not [k for k in keys if "linear_qkv.weight" in k or "word_embeddings" in k]
    on_disk = sum(f.stat().st_size for f in actor.glob("*.distcp"))
    model = sum(f.stat().st_size for f in runs["model"].glob("*.safetensors"))
    print(f"LoRA checkpoint: {on_disk} bytes of shards (base model: {model})")
    assert on_disk < model


def test_saved_adapter_on_the_base_is_the_merged_export(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    actor = runs["main"] / "global_step_6" / "actor"
    ids = torch.randint(10, 900, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(actor / "huggingface", dtype=torch.float32)
        base = AutoModelForCausalLM.from_pretrained(runs["model"], dtype=torch.float32)
        base_logits = base(ids).logits
        peft = PeftModel.from_pretrained(base, str(actor / "lora_adapter"))
        want, got = peft(ids).logits, merged(ids).logits
    assert (got - want).abs().max() <= 1e-4
    assert (got - base_logits).abs().max() > 1e-2  # training moved the policy off the base


def test_resume_from_a_lora_checkpoint_continues_the_same_run(runs):
    """Steps 4-6 resumed from step 3's checkpoint equal the uninterrupted run's (metrics
    within 1e-5, as test_dapo_runs' resume), and so do the final adapters."""
    from safetensors.torch import load_file

    main, resumed = read_metrics(runs["main"]), read_metrics(runs["resumed"])
    assert "actor/pg_loss" not in resumed.get(3, {}) and "actor/pg_loss" in resumed[4]
    for step in range(4, 7):
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean"):
            assert resumed[step][key] == pytest.approx(main[step][key], abs=1e-5), (step, key)
    a, b = (load_file(str(runs[r] / "global_step_6" / "actor" / "lora_adapter" /
                          "adapter_model.safetensors")) for r in ("main", "resumed"))  # fmt: skip
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"resumed adapters differ by at most {worst:.3g}")
    assert worst <= 1e-5


def test_convert_merges_the_checkpoints_adapters(runs, tmp_path):
    """``megarl convert megatron-to-hf`` of the LoRA actor's checkpoint (its meta names the
    adapters) writes the merged policy: the final save's HF export, not the base."""
    from safetensors.torch import load_file

    actor = runs["main"] / "global_step_6" / "actor"
    done = subprocess.run(
        [sys.executable, "-m", "megarl.cli", "convert", "megatron-to-hf", "--ckpt", str(actor),
         "--out", str(tmp_path / "hf"), "--tp", "2", "--verify"],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "holds LoRA adapters" in done.stdout + done.stderr
    exported = {}
    for f in (actor / "huggingface").glob("*.safetensors"):
        exported.update(load_file(str(f)))
    converted = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        converted.update(load_file(str(f)))
    assert converted.keys() == exported.keys()
    assert max(float((converted[k] - exported[k]).abs().max()) for k in exported) <= 1e-6
