"""The ``lightning-mcore-ckpt`` command line: the parser, built from the command modules, and
the dispatch to the command a line names."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_mcore_ckpt._version import __version__
from lightning_mcore_ckpt.cli import check_resume, diff, fsck, huggingface, inspect, report
from lightning_mcore_ckpt.cli.failure import fail, naming
from lightning_mcore_ckpt.notices import known_notices_hidden

__all__ = ["build_parser", "main"]

_COMMANDS = (report, huggingface, diff, fsck, inspect, check_resume)
"""The command modules, in the order ``--help`` lists their commands; each one's
``add_parsers`` adds its commands, with the function that runs each as the ``handler`` default."""

_PATH_ARGUMENTS = ("dirpath", "path", "step", "step_dir", "reference")
"""The arguments that name a run or a step: an object store URL there is read through a local
view of it."""


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
    for module in _COMMANDS:
        module.add_parsers(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    # What the libraries underneath say about themselves stays out of the way while the
    # command runs (the filters are restored after: main also runs inside other programs).
    with known_notices_hidden(), naming(args.command):
        return _run(args, parser)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lightning_mcore_ckpt.storage import store_views

    # The paths as given (a URL, where the command then reads a local view): for its messages.
    args.given = {name: getattr(args, name) for name in _PATH_ARGUMENTS if hasattr(args, name)}
    try:  # a step or a dirpath in an object store: read through a local view of it
        store_views.open_url_arguments(args, _PATH_ARGUMENTS)
    except (ImportError, ValueError, OSError) as err:
        return fail(f"{args.command}: {err}")
    return args.handler(args, parser)  # type: ignore[no-any-return]


if __name__ == "__main__":
    sys.exit(main())
