"""A question answered in a forked child process, so that what answering does (initialise CUDA,
enter namespaces) happens there and not in the asking process. No torch here."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

__all__ = ["ask_a_child"]


def ask_a_child(question: Callable[[], str]) -> tuple[bool, str]:
    """``question()`` called in a forked child process: whether it answered, and its answer (or
    what it raised, or ``""`` where the child died)."""
    read, write = os.pipe()
    with warnings.catch_warnings():
        # Python warns about forking a process with threads; the child only answers and exits.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child process
        code = 1
        try:
            os.close(read)
            try:
                text, code = question(), 0
            except BaseException as err:  # noqa: BLE001 - what stops it is the answer
                text = f"{type(err).__name__}: {err}"
            os.write(write, text.encode())
        finally:
            os._exit(code)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as answer:
            text = answer.read().decode()
    finally:
        _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0, text
