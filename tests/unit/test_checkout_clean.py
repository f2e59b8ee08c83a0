"""A test session that leaves a new file in the checkout fails, naming it (``tests/conftest.py``).

Real sessions: pytest runs in a real git checkout (under tmp_path) with this suite's
``tests/conftest.py``, and a test that writes into the checkout or does not. Files there before
the session (untracked, ignored, an environment, a log directory) are not counted; what the
session itself adds is, also inside an ignored directory that existed before; Python's and
pytest's caches are not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

LEAKY_TEST = """
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_writes_where_it_is_told() -> None:
    for name in filter(None, os.environ.get("LEAVE", "").split(",")):
        (ROOT / name).parent.mkdir(parents=True, exist_ok=True)
        (ROOT / name).write_text("left by a test")
"""


def _git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=repo,
        check=True,
        capture_output=True,
    )


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    if shutil.which("git") is None:
        pytest.skip("needs git")
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    shutil.copy(CONFTEST, repo / "tests" / "conftest.py")
    (repo / "tests" / "test_leaky.py").write_text(LEAKY_TEST)
    (repo / ".gitignore").write_text(".venv-py*/\nlightning_logs/\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "tests")
    # There before the session: an untracked file, an environment, an ignored log directory.
    (repo / "notes.txt").write_text("mine")
    (repo / ".venv-py3.12" / "bin").mkdir(parents=True)
    (repo / ".venv-py3.12" / "bin" / "python").write_text("")
    (repo / "lightning_logs" / "version_0").mkdir(parents=True)
    (repo / "lightning_logs" / "version_0" / "metrics.csv").write_text("old")
    return repo


def _session(
    repo: Path, leave: str, ci: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    outside_ci = ("PYTEST_ADDOPTS", "CI", "LMC_REQUIRE_OTHER")
    env = {k: v for k, v in os.environ.items() if k not in outside_ci}
    env.update(ci or {})
    env["LEAVE"] = leave
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "tests"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_a_session_that_leaves_nothing_passes(checkout: Path) -> None:
    done = _session(checkout, "")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "files left in the checkout" not in done.stdout
    # It did create caches (pytest's, Python's): those are not counted.
    assert (checkout / ".pytest_cache").exists()


@pytest.mark.parametrize(
    "leave",
    [
        "leaked.txt",  # untracked
        "lightning_logs/version_1/metrics.csv",  # in an ignored directory that existed before
        "checkpoints/global_step_2/metadata.json,unused/latest_checkpointed_iteration.txt",
    ],
)
def test_a_session_that_leaves_a_file_fails_naming_it(checkout: Path, leave: str) -> None:
    done = _session(checkout, leave)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 passed" in done.stdout  # the test itself passed: the session failed
    summary = done.stdout.split("files left in the checkout", 1)[1]
    names = leave.split(",")
    assert f"left {len(names)} new file(s)" in summary
    for name in names:
        assert f"  {name}\n" in summary
    for before in ("notes.txt", ".venv-py3.12", "version_0", "__pycache__", ".pytest_cache"):
        assert before not in summary


@pytest.mark.parametrize(
    "ci", [{}, {"CI": "true"}, {"LMC_REQUIRE_OTHER": "1"}], ids=["dev", "CI", "ci-run"]
)
def test_a_new_source_file_counts_only_under_ci(checkout: Path, ci: dict[str, str]) -> None:
    # While developing, a .py/.md file that appears during the run is an edit, not the tests'
    # output; under CI nobody edits the checkout, so it is the tests' and fails the session.
    done = _session(checkout, "written_by_a_test.py,docs/written.md", ci)
    if not ci:
        assert done.returncode == 0, done.stdout + done.stderr
        assert "files left in the checkout" not in done.stdout
        return
    assert done.returncode == 1, done.stdout + done.stderr
    summary = done.stdout.split("files left in the checkout", 1)[1]
    assert "left 2 new file(s)" in summary
    assert "  written_by_a_test.py\n" in summary and "  docs/written.md\n" in summary
