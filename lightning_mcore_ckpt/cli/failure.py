"""How a command reports what stops it: one line on stderr, ``lightning-mcore-ckpt: error: ...``,
and the exit code: 2 for bad usage or input (as argparse's own errors), 1 for work that failed."""

from __future__ import annotations

import sys

__all__ = ["fail"]


def fail(message: object, code: int = 2) -> int:
    """Print ``message`` as the command's error; ``code``, the exit code to return.

    Example: ``return fail(f"--chunk-mib: {value} is not a positive size")``.
    """
    print(f"lightning-mcore-ckpt: error: {message}", file=sys.stderr)
    return code
