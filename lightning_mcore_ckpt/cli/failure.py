"""How a command reports what stops it: one line on stderr, ``lightning-mcore-ckpt: error: ...``,
and the exit code: 2 for bad usage or input (as argparse's own errors), 1 for work that failed."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

__all__ = ["fail", "missing", "naming"]

_command: list[str] = []
"""The command running (``naming``): its errors start with its name."""


@contextlib.contextmanager
def naming(command: str) -> Iterator[None]:
    """While a command runs, each of its errors (:func:`fail`) starts with its name."""
    _command.append(command)
    try:
        yield
    finally:
        _command.pop()


def fail(message: object, code: int = 2) -> int:
    """Print ``message`` as the command's error; ``code``, the exit code to return.

    Example: ``return fail(f"--chunk-mib: {value} is not a positive size")``.
    """
    text = str(message)
    if _command and not text.startswith(f"{_command[-1]}:"):
        text = f"{_command[-1]}: {text}"
    print(f"lightning-mcore-ckpt: error: {text}", file=sys.stderr)
    return code


def missing(command: str, *paths: tuple[str, str | None]) -> int | None:
    """The error of ``command`` for the first of ``paths`` (``(what, path)``; ``None``: not
    given) that does not exist, or ``None`` when every one does. Checked before anything heavy
    is imported, so that a mistyped path answers at once.

    Example: ``if (code := missing("export", ("STEP_DIR", args.step_dir))) is not None: ...``.
    """
    for what, path in paths:
        if path is not None and not os.path.exists(os.path.expanduser(path)):
            return fail(f"{command}: {what} {path!r}: no such file or directory")
    return None
