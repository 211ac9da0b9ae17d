"""The ``megarl`` command.

    megarl train --config X.yaml [key.sub=value ...]
    megarl config show --config X.yaml [overrides]         print the resolved YAML
    megarl config validate --config X.yaml [--world-size N] [overrides]
    megarl config keys [PREFIX]                            every key with its default and doc
    megarl convert ...                                     HF <-> Megatron checkpoints
    megarl plan ...                                        rollout/resharding plans

A configuration problem prints one ``error: ...`` paragraph and exits with status 2, without a
traceback. Heavy modules (torch, Megatron, vLLM) are imported only by the subcommand that needs
them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence

from megarl.config import ConfigError, MegarlConfig, layout, load_config, to_yaml, validate

EXIT_CONFIG_ERROR = 2
EXIT_UNAVAILABLE = 1

# Subcommands handled by other packages: argv after the name is passed to ``module.main(argv)``.
FORWARDED = {
    "convert": ("megarl.models.convert", "convert checkpoints between HF and Megatron formats"),
    "plan": ("megarl.rollout.plan_cli", "show how weights move between training and rollout"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``megarl`` command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in FORWARDED:
        return _forward(argv[0], argv[1:])
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

    train = commands.add_parser("train", help="validate a config and run the trainer")
    _add_config_args(train, required=True)
    train.set_defaults(handler=_train)

    config = commands.add_parser("config", help="show, validate or list configuration keys")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_commands.add_parser("show", help="print the resolved config as YAML")
    _add_config_args(show, required=False)
    show.set_defaults(handler=_show)
    check = config_commands.add_parser("validate", help="check a config before launching it")
    _add_config_args(check, required=True)
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
    cfg = _load(args)
    warnings = validate(cfg, args.world_size)
    _print_warnings(warnings)
    print(f"ok: {' + '.join(args.config)} is valid. {_summary(cfg, args.world_size)}")
    return 0


def _train(args: argparse.Namespace) -> int:
    cfg = _load(args)
    world_size = int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE") else None
    warnings = validate(cfg, world_size, check_paths=True)
    if os.environ.get("RANK", "0") == "0":
        _print_warnings(warnings)
    try:
        trainer = importlib.import_module("megarl.trainer")
    except ModuleNotFoundError as exc:
        if exc.name != "megarl.trainer":
            raise
        trainer = None
    run: Callable | None = getattr(trainer, "main", None)
    if run is None:
        print(
            "error: the trainer is not implemented yet (megarl.trainer.main is missing); the "
            "configuration is valid",
            file=sys.stderr,
        )
        return EXIT_UNAVAILABLE
    result = run(cfg)
    return result if isinstance(result, int) else 0


def _keys(args: argparse.Namespace) -> int:
    import yaml

    from megarl.config.loader import get_key
    from megarl.config.schema import field_docs, iter_fields

    defaults = MegarlConfig()
    for key, field, owner in iter_fields(MegarlConfig):
        if key.startswith(args.prefix):
            value = get_key(defaults, key)
            default = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...")
            default = " ".join(default.split()) if len(default) < 60 else "..."
            print(f"{key} = {default}\n    {field_docs(owner).get(field.name, '')}")
    return 0


def _forward(name: str, argv: list[str]) -> int:
    module_name = FORWARDED[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module_name.startswith(exc.name):
            raise
        module = None
    run = getattr(module, "main", None)
    if run is None:
        print(
            f"error: 'megarl {name}' is not available yet ({module_name}.main is missing)",
            file=sys.stderr,
        )
        return EXIT_UNAVAILABLE
    result = run(argv)
    return result if isinstance(result, int) else 0


def _print_warnings(warnings: list[str]) -> None:
    for message in warnings:
        print(f"warning: {message}", file=sys.stderr)


def _summary(cfg: MegarlConfig, world_size: int | None) -> str:
    lay = layout(cfg, world_size)
    meg = cfg.actor_rollout_ref.actor.megatron
    roll = cfg.actor_rollout_ref.rollout
    from megarl.config import critic_enabled, ref_used

    return (
        f"world {lay.world_size} = {cfg.trainer.nnodes} node(s) × {cfg.trainer.n_gpus_per_node}; "
        f"training TP {meg.tensor_model_parallel_size} × PP {meg.pipeline_model_parallel_size}"
        f" × CP {meg.context_parallel_size} → DP {lay.data_parallel_size}; rollout TP "
        f"{roll.tensor_model_parallel_size} → {lay.rollout_data_parallel_size} vLLM engine(s); "
        f"{cfg.algorithm.adv_estimator}, critic {'on' if critic_enabled(cfg) else 'off'}, "
        f"reference {'on' if ref_used(cfg) else 'off'}."
    )


if __name__ == "__main__":
    sys.exit(main())
