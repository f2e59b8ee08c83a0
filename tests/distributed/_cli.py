"""The command line, run in the test's process (no interpreter start-up per call)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path


class CliRun(subprocess.CompletedProcess[str]):
    """A run of the installed command, with the top-level packages its process imported."""

    imported: frozenset[str] = frozenset()


def installed_cli(*args: str) -> CliRun:
    """``lightning-mcore-ckpt ARGS`` as the installed command, in a process of its own.

    ``imported``: the top-level packages the process imported (Python's ``-X importtime``,
    whose lines are taken out of ``stderr``), e.g. to check that a command that reads or
    writes a step imports no Lightning.
    """
    exe = Path(sys.executable).with_name("lightning-mcore-ckpt")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(exe), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    lines = done.stderr.splitlines(keepends=True)
    timed = [line for line in lines if line.startswith("import time:")]
    kept = "".join(line for line in lines if not line.startswith("import time:"))
    run = CliRun(done.args, done.returncode, done.stdout, kept)
    names = (line.rsplit("|", 1)[-1].strip() for line in timed)
    run.imported = frozenset(n.split(".")[0] for n in names if n != "imported package")
    return run


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``lightning-mcore-ckpt ARGS`` through ``cli.main``: exit code, stdout and stderr.

    ``verify --logits`` adapts its process to the CPU; on a machine with CUDA it runs as the
    installed command instead, so this process keeps the stock GPU code paths.
    """
    import torch

    if "--logits" in args and torch.cuda.is_available():
        return installed_cli(*args)
    from lightning_mcore_ckpt.cli.entry import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse's usage errors
            code = int(exit_.code or 0)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())
