"""``distillation.*`` (verl 0.9.1's on-policy distillation section): verl's composed YAML
defaults, verl's checks (and megarl's range checks), each bad value refused in one line naming
its key, what megarl does not build refused in one line, and the teachers as the run reads them.

In-process (``load_config`` + ``validate`` on ``configs/grpo_tiny_cpu.yaml``).
"""

from __future__ import annotations

import dataclasses

import pytest

from megarl.config import ConfigError, load_config, validate
from megarl.config.verl_defaults import leaves, verl_defaults
from tests.conftest import REPO

TINY = REPO / "configs" / "grpo_tiny_cpu.yaml"
L = "distillation.distillation_loss"
T = "distillation.teacher_models"
# A teacher pool verl accepts: 4 GPUs, one teacher at TP 2 (two replicas), a model path.
ENABLED = [
    "distillation.enabled=true",
    "distillation.n_gpus_per_node=4",
    "distillation.nnodes=1",
    f"{T}.teacher_model.model_path=Qwen/Qwen3-32B",
]


def problems(overrides: list[str]) -> list[str]:
    """The lines loading and validating the tiny config with ``overrides`` refuse it with."""
    try:
        validate(load_config(TINY, overrides))
    except ConfigError as error:
        return error.problems
    return []


def test_the_defaults_are_verls_composed_yaml():
    ours = leaves(dataclasses.asdict(load_config(TINY).distillation), "distillation")
    verls = {k: v for k, v in verl_defaults().items()
             if k.startswith("distillation.") and not k.endswith("_target_")}  # fmt: skip
    # ${oc.select:...} entries of the teacher's inference section follow the student's rollout
    for key, value in verls.items():
        if isinstance(value, str) and value.startswith("${"):
            verls[key] = ours[key]
    assert ours == verls
    loss = load_config(TINY).distillation.distillation_loss
    assert (loss.loss_mode, loss.topk, loss.use_task_rewards, loss.use_policy_gradient) == (
        "k3", 32, True, False,
    )  # fmt: skip
    assert loss.loss_max_clamp is None and loss.log_prob_min_clamp is None


def test_every_key_at_its_default_validates_and_the_good_modes_do():
    assert problems([]) == []
    assert problems([f"{L}.loss_mode=forward_kl_topk", f"{L}.topk=64"]) == []
    assert problems([f"{L}.loss_mode=k1", f"{L}.use_policy_gradient=true"]) == []
    assert problems([f"{L}.loss_max_clamp=10", f"{L}.log_prob_min_clamp=-10"]) == []


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        ([f"{L}.loss_mode=k1"], f"{L}.loss_mode=k1 with use_policy_gradient=false: k1's gradient"),
        ([f"{L}.loss_mode=kl"], f"{L}.loss_mode=kl with use_policy_gradient=false"),
        ([f"{L}.loss_mode=reverse_kl_topk"], f"{L}.loss_mode: 'reverse_kl_topk' is not one of"),
        ([f"{L}.policy_loss_mode=gspo"], f"{L}.policy_loss_mode: 'gspo' is not one of vanilla"),
        ([f"{L}.loss_mode=forward_kl_topk", f"{L}.topk=null"], f"{L}.topk=null: loss_mode="),
        ([f"{L}.loss_mode=forward_kl_topk", f"{L}.topk=0"], f"{L}.topk=0: loss_mode="),
        ([f"{L}.loss_max_clamp=0"], f"{L}.loss_max_clamp=0.0 must be > 0"),
        ([f"{L}.log_prob_min_clamp=1"], f"{L}.log_prob_min_clamp=1.0 must be < 0"),
        ([f"{L}.distillation_loss_coef=-1"], f"{L}.distillation_loss_coef=-1.0 must be >= 0"),
        ([f"{L}.clip_ratio_low=-0.1"], f"{L}.clip_ratio_low=-0.1 must be >= 0"),
        (["distillation.nnodes=-1"], "distillation.nnodes=-1 must be >= 0"),
        (["distillation.teacher_key= "], "distillation.teacher_key is empty"),
        ([f"{L}.topk=many"], f"{L}.topk: expected null or an integer, got"),
    ],
)
def test_a_bad_value_is_refused_in_one_line_naming_its_key(overrides, line):
    found = problems(overrides)
    assert len(found) == 1 and found[0].startswith(line), found


MEGATRON = [
    "distillation.enabled=true",
    "distillation.nnodes=0",
    f"{T}.teacher_model.model_path=Qwen/Qwen3-32B",
    f"{T}.teacher_model.inference.name=megatron",
]


def test_a_vllm_teacher_on_a_pool_of_its_own_is_accepted_with_replicas_of_tp_only():
    assert problems(ENABLED) == []  # verl's default engine: two replicas of TP 2 on 4 GPUs
    assert problems([*ENABLED, f"{L}.loss_mode=forward_kl_topk"]) == []
    for dim in ("data_parallel_size", "pipeline_model_parallel_size"):
        (line,) = problems([*ENABLED, f"+{T}.teacher_model.inference.{dim}=2"])
        assert line.startswith(f"{T}.teacher_model.inference.{dim}=2: a vLLM teacher runs"), line


def test_the_megatron_teacher_on_the_training_ranks_is_accepted_with_every_loss_mode():
    assert problems(MEGATRON) == []
    assert problems([*MEGATRON, f"{L}.loss_mode=k1", f"{L}.use_policy_gradient=true"]) == []
    assert problems([*MEGATRON, f"{L}.loss_mode=forward_kl_topk"]) == []
    (line,) = problems([*MEGATRON, "distillation.nnodes=1"])
    assert line.startswith("distillation.nnodes=1: the Megatron teacher runs on the training")


def test_the_megatron_teacher_runs_at_its_own_tp_x_pp_when_it_divides_the_training_ranks():
    from megarl.config.teachers import megatron_teacher_layout

    inference = f"{T}.teacher_model.inference"
    assert megatron_teacher_layout(load_config(TINY, MEGATRON)) is None  # TP 2: the actor's
    own = [*MEGATRON, f"{inference}.tensor_model_parallel_size=1",
           f"+{inference}.pipeline_model_parallel_size=2"]  # fmt: skip
    assert problems(own) == []
    layout = megatron_teacher_layout(load_config(TINY, own))
    assert (layout.tp, layout.pp, layout.context_parallel_size) == (1, 2, 1)
    (line,) = problems([*MEGATRON, f"{inference}.tensor_model_parallel_size=4"])
    assert line == (
        f"{inference}.tensor_model_parallel_size=4 x pipeline_model_parallel_size=1 does not "
        "divide the 2 training rank(s): the Megatron teacher runs on them at this TP x PP"
    )


def test_one_response_per_prompt_is_accepted_only_when_the_task_rewards_are_unused():
    """verl's on-policy-distillation script: grpo with rollout.n=1 and use_task_rewards=false
    (no estimator advantage is used); with the task rewards the group needs n >= 2."""
    one = "actor_rollout_ref.rollout.n=1"  # (the tiny config's batch sizes then need n = 8)
    group = "algorithm.adv_estimator=grpo compares the responses to the same prompt"
    unused = problems([*MEGATRON, one, f"{L}.use_task_rewards=false"])
    assert unused and not any(p.startswith(group) for p in unused), unused
    used = problems([*MEGATRON, one, f"{L}.use_task_rewards=true"])
    assert [p for p in used if p.startswith(group)] and len(used) == len(unused) + 1, used


def test_a_teacher_of_another_vocabulary_is_refused(tmp_path):
    from megarl.models.tiny import make_tiny_model

    make_tiny_model(tmp_path / "student", "qwen2")
    make_tiny_model(tmp_path / "teacher", "qwen2", vocab_size=512)
    overrides = [*MEGATRON, f"actor_rollout_ref.model.path={tmp_path / 'student'}",
                 f"{T}.teacher_model.model_path={tmp_path / 'teacher'}"]  # fmt: skip
    (line,) = problems(overrides)
    assert line.startswith(f"{T}.teacher_model.model_path: the teacher's vocab_size 512 is not")


def test_a_top_k_larger_than_the_vocabulary_is_refused(tmp_path):
    from megarl.models.tiny import make_tiny_model

    for name in ("student", "teacher"):
        make_tiny_model(tmp_path / name, "qwen2")  # 1000 tokens
    overrides = [*MEGATRON, f"actor_rollout_ref.model.path={tmp_path / 'student'}",
                 f"{T}.teacher_model.model_path={tmp_path / 'teacher'}",
                 f"{L}.loss_mode=forward_kl_topk"]  # fmt: skip
    assert problems([*overrides, f"{L}.topk=1000"]) == []
    (line,) = problems([*overrides, f"{L}.topk=1001"])
    assert line == f"{L}.topk=1001 is more than the vocabulary's 1000 tokens"


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        # verl: a single teacher's replica (TP x DP x PP) must divide the pool
        ([f"{T}.teacher_model.inference.tensor_model_parallel_size=3"], f"{T}.teacher_model.inference: a replica of 3"),
        (["distillation.nnodes=0"], "distillation.nnodes=0 x n_gpus_per_node=4 = 0"),
        ([f"{T}.teacher_model.model_path=null"], f"{T}.teacher_model.model_path must be set"),
        # verl: vLLM's max_logprobs >= topk for the top-k loss
        (
            [f"{L}.loss_mode=forward_kl_topk", f"{L}.topk=64",
             f"+{T}.teacher_model.inference.engine_kwargs.vllm.max_logprobs=20"],
            f"{T}.teacher_model.inference.engine_kwargs.vllm.max_logprobs=20 < {L}.topk=64",
        ),
        # verl: the teacher's context holds the student's prompt and response and one token
        ([f"{T}.teacher_model.inference.max_model_len=100"], f"{T}.teacher_model.inference.max_model_len=100 <"),
        ([f"{T}.teacher_model.inference.name=sglang"], f"{T}.teacher_model.inference.name=sglang: a teacher"),
        ([f"{T}.teacher_model.inference.data_parallel_size=0"], f"{T}.teacher_model.inference.data_parallel_size=0 must be"),
        ([f"+{T}.teacher_model.inference.tensor_parallel=2"], f"{T}.teacher_model.inference.tensor_parallel: not a key"),
        # several teachers: the default entry is dropped, each needs its key; the pool must match
        (
            [f"+{T}.math.key=math", f"+{T}.math.model_path=a", f"+{T}.math.num_replicas=1",
             f"+{T}.gsm.key=math", f"+{T}.gsm.model_path=b", f"+{T}.gsm.num_replicas=1"],
            f"{T}.gsm.key=math: also the key of teacher_models.math",
        ),
        (
            [f"+{T}.math.key=math", f"+{T}.math.model_path=a", f"+{T}.math.num_replicas=1"],
            f"{T}: num_replicas x (TP x DP x PP) summed over the teachers = 2, not the pool",
        ),
    ],
)  # fmt: skip
def test_verls_teacher_checks_when_enabled(overrides, line):
    found = problems([*ENABLED, *overrides])
    assert len(found) == 1 and found[0].startswith(line), found


TWO = [f"+{T}.{name}.{key}={value}"
       for name in ("math", "gsm")
       for key, value in (("key", name), ("model_path", name), ("num_replicas", 1))]  # fmt: skip
"""Two routed teachers of TP 2, one replica each: the pool of 4."""


def test_two_teachers_filling_the_pool_are_accepted_and_read_in_pool_order():
    from megarl.config.batch_plan import teacher_blocks, teacher_ranks
    from megarl.config.teachers import teachers

    assert problems([*ENABLED, *TWO]) == []
    cfg = load_config(TINY, [*ENABLED, *TWO])
    found = teachers(cfg)  # verl's rule: the default entry teacher_model is left out
    assert [(t.name, t.key, t.model_path, t.ranks, t.tp) for t in found] == [
        ("math", "math", "math", 2, 2), ("gsm", "gsm", "gsm", 2, 2),
    ]  # fmt: skip
    assert teacher_blocks(cfg) == (2, 2) and teacher_ranks(cfg) == 4
    (single,) = teachers(load_config(TINY, ENABLED))
    assert (single.name, single.key, single.ranks) == ("teacher_model", None, 4)


def test_several_megatron_teachers_and_two_engines_are_refused_in_one_line():
    megatron = [f"+{T}.{n}.inference.name=megatron" for n in ("math", "gsm")]
    (line,) = problems([*ENABLED, *TWO, *megatron, "distillation.nnodes=0"])
    assert line.startswith(f"{T}: several megatron teachers (routed by distillation.teacher_key)")
    (line,) = problems([*ENABLED, *TWO, megatron[0]])
    assert line.startswith(f"{T}: teachers served by both vllm and megatron are not built"), line


def test_the_top_k_loss_through_the_policy_gradient_is_warned_about_as_verl_does():
    warnings = validate(
        load_config(TINY, [f"{L}.loss_mode=forward_kl_topk", f"{L}.use_policy_gradient=true"])
    )
    assert [w for w in warnings if w.startswith(f"{L}.loss_mode=forward_kl_topk with use_policy")]


@pytest.mark.parametrize("what", ["missing", "no_config", "unsupported"])
def test_the_megatron_teachers_files_are_checked_at_the_preflight(what, tmp_path, tiny_overrides):
    """megarl train's pre-flight (validate with check_paths): a teacher directory that does not
    exist, holds no config.json, or holds an architecture megarl does not build is one line
    naming the key and the path; elsewhere (config validate) a warning."""
    import json

    teacher = tmp_path / "teacher"
    if what != "missing":
        teacher.mkdir()
    if what == "unsupported":
        (teacher / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    overrides = [
        *tiny_overrides,
        *MEGATRON[:2],
        MEGATRON[3],
        f"{T}.teacher_model.model_path={teacher}",
    ]
    cfg = load_config(TINY, overrides)
    with pytest.raises(ConfigError) as refused:
        validate(cfg, check_paths=True)
    (line,) = refused.value.problems
    assert line.startswith(f"{T}.teacher_model.model_path={str(teacher)!r}"), line
    assert {"missing": "does not exist", "no_config": "without a config.json",
            "unsupported": "unsupported architecture"}[what] in line  # fmt: skip
    assert any(w.startswith(f"{T}.teacher_model.model_path=") for w in validate(cfg))


def test_samples_are_routed_by_teacher_key_and_an_unnamed_value_is_one_line():
    from megarl.data.dataset import PromptSample
    from megarl.trainer.teacher import RoutingError, routes_of

    def sample(source, ability, extra, row):
        return PromptSample(row, [1], "q", source, "1", extra, ability, f"train.parquet row {row}")

    prompts = [sample("math", "arith", {"t": "gsm"}, 0), sample("gsm", "arith", {"t": "math"}, 1)]
    assert routes_of(load_config(TINY, ENABLED), prompts) is None  # one teacher takes all
    assert routes_of(load_config(TINY, [*ENABLED, *TWO]), prompts) == [0, 1]  # data_source
    by_extra = load_config(TINY, [*ENABLED, *TWO, "distillation.teacher_key=t"])
    assert routes_of(by_extra, prompts) == [1, 0]
    stray = [*prompts, sample("code", "arith", {"t": "code"}, 2)]
    with pytest.raises(RoutingError) as error:
        routes_of(by_extra, stray)
    assert str(error.value) == (
        "distillation.teacher_key=t: train.parquet row 2 has 'code', which no teacher's key "
        "names (math -> math, gsm -> gsm)"
    )
