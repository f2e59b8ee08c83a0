from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

# Rank functions import helpers that live next to the tests (e.g. tests/distributed/_trainer.py).
_HERE = os.path.dirname(__file__)
_HELPERS = [
    os.path.join(_HERE, d)
    for d in ("distributed", "faults", "compat", "resume", "export", "storage")
]
sys.path[:0] = _HELPERS
os.environ["PYTHONPATH"] = os.pathsep.join([*_HELPERS, os.environ.get("PYTHONPATH", "")])
os.environ.setdefault("WANDB_MODE", "offline")
# One intra-op thread per process, as torchrun gives each of several ranks: the suite runs many
# small processes at once (ranks, writers, CLI runs) on few cores, where torch's default (a
# thread per core in every process) spends half the CPU time spinning in OpenMP barriers.
# Inherited by every process a test starts; a test can still set its own.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# --- a session leaves nothing in the checkout ----------------------------------------------
# Tests write under their tmp_path. A file that a session adds to the repository (untracked or
# ignored, and not there when it started) fails the run, named in the summary. Not counted:
# Python's and the tools' caches, the environments, and new .py/.md files (an edit made while
# the suite ran, not a test's output) except under CI (``CI`` set, or ``.ci/run``'s
# ``LMC_REQUIRE_OTHER=1``), where nobody edits the checkout during the run. Not checked where
# the tests are not a git checkout's.

_ROOT = Path(_HERE).resolve().parent
_NOT_COUNTED_DIRS = (
    "__pycache__",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    ".import_linter_cache",
    ".grimp_cache",
    ".hypothesis",
)
_SOURCES = (".py", ".md")
_ALL_UNTRACKED = ("--untracked-files=all", "--ignored")  # every file, also in ignored dirs
_BEFORE = pytest.StashKey[set[tuple[str, str]]]()
_LEFT = pytest.StashKey[list[str]]()


def checkout_files(root: Path) -> set[tuple[str, str]] | None:
    """The untracked (``??``) and ignored (``!!``) files of the git checkout ``root``, as
    ``(status, path)``; ``None`` where ``root`` is not the top of a git checkout."""
    try:
        top = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--show-toplevel"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root.resolve():
            return None
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain=v1", "-z", *_ALL_UNTRACKED],
            capture_output=True,
            check=True,
            timeout=300,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    entries = status.stdout.decode("utf-8", "surrogateescape").split("\0")
    return {(e[:2], e[3:]) for e in entries if e[:2] in ("??", "!!")}


def _under_ci() -> bool:
    ci = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")
    return ci or os.environ.get("LMC_REQUIRE_OTHER") == "1"


def left_behind(before: set[tuple[str, str]], after: set[tuple[str, str]]) -> list[str]:
    """The files in ``after`` and not in ``before`` that count (see above), sorted."""
    sources_count = _under_ci()
    before_paths = {path for _, path in before}
    left = []
    for status, path in after:
        parts = path.split("/")
        if path in before_paths or any(p in _NOT_COUNTED_DIRS for p in parts):
            continue
        if parts[0].startswith(".venv") or any(p.endswith(".egg-info") for p in parts):
            continue
        if status == "??" and path.endswith(_SOURCES) and not sources_count:
            continue
        left.append(path)
    return sorted(left)


def _temporary_files_under_basetemp(config: pytest.Config) -> None:
    """Point ``TMPDIR`` (and ``tempfile``) of this process and every process it starts at a
    directory under pytest's base temporary directory, which pytest removes in turn with the
    tmp_path directories of old runs. What the package writes to the temporary directory when
    no path is given (an S3 dirpath's local tier ``lightning-mcore-ckpt/<bucket>``, the
    ``lmc-view-*`` of an ``s3://`` step, the ``lmc-export-*`` of an export to a URL, a resume
    check's ``resume-check-*``) stays with the run's tmp_path directories then, not in ``/tmp``.

    Set before collection: the example tests copy the environment when they are imported. Not
    where the directory's path is long: the forkserver's socket lives under it (``pymp-*/
    listener-*``), and a Unix socket's path has at most 107 bytes."""
    factory = config._tmp_path_factory  # type: ignore[attr-defined]  # what tmp_path uses
    tmp = factory.getbasetemp() / "TMPDIR"
    if len(str(tmp)) > 64:
        return
    tmp.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = str(tmp)


def pytest_sessionstart(session: pytest.Session) -> None:
    _temporary_files_under_basetemp(session.config)
    if not hasattr(session.config, "workerinput"):  # pytest-xdist: the controller checks
        before = checkout_files(_ROOT)
        if before is not None:
            session.config.stash[_BEFORE] = before


def _remove_multiprocessing_temp_dir() -> None:
    """Run multiprocessing's own finalizer of this process's ``pymp-*`` directory now. It lies
    under ``TMPDIR`` (see above), which pytest removes with the base temporary directory at the
    end of a passing session (``tmp_path_retention_policy = "failed"``): removed at the
    interpreter's exit instead, it would be missing, and the finalizer's error printed."""
    from multiprocessing import util

    registry = getattr(util, "_finalizer_registry", {})
    for finalizer in list(registry.values()):
        if getattr(finalizer, "_callback", None) is getattr(util, "_remove_temp_dir", None):
            finalizer()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _remove_multiprocessing_temp_dir()
    before = session.config.stash.get(_BEFORE, None)
    after = checkout_files(_ROOT) if before is not None else None
    if before is None or after is None:
        return
    left = left_behind(before, after)
    if left:
        session.config.stash[_LEFT] = left
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    left = config.stash.get(_LEFT, None)
    if left:
        terminalreporter.section("files left in the checkout", red=True)
        terminalreporter.write_line(
            f"FAILED: the tests left {len(left)} new file(s) in {_ROOT}; a test writes under its "
            "tmp_path (a Trainer: default_root_dir=tmp_path, or logger=False):"
        )
        for path in left[:100]:
            terminalreporter.write_line(f"  {path}")
        if len(left) > 100:
            terminalreporter.write_line(f"  ... and {len(left) - 100} more")


# --- the longest files first ----------------------------------------------------------------
# scripts/test.sh runs three files at a time (pytest-xdist, --dist loadfile), handing out files
# in the order they are collected. A long file started last keeps one worker busy while the
# others have nothing left: the longest files go first (longest-processing-time order), the rest
# in their usual order. Measured as CI runs the 3.12 tier (its extended node cells included),
# each file's tests' wall time summed, 2026-11-30: the silent-node file (346 s: each cell waits
# out a 30 s process-group timeout) was handed out late in collection order, within the last
# ~6 minutes of a 12:44 run; then the resume matrix (155 s), S3 (96 s) and the rest below. The
# order changes no test's outcome.
_LONGEST_FIRST = (
    "tests/nodes/test_silent_node.py",
    "tests/resume/test_matrix.py",
    "tests/storage/test_s3_checkpoints.py",
    "tests/nodes/test_shared_filesystem.py",
    "tests/nodes/test_fast_tier.py",
    "tests/resume/test_moe_matrix.py",
    "tests/resume/test_fast_tier_matrix.py",
    "tests/distributed/test_lightning_parity.py",
    "tests/faults/test_failing_runs.py",
    "tests/examples/test_check_resume_examples.py",
    "tests/nodes/test_store_without_shared_fs.py",
    "tests/crossversion/test_cross_version.py",
    "tests/export/test_hf_heads.py",
    "tests/examples/test_examples.py",
    "tests/faults/test_crash_and_errors.py",
    "tests/resume/test_check_resume.py",
    "tests/examples/test_benchmarks.py",
    "tests/faults/test_agreement_matrix.py",
    "tests/faults/test_preemption.py",
    "tests/distributed/test_hf.py",
    "tests/unit/test_roll_call.py",
    "tests/faults/test_power_loss.py",
    "tests/nodes/test_run_nodes.py",
    "tests/nodes/test_check_resume_wipe_node.py",
    "tests/examples/test_demo.py",
    "tests/nodes/test_node_count_resume.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(_LONGEST_FIRST)}

    def order(item: pytest.Item) -> int:
        path = Path(str(item.path)).resolve()
        try:
            relative = path.relative_to(_ROOT).as_posix()
        except ValueError:
            return len(rank)
        return rank.get(relative, len(rank))

    items.sort(key=order)  # stable: within a file and among the others, the usual order
    # More simulated-node cells than the quick tier runs: when asked for by marker, or in CI
    # (LMC_NODES_EXTENDED=1, which .ci/run sets).
    asked = "nodes_extended" in (config.option.markexpr or "")
    if not asked and os.environ.get("LMC_NODES_EXTENDED") != "1":
        outside = pytest.mark.skip(reason="more simulated-node cells: run with -m nodes_extended")
        for item in items:
            if item.get_closest_marker("nodes_extended") is not None:
                item.add_marker(outside)
