"""The command line answers ``--help``, a usage error and a missing path before it imports
torch or Megatron-Core (seconds on their own): measured cold, in a fresh interpreter, by what
it imported and how long it took."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_PROBE = """
import contextlib, io, json, sys, time
started = time.perf_counter()
from lightning_mcore_ckpt.cli.entry import main
err = io.StringIO()
try:
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(json.loads(sys.argv[1]))
except SystemExit as exit_:
    code = exit_.code
heavy = sorted(m for m in ("torch", "megatron.core", "transformers", "lightning") if m in sys.modules)
print(json.dumps({"code": code, "heavy": heavy, "seconds": time.perf_counter() - started,
                  "stderr": err.getvalue()}))
"""

MISSING = "/nonexistent/run"
LINES = {
    "help": ["--help"],
    "no command arguments": ["ls"],
    "unknown option": ["report", "--nope"],
    "ls": ["ls", MISSING],
    "report": ["report", MISSING],
    "inspect": ["inspect", MISSING],
    "fsck": ["fsck", MISSING],
    "diff": ["diff", MISSING, MISSING],
    "export": ["export", MISSING, "--hf-model", MISSING, "--out", "/tmp/never"],
    "import": ["import", MISSING, "--out", "/tmp/never"],
    "verify": ["verify", MISSING],
    "check-resume": ["check-resume", "--config", "/nonexistent/job.yaml", "--stop-at", "1"],
}


@pytest.mark.parametrize("line", LINES, ids=list(LINES))
def test_an_answer_that_needs_no_checkpoint_imports_no_heavy_library(line: str) -> None:
    argv = LINES[line]
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argv)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == [], result
    assert result["seconds"] < 1.0, result  # cold, without torch: well under a second
    assert result["code"] == (0 if line == "help" else 2), result
    command = argv[0]
    if line not in ("help", "no command arguments", "unknown option"):
        # Each command names itself, and the path it could not find.
        assert f"error: {command}: " in result["stderr"] and "/nonexistent/" in result["stderr"]
