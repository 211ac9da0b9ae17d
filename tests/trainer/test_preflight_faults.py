"""``megarl train``'s pre-flight (issue 23): mistakes that used to surface inside every rank (or
crash the pre-flight itself) are one line naming the key or file, exit 2, nothing launched.

Table-driven, in this process: ``megarl train``'s ``main`` with each mistake; a case that got
past the pre-flight would launch torchrun, which the ``no_launch`` fixture turns into a failure.
"""

from __future__ import annotations

import shutil
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.commands import train

CONFIG = "configs/grpo_tiny_cpu.yaml"
GOOD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    from megarl.commands import data
    from megarl.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("preflight")
    make_tiny_model(root / "model", family="qwen2")
    assert data.main(["synth", "--out", str(root / "data"), "--train-size", "64"]) == 0
    table = pq.read_table(root / "data" / "train.parquet")
    sources = pa.array(["nope/unknown"] * table.num_rows)
    pq.write_table(table.set_column(0, "data_source", sources), root / "unroutable.parquet")
    pq.write_table(table.slice(0, 2), root / "few.parquet")
    rows = table.to_pylist()
    rows[3]["prompt"] = [{"content": "no role here"}]
    pq.write_table(pa.Table.from_pylist(rows), root / "no_role.parquet")
    shutil.copytree(root / "model", root / "corrupt")
    with open(root / "corrupt" / "model.safetensors", "r+b") as f:
        f.write(b"\xff" * 8)  # the header length: far beyond the file
    files = {"syntax.py": "def compute_score(:\n", "other.py": GOOD.replace("compute", "c"),
             "signature.py": "def compute_score(text):\n    return 0.0\n",
             "imports.py": "import no_such_module_here\n" + GOOD,
             "returns_none.py": GOOD.replace("return 0.0", "return None"),
             "raises.py": GOOD.replace("return 0.0", "raise ValueError(solution_str)"),
             "components.py": GOOD.replace("return 0.0", "return {'score': 0.0, 'fmt': 1}"),
             "positional.py": "def compute_score(source, text, truth, info):\n    return 0.0\n"}  # fmt: skip
    for name, text in files.items():
        (root / name).write_text(text)
    return {"root": root}


@pytest.fixture
def no_launch(monkeypatch):
    """torchrun never starts: the launcher's pre-flight (which runs while the ranks start,
    tests/trainer/test_train_command.py) runs here alone, its problem printed as there."""
    from megarl.commands import launch

    def preflight_only(*args, preflight, **kwargs):
        problem = preflight()
        if problem is None:
            raise AssertionError("the pre-flight let this through to torchrun")
        print(f"error: {problem}", file=sys.stderr)
        return launch.EXIT_INPUT_ERROR

    monkeypatch.setattr(launch, "run_torchrun", preflight_only)


CASES = [
    # (id, overrides, what the line must name)
    ("reward syntax error", ["custom_reward_function.path={root}/syntax.py"], "syntax.py"),
    ("reward import error", ["custom_reward_function.path={root}/imports.py"], "no_such_module"),
    ("reward function missing", ["custom_reward_function.path={root}/other.py"], "compute_score"),
    ("reward signature", ["custom_reward_function.path={root}/signature.py"], "(text)"),
    # issue 40: the pre-flight's sample call (an empty response to the first prompt)
    ("reward returns None", ["custom_reward_function.path={root}/returns_none.py"],
     "returned score None of type NoneType, not a number or a bool, for an empty response"),
    # GDPO's components are the reward function's dict fields: one missing is named up front
    ("gdpo component missing", ["custom_reward_function.path={root}/components.py",
                                "algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[fmt,acc]"],
     "algorithm.gdpo_reward_keys ['acc']: not among the numeric fields"),
    ("reward signature (prime: positional)", ["custom_reward_function.path={root}/signature.py",
                                              "reward.reward_manager.name=prime"],
     "cannot be called as fn(data_source, solution_str, ground_truth, extra_info, "),
    ("unroutable data_source", ["data.train_files={root}/unroutable.parquet"], "nope/unknown"),
    ("message without role", ["data.train_files={root}/no_role.parquet"], "no_role.parquet row 3"),
    ("fewer rows than a batch", ["data.train_files={root}/few.parquet"], "data.train_batch_size"),
    ("lr nan", ["actor_rollout_ref.actor.optim.lr=nan"], "actor_rollout_ref.actor.optim.lr=nan"),
    ("corrupt safetensors", ["actor_rollout_ref.model.path={root}/corrupt"], "model.safetensors"),
    ("missing tokenizer", ["actor_rollout_ref.model.tokenizer_path={root}/none"], "tokenizer_path"),
    ("run dir not creatable", ["trainer.default_local_dir=/proc/megarl/run"], "default_local_dir"),
]  # fmt: skip


def test_a_reward_function_raising_on_the_preflights_sample_passes(tiny, no_launch, capsys):
    """Its real responses differ from the pre-flight's empty one: the run is not refused."""
    root = tiny["root"]
    with pytest.raises(AssertionError, match="let this through"):
        train.main(["-c", CONFIG, f"actor_rollout_ref.model.path={root / 'model'}",
                    f"data.train_files={root / 'data' / 'train.parquet'}",
                    f"data.val_files={root / 'data' / 'test.parquet'}",
                    f"trainer.default_local_dir={root / 'run'}",
                    f"custom_reward_function.path={root / 'raises.py'}"])  # fmt: skip


def test_the_prime_manager_calls_positionally(tiny, no_launch):
    """Other parameter names than verl's keywords pass under prime (it calls positionally)."""
    root = tiny["root"]
    with pytest.raises(AssertionError, match="let this through"):
        train.main(["-c", CONFIG, f"actor_rollout_ref.model.path={root / 'model'}",
                    f"data.train_files={root / 'data' / 'train.parquet'}",
                    f"data.val_files={root / 'data' / 'test.parquet'}",
                    f"trainer.default_local_dir={root / 'run'}", "reward.reward_manager.name=prime",
                    f"custom_reward_function.path={root / 'positional.py'}"])  # fmt: skip


@pytest.mark.parametrize(("overrides", "named"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_naming_it_and_exit_2(tiny, no_launch, capsys, overrides, named):
    root = tiny["root"]
    base = [
        f"actor_rollout_ref.model.path={root / 'model'}",
        f"data.train_files={root / 'data' / 'train.parquet'}",
        f"data.val_files={root / 'data' / 'test.parquet'}",
        f"trainer.default_local_dir={root / 'run'}",
    ]
    code = train.main(["-c", CONFIG, *base, *(o.format(root=root) for o in overrides)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert named in lines[0] and "Traceback" not in err, lines[0]
