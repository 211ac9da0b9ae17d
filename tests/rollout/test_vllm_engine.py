"""Real vLLM on CPU under torchrun (2 ranks): the rollout adapter and prompt redistribution.

One torchrun launch (``_vllm_worker.py``) runs every multi-rank case and records the rollouts;
the tests below assert on those records and compare log-probs with Hugging Face transformers.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.multirank,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed"),
]

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_vllm_worker.py")
WORLD = 2
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """Launch the worker once; return {"ranks": [rank0, rank1], "models": dir, "out": dir}."""
    from megarl.models.tiny import make_tiny_model

    models = tmp_path_factory.mktemp("models")
    out = tmp_path_factory.mktemp("vllm_out")
    tmpdir = tmp_path_factory.mktemp("tmpdir")
    make_tiny_model(models / "tiny", "qwen2", num_key_value_heads=2, seed=0)
    # Tied: vLLM must re-pack a tied lm_head after a reload (see VLLMEngine).
    make_tiny_model(
        models / "tiny_kv1", "llama", num_key_value_heads=1, tie_word_embeddings=True, seed=1
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "VLLM_LOGGING_LEVEL": "WARNING",
        "OMP_NUM_THREADS": "1",
        # vLLM torch.compiles one small log-prob helper (rank counting) on first use: ~8 s of
        # dynamo per process here; eager gives the same numbers.
        "TORCHDYNAMO_DISABLE": "1",
        "TMPDIR": str(tmpdir),
    }
    cmd = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        f"--nproc_per_node={WORLD}",
        str(WORKER),
        f"--models={models}",
        f"--out={out}",
    ]
    log = out / "worker.log"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            import transformers.models.auto.modeling_auto  # noqa: F401  (overlaps the launch)

            rc = proc.wait(timeout=900)
        finally:
            if proc.poll() is None:
                proc.kill()
    if rc != 0:
        tail = "\n".join(log.read_text().splitlines()[-80:])
        pytest.fail(f"vLLM worker failed (rc={rc}):\n{tail}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {"ranks": ranks, "models": models, "out": out, "tmpdir": tmpdir}


@pytest.fixture(scope="module")
def hf_logprobs():
    """hf_logprobs(model_dir, records) -> per record, log_softmax(logits / T) at its tokens."""
    from transformers import AutoModelForCausalLM

    cache: dict = {}

    def compute(model_dir: Path, records: list[dict], temperature: float) -> list[list[float]]:
        if model_dir not in cache:
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32, attn_implementation="eager"
            )
            cache[model_dir] = model.eval()
        model = cache[model_dir]
        result = []
        with torch.no_grad():
            for r in records:
                ids = torch.tensor([r["prompt"] + r["response"]])
                logits = model(ids).logits[0].double()
                start = len(r["prompt"]) - 1  # position t scores token t+1
                lp = torch.log_softmax(logits[start : start + len(r["response"])] / temperature, -1)
                result.append(lp.gather(-1, torch.tensor(r["response"])[:, None])[:, 0].tolist())
        return result

    return compute


def records(run: dict, key: str) -> list[list[dict]]:
    return [rank["records"][key] for rank in run["ranks"]]


def tokens(recs: list[dict]) -> list[list[int]]:
    return [r["response"] for r in recs]


GENERATIONS = [
    "tp1",
    "tp1_repeat",
    "tp1_other_seed",
    "tp1_other_step",
    "tp2",
    "tp2_noisy",
    "tp2_restored",
    "kv1",
    "kv1_noisy",
]


@pytest.mark.parametrize("key", [*GENERATIONS, "tp2_zero_lm_head"])
def test_n_responses_per_prompt_in_prompt_order(run, key):
    """Each rank gets n responses for each of its own training-DP prompts, prompt-major, whatever
    the rollout layout (TP_v=1 → rollout DP 2 splits the 5 prompts 3/2 across ranks; TP_v=2 → one
    group generates all)."""
    n = 1 if key == "tp2_zero_lm_head" else 3
    for rank in run["ranks"]:
        recs, local = rank["records"][key], rank["meta"]["local"]
        assert len(recs) == n * len(local)
        for i, r in enumerate(recs):
            assert (r["prompt_index"], r["sample_index"]) == (i // n, i % n)
            assert r["prompt"] == local[i // n]


def test_samples_carry_global_prompt_ids(run):
    """generate_distributed returns each prompt's position in the global batch (rank 0 holds
    prompts 0-2, rank 1 prompts 3-4), at rollout DP 2 (TP_v=1) and DP 1 (TP_v=2)."""
    for key in ("tp1", "tp2", "kv1"):
        for rank, recs in enumerate(records(run, key)):
            offset = 0 if rank == 0 else 3
            assert [r["prompt_id"] for r in recs] == [offset + i // 3 for i in range(len(recs))]


def test_from_config_reaches_vllm(run):
    """VLLMEngine.from_config: the config's names and values arrive in vLLM's own config
    (dtype spelled fp32 in the config, max_model_len = prompt + response length, processed
    log-probs, the trainer's trust_remote_code), and it reads no checkpoint: vLLM's dummy load
    format, started from a model directory without its weights file; the first sync brings the
    weights (the TP 2 rollouts then equal TP 1's from the checkpoint and transformers'
    log-probs: the tests below)."""
    got = run["ranks"][0]["meta"]["from_config"]
    assert got == {
        "max_model_len": 128,
        "dtype": "torch.float32",
        "logprobs_mode": "processed_logprobs",
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 256,
        "max_num_seqs": 64,
        "enforce_eager": True,
        "tensor_parallel_size": 2,
        "kv_cache_memory_bytes": 32 << 20,
        "load_format": "dummy",
        "trust_remote_code": True,
    }


def test_dp1_identical_shards_get_identical_results(run):
    """Training DP 1 (both ranks hold all prompts, like TP peers): no duplicates, same answers."""
    r0, r1 = records(run, "tp1_dp1_stops")
    prompts = run["ranks"][0]["meta"]["prompts"]
    assert r0 == r1
    assert [r["prompt"] for r in r0] == [p for p in prompts for _ in range(2)]


def test_finish_reason(run):
    """ "length" exactly when the response has max_tokens tokens; "stop" ends on a stop/EOS id."""
    meta = run["ranks"][0]["meta"]
    eos = set(meta["eos"])
    assert eos == {0}
    stop_seen = 0
    for key, max_tokens, stops in [
        *[(k, meta["max_tokens"], eos) for k in [*GENERATIONS, "tp2_zero_lm_head"]],
        ("tp1_dp1_stops", 16, eos | set(meta["extra_stops"])),
    ]:
        for recs in records(run, key):
            for r in recs:
                if r["finish_reason"] == "length":
                    assert len(r["response"]) == max_tokens
                    assert not set(r["response"]) & stops
                else:
                    assert r["finish_reason"] == "stop"
                    assert 1 <= len(r["response"]) <= max_tokens
                    assert r["response"][-1] in stops
                    assert not set(r["response"][:-1]) & stops
                    stop_seen += 1
    assert stop_seen >= 5  # the extra stop ids cover ~30% of the vocabulary


def test_same_seed_same_tokens(run):
    for a, b in zip(records(run, "tp1"), records(run, "tp1_repeat"), strict=True):
        assert a == b
    # Same weights reloaded through streamed single-tensor chunks: the first TP=2 call again.
    for a, b in zip(records(run, "tp2"), records(run, "tp2_restored"), strict=True):
        assert tokens(a) == tokens(b)
        for x, y in zip(a, b):
            assert x["logprobs"] == pytest.approx(y["logprobs"], abs=1e-5)


@pytest.mark.parametrize("other", ["tp1_other_seed", "tp1_other_step"])
def test_different_seed_or_step_different_tokens(run, other):
    for a, b in zip(records(run, "tp1"), records(run, other), strict=True):
        assert sum(x != y for x, y in zip(tokens(a), tokens(b))) >= len(a) - 1
        # the n samples of one prompt differ from each other too
        assert len({tuple(t) for t in tokens(a)}) >= len(a) - 1


def test_seeds_do_not_depend_on_rollout_layout(run):
    """Seeds use the global prompt index: TP_v=1 (2 rollout groups) and TP_v=2 (1 group) draw
    the same tokens up to float round-off (which can flip a near-tie, hence "most")."""
    same = total = 0
    for a, b in zip(records(run, "tp1"), records(run, "tp2"), strict=True):
        same += sum(x == y for x, y in zip(tokens(a), tokens(b)))
        total += len(a)
    assert same >= total - 2


@pytest.mark.parametrize(
    "key,model",
    [
        ("tp1", "models/tiny"),
        ("tp2", "models/tiny"),
        ("tp1_dp1_stops", "models/tiny"),
        ("tp2_noisy", "out/tiny_noisy"),
        ("kv1", "models/tiny_kv1"),
        ("kv1_noisy", "out/tiny_kv1_noisy"),
    ],
)
def test_logprobs_match_transformers(run, hf_logprobs, key, model):
    """vLLM's processed log-probs = log_softmax(logits / T) of the HF model at the sampled tokens
    (fp32, T=0.7), before and after update_weights (noisy = every weight + N(0, 0.05²)), at
    TP_v=1 and 2, and with a single KV head replicated over TP_v=2."""
    kind, name = model.split("/")
    model_dir = run[kind] / name
    temperature = run["ranks"][0]["meta"]["temperature"]
    for recs in records(run, key):
        want = hf_logprobs(model_dir, recs, temperature)
        for r, w in zip(recs, want, strict=True):
            assert r["logprobs"] == pytest.approx(w, abs=LOGPROB_TOL)


def test_teacher_top_k_log_probs_match_transformers(run):
    """A teacher's scores from vLLM's prompt log-probs (megarl.rollout.teacher_scores, at TP_v=2):
    at every response position the top-k ids are the HF model's, by rank, and their log-probs
    and the log-prob of the token there are its log_softmax (temperature 1) within 1e-4; the
    positions past a shorter response are 0; both TP ranks get the same scores."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run["models"] / "tiny", dtype=torch.float32)
    first, second = (rank["teacher"] for rank in run["ranks"])
    assert first == second
    ids, lps = torch.tensor(first["topk_ids"]), torch.tensor(first["topk_log_probs"])
    sampled, k = torch.tensor(first["log_probs"]), ids.shape[-1]
    width = ids.shape[1]
    with torch.no_grad():
        for i, (prompt, response) in enumerate(zip(first["prompts"], first["responses"])):
            logits = model(torch.tensor([prompt + response])).logits[0].double()
            lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)  # scores response tokens
            want = lp.topk(k, dim=-1)
            r = len(response)
            assert torch.equal(ids[i, :r], want.indices), i
            assert torch.allclose(lps[i, :r].double(), want.values, atol=1e-4), i
            there = lp.gather(-1, torch.tensor(response)[:, None])[:, 0]
            assert torch.allclose(sampled[i, :r].double(), there, atol=1e-4), i
            assert not ids[i, r:].any() and not lps[i, r:].any() and not sampled[i, r:].any()
        assert width == max(len(r) for r in first["responses"])


@pytest.mark.parametrize("tag", ["tp2", "tp1"])
def test_partial_rollout_on_unchanged_weights_is_the_uninterrupted_generation(run, tag):
    """Greedy, interrupted after the prefill and 3 tokens, the same weights reloaded, continued
    from prompt + tokens so far as token ids: the same tokens with the same log-probs as the
    uninterrupted generation; the tokens after the interruption record version 1. TP 2: one
    replica over both ranks; TP 1: two replicas with shares of their own, stopping together."""
    for whole, parts in zip(records(run, f"{tag}_greedy"), records(run, f"{tag}_greedy_partial"),
                            strict=True):  # fmt: skip
        assert tokens(parts) == tokens(whole)
        for a, b in zip(whole, parts, strict=True):
            assert b["logprobs"] == pytest.approx(a["logprobs"], abs=1e-5)
            assert b["finish_reason"] == a["finish_reason"]
            assert a["versions"] is None
            assert b["versions"] == [0] * min(3, len(b["response"])) + [1] * max(
                len(b["response"]) - 3, 0
            )


def test_continuous_batching_answers_each_request_as_if_generated_alone(run):
    """Partial rollouts' serving loop over two replicas: the second and third requests join
    the running batch while the first generates (their first tokens come from version 0, before
    the update stopped the first mid-way); greedy on the same weights reloaded, every reply, in
    order, holds the tokens and log-probs of its request generated alone."""
    for rank in run["ranks"]:
        recs = rank["records"]
        assert len(recs["stream_replies"]) == len(recs["stream_alone"]) == 3
        assert sum(recs["stream_interruptions"]) == 1
        for alone, streamed in zip(recs["stream_alone"], recs["stream_replies"], strict=True):
            assert tokens(streamed) == tokens(alone)
            for a, b in zip(alone, streamed, strict=True):
                assert (b["prompt_id"], b["sample_index"]) == (a["prompt_id"], a["sample_index"])
                assert b["logprobs"] == pytest.approx(a["logprobs"], abs=1e-5)
                assert b["finish_reason"] == a["finish_reason"]
                assert b["versions"] == sorted(b["versions"])
        first, *joined = recs["stream_replies"]
        assert any(0 in r["versions"] and 1 in r["versions"] for r in first)
        for reply in joined:
            assert any(0 in r["versions"] for r in reply)


def test_partial_rollout_tokens_carry_the_log_probs_of_the_weights_that_sampled_them(
    run, hf_logprobs
):
    """Sampled (T=0.7), interrupted after 3 tokens onto the noisy weights: each token's
    log-prob is the HF model's under the version it records (the original weights before the
    interruption, the noisy ones after), within 1e-4; the budget is the whole response's."""
    temperature = run["ranks"][0]["meta"]["temperature"]
    assert run["ranks"][0]["meta"]["partial_swaps"] == 1
    models = {0: run["models"] / "tiny", 1: run["out"] / "tiny_noisy"}
    for recs in records(run, "tp2_partial_noisy"):
        assert any(1 in r["versions"] and 0 in r["versions"] for r in recs)
        # the versions matter: the noisy tokens' log-probs are not the original weights'
        original = hf_logprobs(models[0], recs, temperature)
        assert max(abs(r["logprobs"][i] - w[i]) for r, w in zip(recs, original, strict=True)
                   for i, v in enumerate(r["versions"]) if v == 1) > 1e-2  # fmt: skip
        for version, model_dir in models.items():
            want = hf_logprobs(model_dir, recs, temperature)
            for r, w in zip(recs, want, strict=True):
                assert len(r["response"]) <= run["ranks"][0]["meta"]["max_tokens"]
                at = [i for i, v in enumerate(r["versions"]) if v == version]
                assert [r["logprobs"][i] for i in at] == pytest.approx(
                    [w[i] for i in at], abs=LOGPROB_TOL
                )


def test_update_weights_changes_the_rollout(run):
    """The same prompts and seeds after the update give other tokens (the cached prefixes of the
    old weights were dropped: the HF comparison of tp2_noisy above would fail otherwise)."""
    for a, b in zip(records(run, "tp2"), records(run, "tp2_noisy"), strict=True):
        assert tokens(a) != tokens(b)
        assert all(x["logprobs"] != y["logprobs"] for x, y in zip(a, b))


def test_dense_cpu_weight_updates_copy_into_the_weights_vllm_computes_with(run):
    """On CPU a dense model's update is a plain load into the kept weights, no layerwise reload
    (megarl.rollout.vllm_process._keep_cpu_linear_weights); the HF comparisons after the updates
    above (tp2_noisy, the tied kv1_noisy) show it lands."""
    for rank in run["ranks"]:
        assert rank["meta"]["update_in_place"] == {"tp1": True, "kv1": True}


def test_zeroed_lm_head_gives_uniform_logprobs(run):
    """A partial update (only lm_head) at TP_v=2."""
    for recs in records(run, "tp2_zero_lm_head"):
        assert recs
        for r in recs:
            assert r["logprobs"] == pytest.approx([-math.log(1000)] * len(r["response"]), abs=1e-5)


def test_engine_leaves_global_rngs_alone(run):
    """Start-up (vLLM reseeds everything) and generation (its CPU sampler draws from torch's RNG)
    leave Python's, NumPy's and torch's global generators where the trainer left them."""
    import importlib

    worker = importlib.import_module("tests.rollout._vllm_worker")
    for rank in run["ranks"]:
        worker.seed_global_rngs(1000 + rank["rank"])
        assert rank["rng_after_tp1"] == pytest.approx(worker.draw_global_rngs(), abs=0)


def test_throughput_batch_generates_what_was_asked_and_timings_are_reported(run):
    """16 prompts × n=4, at most 32 tokens each; timings are printed, not asserted."""
    t = run["ranks"][0]["timings"]
    print("\nvLLM timings (rank 0):", json.dumps({k: round(v, 2) for k, v in t.items()}))
    for tag in ("warm", "steady"):
        assert t[f"tp1_{tag}_samples"] == 16 * 4
        assert 16 * 4 <= t[f"tp1_{tag}_tokens"] <= 16 * 4 * 32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sleep_wake_around_update_on_gpu(tmp_path):
    """Sleep frees GPU memory; wake weights → update → wake KV cache; generation reflects the new
    weights (zeroed lm_head → uniform log-probs)."""
    from megarl.models.tiny import make_tiny_model
    from megarl.rollout.base import update_weights
    from megarl.rollout.vllm_engine import VLLMEngine

    path = make_tiny_model(tmp_path / "tiny")
    engine = VLLMEngine(
        path,
        tensor_parallel_size=1,
        dtype="float32",
        max_model_len=128,
        gpu_memory_utilization=0.2,
        free_cache_engine=True,
    )
    try:
        kw = {"n": 2, "temperature": 0.7, "max_tokens": 8, "seed": 0}
        before = engine.generate([[5, 6, 7]], **kw)
        free_awake = torch.cuda.mem_get_info()[0]
        engine.sleep()
        assert engine.is_sleeping
        assert torch.cuda.mem_get_info()[0] > free_awake
        engine.wake_up(["weights"])
        from safetensors.torch import load_file

        lm_head = load_file(str(path / "model.safetensors"))["lm_head.weight"]
        update_weights(engine, [("lm_head.weight", torch.zeros_like(lm_head).cuda())])
        engine.wake_up(["kv_cache"])
        assert not engine.is_sleeping
        after = engine.generate([[5, 6, 7]], **kw)
        assert before[0].response_logprobs != after[0].response_logprobs
        for s in after:
            assert s.response_logprobs == pytest.approx(
                [-math.log(1000)] * len(s.response_token_ids), abs=1e-4
            )
    finally:
        engine.shutdown()


def test_no_ipc_socket_file_is_left_behind(run):
    """vLLM binds ZeroMQ IPC sockets as files in the temporary directory and never removes them
    when a rank exits without closing them; each rank's private directory for them is gone too
    (megarl.rollout.vllm_process). Plain torchrun's own error-file directory is torch's."""
    left = [p for p in run["tmpdir"].rglob("*") if p.is_socket() or "megarl-vllm-ipc" in p.name]
    assert left == []


def test_no_shared_memory_name_is_left_once_the_engine_is_up(run):
    """vLLM's CPU collectives at TP 2 map a shared-memory segment per rank under the same name
    in every run on the machine, and only unlinked it at an exit megarl's ranks skip: the next
    run failed. Each rank removes its name once the engine is up (megarl.rollout.vllm_process),
    and the TP 2 rollouts after that still match transformers (the log-prob tests above).
    vLLM makes segments only where its kernel build has the shared-memory manager (AVX-512
    builds; on an AVX2-only CPU it falls back to torch.distributed and makes none). The names
    carry the launch's port, so that two launches starting vLLM at once (the suite's lanes) do
    not take each other's."""
    for rank in run["ranks"]:
        shm, port = rank["meta"]["shm"], rank["meta"]["master_port"]
        assert all(name.startswith("/dev/shm/") for name, _ in shm), shm
        assert all(f"-{port}-cpushm_" in name for name, _ in shm), shm
        assert bool(shm) == rank["meta"]["shm_manager"], shm  # made exactly where vLLM makes them
        assert [name for name, exists in shm if exists] == []
