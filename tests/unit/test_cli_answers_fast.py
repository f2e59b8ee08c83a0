"""The command line answers ``--help``, a usage error and a missing path before it imports
torch or Megatron-Core (seconds on their own), and ``ls`` and ``report`` read a run without
them: measured cold, in a fresh interpreter, by what it imported and how long it took."""

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
err, out = io.StringIO(), io.StringIO()
try:
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(json.loads(sys.argv[1]))
except SystemExit as exit_:
    code = exit_.code
heavy = sorted(m for m in ("torch", "megatron.core", "transformers", "lightning") if m in sys.modules)
print(json.dumps({"code": code, "heavy": heavy, "seconds": time.perf_counter() - started,
                  "stderr": err.getvalue(), "stdout": out.getvalue()}))
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
RUN = Path(__file__).resolve().parents[1] / "compat" / "fixtures" / "cb01742" / "ckpt"
"""A run saved by an earlier version: one complete step, with its dist-checkpoint indexes."""


def _answer(argv: list[str]) -> dict[str, object]:
    """``lightning-mcore-ckpt`` run with ``argv`` in a fresh interpreter: its exit code, the
    heavy libraries it imported, how long it took, what it printed."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argv)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("line", LINES, ids=list(LINES))
def test_an_answer_that_needs_no_checkpoint_imports_no_heavy_library(line: str) -> None:
    argv = LINES[line]
    result = _answer(argv)
    # No torch, Megatron-Core, Lightning or transformers: what makes it answer in well under a
    # second (0.1-0.2 s measured; time is a benchmark's figure, not a test's).
    assert result["heavy"] == [], result
    assert result["code"] == (0 if line == "help" else 2), result
    command = argv[0]
    if line not in ("help", "no command arguments", "unknown option"):
        # Each command names itself, and the path it could not find.
        assert f"error: {command}: " in result["stderr"] and "/nonexistent/" in result["stderr"]


@pytest.mark.parametrize("command", ["ls", "report"])
def test_ls_and_report_read_a_run_without_importing_a_heavy_library(command: str) -> None:
    # Each step's indexes are read (is it whole?) without torch: the answer takes a fraction
    # of a second, where importing torch alone takes one or more.
    result = _answer([command, str(RUN)])
    assert result["code"] == 0 and result["stderr"] == "", result
    said = str(result["stdout"])
    assert f"{RUN}: 1 complete step(s)" in said and "DAMAGED" not in said, said
    assert result["heavy"] == [], result


def test_inspect_reads_the_installed_versions_without_importing_the_libraries() -> None:
    probe = (
        "import json, sys; from lightning_mcore_ckpt import _compat; "
        "found = _compat.installed_versions(); "
        "heavy = [m for m in ('torch', 'megatron.core', 'lightning') if m in sys.modules]; "
        "print(json.dumps([found, heavy]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    found, heavy = json.loads(out.stdout)
    assert heavy == []
    from packaging.version import Version

    from lightning_mcore_ckpt import _compat

    imported = _compat.versions()  # read from the modules, as a save records them
    for key in ("torch", "lightning", "megatron_core", "lightning_mcore_ckpt"):
        assert Version(found[key]).public == Version(imported[key]).public, key
