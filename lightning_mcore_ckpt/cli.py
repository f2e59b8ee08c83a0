"""The ``lightning-mcore-ckpt`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

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
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
