"""The command line, run in the test's process (no interpreter start-up per call)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path


def installed_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``lightning-mcore-ckpt ARGS`` as the installed command, in a process of its own."""
    exe = Path(sys.executable).with_name("lightning-mcore-ckpt")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([str(exe), *args], capture_output=True, text=True, env=env, timeout=240)


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
