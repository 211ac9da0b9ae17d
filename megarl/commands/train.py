"""``megarl train``: check a run, then launch its ranks on this machine (torchrun).

    megarl train [-c X.yaml [-c Y.yaml]] [KEY=VALUE ...] [--verbose]

The checks (config with its files and world size, the data, the checkpoint a resume would load)
run while the ranks start and wait at the launcher's gate (:mod:`megarl.commands.launch`); a
problem is one line, exit 2, before any rank has done anything. Inside a launched world
(``WORLD_SIZE`` set) it is a rank itself (:func:`megarl.trainer.start`).
``MEGARL_TRAIN_MODULE`` replaces the module torchrun runs (``megarl.trainer``).

``--check`` runs the checks alone: the run directory on stdout and, for a run on this machine,
what would start here. A Slurm job (``launch/_slurm_job.sh``) runs ``--check`` once, then on
every node ``--rdzv-endpoint HOST:PORT --rdzv-id ID --log-dir DIR``; both get ``--nodes N``, the
job's nodes, of which ``actor_rollout_ref.rollout.nnodes`` hold only vLLM and, after them, a vLLM
distillation teachers' pool its ``distillation.nnodes``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXIT_INPUT_ERROR = 2


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megarl train", description=__doc__.split("\n")[0])
    # No file: verl's defaults (ppo_megatron_trainer.yaml) plus the overrides, as a verl script.
    parser.add_argument("-c", "--config", action="append", default=[], metavar="FILE")
    parser.add_argument(
        "--verbose", action="store_true", help="show third-party output (vLLM, Megatron) too"
    )
    parser.add_argument(
        "--check", action="store_true",
        help="pre-flight only: print the run directory (and on one machine what would start)",
    )  # fmt: skip
    node = parser.add_argument_group("one node of a multi-node launch (launch/_slurm_job.sh)")
    node.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="the c10d rendezvous")
    node.add_argument("--rdzv-id", metavar="ID", help="the rendezvous id (the Slurm job id)")
    node.add_argument("--log-dir", metavar="DIR", help="torchrun's log: DIR/<node>.log")
    node.add_argument(
        "--nodes", type=int, metavar="N",
        help="the job's nodes: trainer.nnodes = N - actor_rollout_ref.rollout.nnodes "
        "- distillation.nnodes (a vLLM teachers' pool)",
    )  # fmt: skip
    args, overrides = parser.parse_known_args(argv)
    bad = [a for a in overrides if a.startswith("-")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if args.verbose:
        os.environ["MEGARL_VERBOSE"] = "1"
    if os.environ.get("WORLD_SIZE"):  # a rank of a launched world: train here
        from megarl.trainer import start

        return start(args.config, overrides)
    if args.nodes is not None:
        overrides, problem = _training_nodes(args.config, overrides, args.nodes)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return EXIT_INPUT_ERROR
    if args.check:  # one machine unless --nodes (the Slurm job script) or the config says so
        return _check_only(args.config, overrides, multinode=args.nodes is not None)
    multinode = args.rdzv_endpoint is not None
    if args.rdzv_endpoint is not None and not (args.rdzv_id and args.log_dir):
        parser.error("--rdzv-endpoint needs --rdzv-id and --log-dir")
    # Every node of a job checks its own files (a node without the data fails here, not in NCCL).
    from megarl.commands import launch

    # The user's values win. CUDA_DEVICE_MAX_CONNECTIONS=1: Megatron's TP/SP communication
    # overlap relies on it (megarl.parallel.init.MAX_CONNECTIONS_ENV).
    env = {"OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", **os.environ}
    module = os.environ.get("MEGARL_TRAIN_MODULE") or "megarl.trainer"
    configs = [a for c in args.config for a in ("--config", c)]
    if not multinode:
        # The ranks start at once and import (torch, Megatron, transformers: ~10 s) while this
        # process checks the run; they wait at the launcher's gate until the checks have passed.
        cfg, problem = _load(args.config, overrides, multinode=False)
        if cfg is None:
            print(f"error: {problem}", file=sys.stderr)
            return EXIT_INPUT_ERROR
        from megarl.config.batch_plan import rollout_ranks, teacher_ranks

        nproc = cfg.trainer.n_gpus_per_node  # training ranks, then any rollout-, teacher-only
        split = rollout_ranks(cfg) + teacher_ranks(cfg)
        if cfg.trainer.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(cpu_threads_per_rank(nproc + split))
        command = launch.torchrun_command(nproc + split, module, [*configs, *overrides])
        return launch.run_torchrun(
            command, env, run_dir_of(cfg), preflight=lambda: _check(cfg, nproc),
            training_ranks=nproc if split else None,
            first_teacher_rank=nproc + rollout_ranks(cfg) if teacher_ranks(cfg) else None,
        )  # fmt: skip
    problem, nproc, run_dir = preflight(args.config, overrides, multinode=multinode)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    nodes, own_nodes, teacher_nodes = _nodes(args.config, overrides)
    command = launch.torchrun_command(
        nproc, module, [*configs, *overrides],
        rendezvous=(nodes, args.rdzv_endpoint, args.rdzv_id),
    )  # fmt: skip
    log_path = Path(args.log_dir) / f"{launch.node_name()}.log"
    training = nproc * (nodes - own_nodes) if own_nodes else None
    first_teacher = nproc * (nodes - teacher_nodes) if teacher_nodes else None
    return launch.run_torchrun(command, env, run_dir, log_path=log_path, training_ranks=training,
                               first_teacher_rank=first_teacher)  # fmt: skip


def cpu_threads_per_rank(ranks: int) -> int:
    """A CPU run's intra-op threads per rank: this machine's cores (those this process may run
    on) shared among its ``ranks``, at least 1. A rank alone on 2 cores gets both: its matrix
    products run 1.8x faster on 2 threads (an [830, 128] x [128, 512] product, measured here).
    GPU ranks keep 1, as torchrun sets it."""
    return max(1, len(os.sched_getaffinity(0)) // max(ranks, 1))


def _check_only(configs: list[str], overrides: list[str], *, multinode: bool) -> int:
    """``--check``: the pre-flight of the launch the run would get, then its run directory on
    stdout (the Slurm job script reads it) and, on one machine, what would start there. A
    config on one node (``trainer.nnodes`` 1, ``actor_rollout_ref.rollout.nnodes`` 0 or 1) is
    checked as ``megarl train`` launches it here, unless ``multinode`` (``--nodes``)."""
    cfg, problem = _load(configs, overrides, multinode=True if multinode else None)
    if cfg is not None:
        problem = _check(cfg, cfg.trainer.n_gpus_per_node)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    print(run_dir_of(cfg))
    if not _spans_nodes(cfg) and not multinode:
        print(f"megarl: checked; {_would_start(cfg)}", file=sys.stderr)
    return 0


def _spans_nodes(cfg) -> bool:
    """The config places the run on several nodes (Slurm, or torchrun on every node)."""
    return cfg.trainer.nnodes > 1 or cfg.actor_rollout_ref.rollout.nnodes > 1


def _would_start(cfg) -> str:
    """What ``megarl train`` would start on this machine, in words."""
    from megarl.config.async_schedule import describe_overlap
    from megarl.config.batch_plan import rollout_ranks, teacher_ranks

    nproc, roll = cfg.trainer.n_gpus_per_node, cfg.actor_rollout_ref.rollout
    meg = cfg.actor_rollout_ref.actor.megatron
    training = (
        f"{nproc} training rank(s) (TP {meg.tensor_model_parallel_size} × PP "
        f"{meg.pipeline_model_parallel_size})"
    )
    extra = rollout_ranks(cfg)
    teacher = _describe_teacher(cfg)
    if not extra:
        where = f"{roll.name} TP {roll.tensor_model_parallel_size} in the training ranks"
        return (
            f"megarl train would start {nproc + teacher_ranks(cfg)} process(es) here: "
            f"{training}, {where}{teacher}"
        )
    off = describe_overlap(cfg)
    replicas = extra // roll.tensor_model_parallel_size
    return (
        f"megarl train would start {nproc + extra + teacher_ranks(cfg)} process(es) here: "
        f"{training}, then {extra} rollout rank(s) of vLLM's own ({replicas} replica(s) of TP "
        f"{roll.tensor_model_parallel_size}), {off}{teacher}"
    )


def _describe_teacher(cfg) -> str:
    """``, then N teacher rank(s) ...`` for a vLLM teacher on ranks of its own, else ``""``."""
    from megarl.config.batch_plan import teacher_ranks, teacher_tp
    from megarl.config.teachers import teachers

    ranks = teacher_ranks(cfg)
    if not ranks:
        return ""
    found = teachers(cfg)
    if len(found) > 1:
        each = ", ".join(f"{t.ranks} for {t.name}" for t in found)
        return f", then {ranks} teacher rank(s) of vLLM's own ({each})"
    tp = teacher_tp(cfg)
    return f", then {ranks} teacher rank(s) of vLLM's own ({ranks // tp} replica(s) of TP {tp})"


def _own_nodes(cfg) -> tuple[int, int]:
    """(the rollout's nodes of its own, the distillation teachers' nodes of their own)."""
    from megarl.config.batch_plan import teacher_ranks

    teacher = max(cfg.distillation.nnodes, 0) if teacher_ranks(cfg) else 0
    return max(cfg.actor_rollout_ref.rollout.nnodes, 0), teacher


def _nodes(configs: list[str], overrides: list[str]) -> tuple[int, int, int]:
    """(the launch's nodes: the training ones, then any of vLLM's own, then any of the
    distillation teachers'; those not training; the teachers')."""
    from megarl.config import load_config

    cfg = load_config(configs, overrides)
    rollout, teacher = _own_nodes(cfg)
    return cfg.trainer.nnodes + rollout + teacher, rollout + teacher, teacher


def _training_nodes(
    configs: list[str], overrides: list[str], nodes: int
) -> tuple[list[str], str | None]:
    """``--nodes N`` (the job's allocation): the overrides with ``trainer.nnodes`` = N less the
    rollout's own nodes, or the problem as one line."""
    cfg, problem = _load(configs, overrides, multinode=True)
    if cfg is None:
        return overrides, problem
    rollout, teacher = _own_nodes(cfg)
    if nodes - rollout - teacher < 1:
        return overrides, (
            f"--nodes {nodes}: the job's node(s) leave none for training after "
            f"actor_rollout_ref.rollout.nnodes={rollout}"
            + (f" and distillation.nnodes={teacher}" if teacher else "")
        )
    return [*overrides, f"trainer.nnodes={nodes - rollout - teacher}"], None


def preflight(
    configs: list[str], overrides: list[str], *, multinode: bool = False
) -> tuple[str | None, int, Path]:
    """(the first problem as one line or None, processes to launch per node, the run
    directory). ``multinode``: the Slurm job script's launch, ``trainer.nnodes`` nodes."""
    cfg, problem = _load(configs, overrides, multinode=multinode)
    if cfg is None:
        return problem, 0, Path()
    nproc = cfg.trainer.n_gpus_per_node
    return _check(cfg, nproc), nproc, run_dir_of(cfg)


def _load(configs: list[str], overrides: list[str], *, multinode: bool | None):
    """(the loaded config, None) or (None, the problem as one line). ``multinode`` None: as the
    config places the run (:func:`_spans_nodes`)."""
    from megarl.config import ConfigError, load_config

    try:
        cfg = load_config(configs, overrides)
    except ConfigError as exc:
        return None, _line(exc)
    if multinode is None:
        multinode = _spans_nodes(cfg)
    roll = cfg.actor_rollout_ref.rollout
    if not multinode and (cfg.trainer.nnodes > 1 or roll.nnodes > 1):
        key = "trainer.nnodes" if cfg.trainer.nnodes > 1 else "actor_rollout_ref.rollout.nnodes"
        value = cfg.trainer.nnodes if cfg.trainer.nnodes > 1 else roll.nnodes
        reason = (
            f"{key}={value}: a multi-node run is launched by Slurm "
            "(launch/*.slurm) or torchrun on every node, not by megarl train"
        )
        return None, reason
    from megarl.config.batch_plan import teacher_ranks

    per_node = cfg.trainer.n_gpus_per_node
    if teacher_ranks(cfg) and not multinode and cfg.distillation.nnodes > 1:
        return None, (
            f"distillation.nnodes={cfg.distillation.nnodes}: a teachers' pool on several nodes "
            "is launched by Slurm (launch/*.slurm) or torchrun on every node, not by megarl train"
        )
    if teacher_ranks(cfg) and multinode and cfg.distillation.n_gpus_per_node != per_node:
        return None, (
            f"distillation.n_gpus_per_node={cfg.distillation.n_gpus_per_node}: on several "
            f"nodes every node runs trainer.n_gpus_per_node={per_node} processes (torchrun), "
            "the teachers' nodes too"
        )
    if multinode and roll.nnodes > 0 and roll.n_gpus_per_node not in (None, per_node):
        return None, (
            f"actor_rollout_ref.rollout.n_gpus_per_node={roll.n_gpus_per_node}: on several "
            f"nodes every node runs trainer.n_gpus_per_node={per_node} processes (torchrun)"
        )
    return cfg, None


def _check(cfg, nproc: int) -> str | None:
    """The first problem of a loaded run as one line, or None."""
    from megarl.config import ConfigError, validate
    from megarl.reward.scorers import sandbox

    sandbox.configure(cfg.reward.code_sandbox)  # the ranks inherit it (reward.code_sandbox)
    try:
        validate(cfg, nproc * cfg.trainer.nnodes, check_paths=True)
    except ConfigError as exc:
        return _line(exc)
    from megarl.checkpoint.resume import resume_problem

    run_dir = run_dir_of(cfg)
    for check in (_check_numbers, _check_run_dir, _check_model_files):
        if (reason := check(cfg)) is not None:
            return reason
    if (reason := resume_problem(cfg, run_dir)) is not None:
        return reason
    return _check_data(cfg)


def run_dir_of(cfg) -> Path:
    """The run directory (``trainer.default_local_dir``), absolute."""
    return Path(cfg.trainer.default_local_dir).expanduser().resolve()


def _check_data(cfg) -> str | None:
    """Read and tokenise the prompt files as every rank will, then check that they make a
    global batch and that the reward function loads and scores their data sources."""
    from transformers import AutoTokenizer

    from megarl.data import PromptDataset
    from megarl.data.tokenizer import actor_tokenizer_path, image_options, trusts_remote_code
    from megarl.rollout.multi_turn_rollout import multi_turn_problem, prompt_tool_schemas

    model = cfg.actor_rollout_ref.model
    where = actor_tokenizer_path(cfg)
    key = "tokenizer_path" if model.tokenizer_path else "path"
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(where), trust_remote_code=trusts_remote_code(cfg)
        )
    except Exception as exc:  # noqa: BLE001 -- HF raises many kinds; one line names the key
        return f"actor_rollout_ref.model.{key}={where}: no usable tokenizer ({_line(exc)})"
    # tools and interactions load, the chat template renders their turns (not at step 1)
    if reason := multi_turn_problem(cfg, tokenizer, f"actor_rollout_ref.model.{key}={where}"):
        return reason
    splits = ["train"] + (["val"] if cfg.data.val_files else [])
    sources: set[str] = set()
    first = None
    for split in splits:
        try:
            tools = prompt_tool_schemas(cfg)
            dataset = PromptDataset.from_config(cfg.data, tokenizer, split, cfg.trainer.seed, tools,
                                                **image_options(cfg))  # fmt: skip
        except (ValueError, OSError) as exc:
            return _line(exc)
        except Exception as exc:  # noqa: BLE001 -- e.g. the chat template on a malformed message
            return f"data.{split}_files: {type(exc).__name__}: {_line(exc)}"
        rows = [dataset[i] for i in range(len(dataset))]
        sources.update(row.data_source for row in rows)
        first = first or dataset[0]
        if split == "train" and (reason := _routing_problem(cfg, rows)):
            return reason
        if dataset.blank_prompts:
            print(f"warning: {_blank_prompts(dataset, split)}", file=sys.stderr)
        if split == "train" and len(dataset) < cfg.data.train_batch_size:
            return (
                f"data.train_files: {len(dataset)} prompt(s) after filtering, fewer than one "
                f"global batch (data.train_batch_size={cfg.data.train_batch_size})"
            )
    return _check_reward(cfg, sources, first)


def _routing_problem(cfg, rows) -> str | None:
    """A training prompt whose ``distillation.teacher_key`` value no teacher's key names (the
    step would stop there), as one line."""
    if not cfg.distillation.enabled:
        return None
    from megarl.trainer.teacher import RoutingError, routes_of

    try:
        routes_of(cfg, rows)
    except RoutingError as exc:
        return str(exc)
    return None


def _sandbox_problem(cfg, source: str) -> str | None:
    """The refusal when ``source``'s programs would run and the machine cannot sandbox them."""
    from megarl.reward.scorers import sandbox

    try:
        sandbox.require_sandbox()
    except sandbox.SandboxError as exc:
        return f"data: data_source {source!r}: {exc}"
    return None


def _blank_prompts(dataset, split: str) -> str:
    """The warning for prompts without text, naming how many and the first rows."""
    blank, key = dataset.blank_prompts, f"data.{split}_files"
    rows: dict[str, list[str]] = {}  # file -> its first rows
    for where in blank[:5]:
        name, row = where.removeprefix(f"{key}: ").rsplit(" row ", 1)
        rows.setdefault(name, []).append(row)
    listed = "; ".join(f"{name} row(s) {', '.join(r)}" for name, r in rows.items())
    return (
        f"{key}: {len(blank)} of {len(dataset)} prompts are empty or whitespace only "
        f"({listed}{', ...' if len(blank) > 5 else ''}); they train as they are, as in verl"
    )


def _check_reward(cfg, sources: set[str], sample) -> str | None:
    """The reward function loads, takes verl's keywords, routes every ``data_source``, and
    returns a usable score for ``sample`` (the first training prompt)."""
    import inspect

    from megarl.reward.loader import RewardFunctionError, ScorerSpec, load_scorer
    from megarl.reward.scorers import UnsupportedDataSource, scorer_module_for

    spec = ScorerSpec.from_config(cfg.custom_reward_function, cfg)
    if spec.manager == "importlib":  # the user's reward manager class, before the function
        from megarl.reward.user_manager import manager_problem

        if (problem := manager_problem(spec)) is not None:
            return problem
    if spec.path is None:
        if cfg.reward_model.enable:
            return None
        for source in sorted(sources):
            try:
                module = scorer_module_for(source)
            except UnsupportedDataSource as exc:
                return f"data: {_line(exc)}"
            local = not cfg.reward.sandbox_fusion.url  # else the programs run on the service
            if module.endswith(".code") and local and (problem := _sandbox_problem(cfg, source)):
                return problem
        return None
    try:
        fn = load_scorer(spec)
    except RewardFunctionError as exc:  # names the key and file already
        return _line(exc)
    except Exception as exc:  # noqa: BLE001 -- the user's file: syntax, import, anything
        return f"custom_reward_function.path={spec.path}: cannot load it ({type(exc).__name__}: {_line(exc)})"
    prime = spec.manager == "prime"  # verl's prime manager calls it positionally
    try:
        signature = inspect.signature(fn)
        if prime:
            signature.bind("", "", None, None, **spec.reward_kwargs)
        else:
            signature.bind(
                data_source="", solution_str="", ground_truth=None, extra_info=None,
                **spec.reward_kwargs,
            )  # fmt: skip
    except (TypeError, ValueError) as exc:
        call = (
            "fn(data_source, solution_str, ground_truth, extra_info, " if prime
            else "fn(data_source=, solution_str=, ground_truth=, extra_info=, "
        )  # fmt: skip
        return (
            f"custom_reward_function.name={spec.name}: {spec.name}{signature} in {spec.path} "
            f"cannot be called as {call}**custom_reward_function.reward_kwargs) ({_line(exc)})"
        )
    return _check_sample_score(cfg, spec, sample)


def _check_sample_score(cfg, spec, sample) -> str | None:
    """Score an empty response to ``sample`` once, as a rank scores (a scoring worker, the
    time limit): a result of no usable type (None, a string) is named now rather than after
    start-up. A function that raises or times out on it passes: real responses differ."""
    from megarl.reward.pool import ScoringPool
    from megarl.reward.worker import BadResult

    task = (0, sample.data_source, "", sample.ground_truth, sample.extra_info)
    try:
        with ScoringPool(spec, 1, cfg.reward_model.compute_score_timeout) as pool:
            (outcome,) = pool.score([task])
    except RuntimeError:  # the worker did not start: the ranks' scoring pools will say why
        return None
    keys = cfg.algorithm.gdpo_reward_keys if cfg.algorithm.adv_estimator == "gdpo" else None
    if outcome.status == "ok" and keys:
        fields = outcome.fields or {}
        numeric = sorted(k for k, v in fields.items() if isinstance(v, int | float))
        missing = [k for k in keys if k not in numeric]
        if missing:  # the step's line (megarl.trainer.step.gdpo_components), before start-up
            return (
                f"algorithm.gdpo_reward_keys {missing}: not among the numeric fields "
                f"custom_reward_function.name={spec.name} in {spec.path} returns for "
                f"{sample.source} ({', '.join(numeric) or 'none: a plain score'}); return a "
                "dict with a number under each key"
            )
    bad = f"{BadResult.__name__}: "
    if outcome.status != "error" or not outcome.message.startswith(bad):
        return None
    return (
        f"custom_reward_function.name={spec.name} in {spec.path} "
        f"{outcome.message.removeprefix(bad)}, for an empty response to {sample.source} "
        f"(data_source {sample.data_source!r}); a score is a number or a bool (1.0/0.0), or a "
        "dict with one under 'score', as in verl"
    )


def _check_numbers(cfg) -> str | None:
    """Every float in the config is finite (``optim.lr=nan`` names its key)."""
    import dataclasses
    import math

    def walk(node, key: str) -> str | None:
        if dataclasses.is_dataclass(node):
            items = [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
        elif isinstance(node, dict):
            items = list(node.items())
        else:
            bad = isinstance(node, float) and not math.isfinite(node)
            return f"{key}={node}: not a finite number" if bad else None
        for name, value in items:
            if (found := walk(value, f"{key}.{name}" if key else str(name))) is not None:
                return found
        return None

    return walk(cfg, "")


def _check_run_dir(cfg) -> str | None:
    """The run directory can be created and written."""
    run_dir = run_dir_of(cfg)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"trainer.default_local_dir={run_dir}: cannot be created ({exc.strerror})"
    if not os.access(run_dir, os.W_OK | os.X_OK):
        return f"trainer.default_local_dir={run_dir}: not writable"
    return None


def _check_model_files(cfg) -> str | None:
    """Every local model's safetensors files have a readable header (a corrupt or truncated
    download is named here, not as "header too large" on every rank)."""
    from safetensors import safe_open

    paths = [("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path)]
    critic = getattr(getattr(cfg, "critic", None), "model", None)
    if getattr(critic, "path", None):
        paths.append(("critic.model.path", critic.path))
    for key, path in paths:
        folder = Path(str(path)).expanduser()
        for file in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
            try:
                with safe_open(str(file), "pt") as f:
                    f.keys()
            except Exception as exc:  # noqa: BLE001 -- safetensors raises its own error types
                return f"{key}={path}: {file.name} is unreadable ({_line(exc)})"
    return None


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
