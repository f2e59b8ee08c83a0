"""The ``lightning-mcore-ckpt`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_mcore_ckpt._version import __version__

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``lightning-mcore-ckpt``."""
    parser = argparse.ArgumentParser(
        prog="lightning-mcore-ckpt",
        description=(
            "Inspect and convert Megatron-Core distributed checkpoints written by "
            "lightning-mcore-ckpt."
        ),
    )
    parser.add_argument(
        "--version", action="version", version=f"lightning-mcore-ckpt {__version__}"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    report = commands.add_parser(
        "report",
        help="list a run's checkpoints: size, save times, throughput, parallel layout",
        description=(
            "Print a table of the complete steps of a MegatronCheckpoint directory (step, time "
            "of save, contents, size, training-blocked and total save time, throughput, "
            "parallel layout), then the steps that never committed."
        ),
    )
    report.add_argument("dirpath", help="the MegatronCheckpoint dirpath (holds global_step_<N>/)")
    report.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw save time and size against step into this image (needs matplotlib)",
    )
    return parser


def _report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lightning_mcore_ckpt import report

    if args.plot is not None and not Path(args.plot).expanduser().parent.is_dir():
        parser.error(f"--plot {args.plot}: the directory {Path(args.plot).parent} does not exist")
    try:
        result = report.collect(args.dirpath)
    except FileNotFoundError as err:
        parser.error(str(err))
    print(report.format_table(result))
    if args.plot is not None:
        try:
            report.plot(result, Path(args.plot).expanduser())
        except (RuntimeError, ValueError) as err:
            print(f"lightning-mcore-ckpt: error: {err}", file=sys.stderr)
            return 1
        print(f"plot written to {args.plot}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "report":
        return _report(args, parser)
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
