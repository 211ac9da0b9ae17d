"""The ``megarl`` command.

    megarl train --config X.yaml [key.sub=value ...]
    megarl config show --config X.yaml [overrides]         print the resolved YAML
    megarl config validate --config X.yaml [--world-size N] [overrides]
    megarl config keys [PREFIX]                            every key with its default and doc
    megarl convert ...                                     HF <-> Megatron checkpoints
    megarl plan ...                                        memory and resharding plans

A configuration problem prints one ``error: ...`` paragraph and exits with status 2, without a
traceback. Heavy modules (torch, Megatron, vLLM) are imported only by the subcommand that needs
them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from megarl.config import ConfigError, MegarlConfig, load_config, to_yaml, validate

EXIT_CONFIG_ERROR = 2


def _convert(argv: list[str]) -> int:
    from megarl.commands import convert

    return convert.main(argv)


def _plan(argv: list[str]) -> int:
    from megarl.commands import plan

    return plan.main(argv)


def _data(argv: list[str]) -> int:
    from megarl.commands import data

    return data.main(argv)


def _train(argv: list[str]) -> int:
    from megarl.commands import train

    return train.main(argv)


def _tracking(argv: list[str]) -> int:
    from megarl.commands import tracking

    return tracking.main(argv)


# Subcommands with parsers of their own: argv after the name goes to their ``main(argv)``. Each
# is imported only when called (convert and plan pull in torch and Megatron).
FORWARDED: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "train": (_train, "check a config and run the trainer (megarl train -c FILE --help)"),
    "convert": (_convert, "convert checkpoints between HF and Megatron formats"),
    "plan": (_plan, "memory per GPU for a config; `plan reshard`: how weights move to vLLM"),
    "data": (_data, "make synthetic prompt data (megarl data synth)"),
    "tracking": (_tracking, "tracking utilities (megarl tracking sync RUN_DIR)"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``megarl`` command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in FORWARDED:
        result = FORWARDED[argv[0]][0](argv[1:])
        return result if isinstance(result, int) else 0
    parser = build_parser()
    # Overrides are the arguments argparse does not know; they may come before or after options.
    args, extras = parser.parse_known_args(argv)
    unknown = [a for a in extras if a.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if hasattr(args, "overrides"):
        args.overrides = extras
    try:
        return args.handler(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megarl",
        description="Megatron-Core RL post-training (PPO, GRPO and family) with verl's config keys.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    config = commands.add_parser("config", help="show, validate or list configuration keys")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_commands.add_parser("show", help="print the resolved config as YAML")
    _add_config_args(show, required=False)
    show.set_defaults(handler=_show)
    check = config_commands.add_parser("validate", help="check a config before launching it")
    _add_config_args(check, required=False)  # no file: verl's defaults plus the overrides
    check.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="processes the job will run with (default: trainer.nnodes × n_gpus_per_node)",
    )
    check.set_defaults(handler=_validate)
    keys = config_commands.add_parser("keys", help="list every key with its default and meaning")
    keys.add_argument("prefix", nargs="?", default="", help="only keys starting with this")
    keys.set_defaults(handler=_keys)

    for name, (_, help_text) in FORWARDED.items():
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


def _add_config_args(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument(
        "-c",
        "--config",
        action="append",
        required=required,
        default=[],
        metavar="FILE",
        help="YAML config (repeatable: later files override earlier ones)",
    )
    parser.set_defaults(overrides=[])
    parser.usage = f"{parser.prog} [-c FILE ...] [KEY=VALUE ...]"
    parser.epilog = (
        "KEY=VALUE: dotted overrides applied after the files, e.g. data.train_batch_size=64, "
        "trainer.logger=[console,mlflow], critic.enable=null; +a.b.new=1 adds a key to a "
        "free-form section; ~a.b removes a key."
    )


def _load(args: argparse.Namespace) -> MegarlConfig:
    return load_config(args.config, args.overrides)


def _show(args: argparse.Namespace) -> int:
    sys.stdout.write(to_yaml(_load(args)))
    return 0


def _validate(args: argparse.Namespace) -> int:
    from megarl.planner import memory_warnings

    cfg = _load(args)
    warnings = validate(cfg, args.world_size)
    warnings += memory_warnings(cfg, args.world_size)
    _print_warnings(warnings)
    what = " + ".join(args.config) or "the defaults with these overrides"
    print(f"ok: {what} is valid. {_summary(cfg, args.world_size)}")
    return 0


def _keys(args: argparse.Namespace) -> int:
    import yaml

    from megarl.config.keys import field_docs, iter_fields
    from megarl.config.loader import get_key, resolve_config

    defaults = resolve_config(MegarlConfig())
    for key, field, owner in iter_fields(MegarlConfig):
        if key.startswith(args.prefix):
            value = get_key(defaults, key)
            default = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...")
            default = " ".join(default.split()) if len(default) < 60 else "..."
            print(f"{key} = {default}\n    {field_docs(owner).get(field.name, '')}")
    return 0


def _print_warnings(warnings: list[str]) -> None:
    for message in warnings:
        print(f"warning: {message}", file=sys.stderr)


def _summary(cfg: MegarlConfig, world_size: int | None) -> str:
    from megarl.config import BatchPlan, critic_enabled, ref_used
    from megarl.config import world_size as configured_world

    world = world_size or configured_world(cfg)
    lay = cfg.actor_rollout_ref.actor.megatron.parallel_layout()
    plan = BatchPlan.from_config(cfg, world)  # validated: no error left
    micro = plan.micro_batches_per_mini_batch
    experts = ""
    if lay.ep > 1:
        expert_dp = lay.expert_data_parallel_size(world)
        experts = f", experts EP {lay.ep} × ETP {lay.etp} → expert DP {expert_dp}"
    return (
        f"world {world} = {cfg.trainer.nnodes} node(s) × {cfg.trainer.n_gpus_per_node}; "
        f"training TP {lay.tp} × PP {lay.pp} × CP {lay.cp} → DP {plan.data_parallel_size}{experts}; "
        f"rollout TP {cfg.actor_rollout_ref.rollout.tensor_model_parallel_size} → "
        f"{plan.rollout_data_parallel_size} vLLM engine(s); {plan.responses_per_step} responses "
        f"per step in {plan.mini_batches_per_step} mini-batch(es) of "
        f"{plan.responses_per_mini_batch}, {plan.responses_per_rank_per_mini_batch} per rank in "
        f"{'token-budget' if micro is None else micro} micro-batch(es); "
        f"{cfg.algorithm.adv_estimator}, critic {'on' if critic_enabled(cfg) else 'off'}, "
        f"reference {'on' if ref_used(cfg) else 'off'}."
    )


def entry() -> None:
    """The ``megarl`` console script: :func:`main`, then a fast exit."""
    from megarl.parallel.fast_exit import exit_process

    exit_process(main())


if __name__ == "__main__":
    entry()
