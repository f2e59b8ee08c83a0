"""The suite's own hygiene (tests/conftest.py): a session that leaves a file in the checkout
fails, naming it, with or without pytest-xdist; temporary files go under pytest's base
temporary directory, in the test process and in every process it starts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

# Where a test of the inner session writes: under its tmp_path (allowed), in the checkout
# (untracked), or in a directory of the checkout that .gitignore ignores (a build output).
WRITES = {
    "tmp_path": "tmp_path / 'out.bin'",
    "checkout": "Path(__file__).parents[1] / 'left.bin'",
    "ignored_dir": "Path(__file__).parents[1] / 'build' / 'out.bin'",
}
LEFT = {"tmp_path": None, "checkout": "left.bin", "ignored_dir": "build/out.bin"}


def _checkout(root: Path, writes: str) -> None:
    """A git checkout holding the suite's conftest.py and one test that writes a file."""
    (root / "tests").mkdir(parents=True)
    shutil.copy(CONFTEST, root / "tests" / "conftest.py")
    (root / "tests" / "test_writes.py").write_text(
        "from pathlib import Path\n\n\n"
        "def test_writes(tmp_path):\n"
        f"    target = {WRITES[writes]}\n"
        "    target.parent.mkdir(exist_ok=True)\n"
        "    target.write_bytes(b'x')\n\n\n"
        "def test_other():\n"
        "    pass\n"
    )
    (root / ".gitignore").write_text("build/\n")
    (root / "build").mkdir()
    (root / "build" / "there-before.bin").write_bytes(b"x")  # not counted: there before
    subprocess.run(["git", "init", "-q", str(root)], check=True, timeout=60)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("writes", list(WRITES))
def test_a_session_that_leaves_a_file_in_the_checkout_fails(
    tmp_path: Path, writes: str, workers: int
) -> None:
    if workers:
        pytest.importorskip("xdist")
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = tmp_path / "repo"
    _checkout(root, writes)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "CI"))}
    env.pop("LMC_REQUIRE_OTHER", None)
    command = [sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider"]
    command += ["--basetemp", str(tmp_path / "basetemp")]
    command += ["-n", str(workers)] if workers else ["-p", "no:xdist"]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert "2 passed" in output, output
    left = LEFT[writes]
    if left is None:
        assert done.returncode == 0, output
        assert "files left in the checkout" not in output, output
    else:
        assert done.returncode == pytest.ExitCode.TESTS_FAILED, output
        assert "files left in the checkout" in output, output
        assert f"  {left}\n" in done.stdout, output
        assert "there-before.bin" not in output, output


def test_temporary_files_go_under_the_base_temporary_directory(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    base = tmp_path_factory.getbasetemp().resolve()
    here = Path(tempfile.gettempdir()).resolve()
    assert here.is_relative_to(base), (here, base)
    assert Path(os.environ["TMPDIR"]).resolve() == here
    child = subprocess.run(
        [sys.executable, "-c", "import tempfile; print(tempfile.mkdtemp(prefix='lmc-'))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    made = Path(child.stdout.strip()).resolve()
    assert made.parent == here and made.is_dir()
