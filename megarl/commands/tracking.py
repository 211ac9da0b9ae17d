"""``megarl tracking``: MLflow chores on a run directory.

    megarl tracking sync RUN_DIR [--tracking-uri URI]   upload what the server did not receive
    megarl tracking run-dir --config X.yaml [KEY=VALUE ...]   print the run directory of a config

``run-dir`` lets the launch scripts find where to write the stop file without repeating the
config logic in shell.
"""

from __future__ import annotations

import argparse
import sys

EXIT_ERROR = 1
EXIT_INPUT_ERROR = 2


def main(argv: list[str]) -> int:
    """Run ``megarl tracking ...``; returns the exit status (errors: one line, no traceback)."""
    parser = argparse.ArgumentParser(prog="megarl tracking", description=__doc__.split("\n")[0])
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    sync = actions.add_parser("sync", help="upload a run directory's metrics MLflow lacks")
    sync.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory")
    sync.add_argument("--tracking-uri", help="server to upload to (default: the run's own)")
    sync.add_argument("--timeout", type=int, default=30, help="seconds per request (default 30)")
    where = actions.add_parser("run-dir", help="print the run directory of a config")
    where.add_argument("-c", "--config", action="append", required=True, metavar="FILE")
    args, extras = parser.parse_known_args(argv)
    if args.action == "sync" and extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    from megarl.config import ConfigError
    from megarl.tracking.paths import TrackingError
    from megarl.tracking.sync import NotSyncable

    try:
        return _sync(args) if args.action == "sync" else _run_dir(args, extras)
    except (ConfigError, NotSyncable) as exc:  # the input: exit 2, as megarl's other commands
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    except (TrackingError, OSError) as exc:
        return _error(exc)
    except Exception as exc:
        if type(exc).__name__ != "MlflowException":  # a bug: keep its traceback
            raise
        return _error(exc)


def _error(exc: BaseException) -> int:
    text = " ".join(str(exc).split())
    print(f"error: {text[:500] or type(exc).__name__}", file=sys.stderr)
    return EXIT_ERROR


def _sync(args: argparse.Namespace) -> int:
    from megarl.tracking.sync import sync_run

    report = sync_run(args.run_dir, args.tracking_uri, timeout_s=args.timeout)
    print(f"synced {args.run_dir}: {report}")
    return 0


def _run_dir(args: argparse.Namespace, overrides: list[str]) -> int:
    from megarl.config import load_config
    from megarl.tracking.paths import run_dir_of

    print(run_dir_of(load_config(args.config, overrides)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
