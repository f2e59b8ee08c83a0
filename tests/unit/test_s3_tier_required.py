"""The object-storage tier skips without boto3 or moto only outside CI; under CI it fails.

The rule (``tests/storage/_s3_required.py``) for every environment that names CI, and real pytest
sessions of a storage test module with boto3 or moto made unimportable, under CI and not.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _s3_required import import_or_skip, required_by

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("environ", "why"),
    [
        ({}, None),
        ({"CI": "true"}, "CI=true"),
        ({"CI": "1"}, "CI=1"),
        ({"CI": "True"}, "CI=True"),
        ({"CI": "false"}, None),
        ({"CI": ""}, None),
        ({"LMC_REQUIRE_S3": "1"}, "LMC_REQUIRE_S3=1"),
        ({"LMC_REQUIRE_S3": "0"}, None),
        ({"LMC_REQUIRE_OTHER": "1"}, "LMC_REQUIRE_OTHER=1 (.ci/run)"),
        ({"CI": "false", "LMC_REQUIRE_OTHER": "1"}, "LMC_REQUIRE_OTHER=1 (.ci/run)"),
    ],
)
def test_which_environments_require_the_tier(environ: dict[str, str], why: str | None) -> None:
    assert required_by(environ) == why


def test_a_failed_import_skips_outside_ci_and_fails_under_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 raises ImportError
    with pytest.raises(pytest.skip.Exception, match=r"could not import 'boto3'"):
        import_or_skip("boto3", {})
    with pytest.raises((pytest.fail.Exception, pytest.skip.Exception)) as failed:
        import_or_skip("boto3", {"CI": "true"})
    assert failed.type is pytest.fail.Exception  # not a skip
    assert "boto3 (ModuleNotFoundError" in str(failed.value) and "CI=true" in str(failed.value)
    assert "pip install -e '.[s3,dev]'" in str(failed.value)
    assert import_or_skip("json", {"CI": "true"}) is sys.modules["json"]


@pytest.mark.parametrize("broken", ["boto3", "moto"])
@pytest.mark.parametrize("ci", [False, True], ids=["developer", "ci"])
def test_a_storage_module_under_ci_fails_when_boto3_or_moto_cannot_be_imported(
    tmp_path: Path, broken: str, ci: bool
) -> None:
    # Not installed, as a real pytest session sees it: a module of that name first on the path
    # that raises what a missing module raises.
    missing = f"No module named {broken!r} (injected)"
    (tmp_path / f"{broken}.py").write_text(f"raise ModuleNotFoundError({missing!r})\n")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CI", "LMC_REQUIRE_S3", "LMC_REQUIRE_OTHER", "PYTEST_ADDOPTS")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    if ci:
        env["CI"] = "true"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "tests/storage/test_s3server.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = done.stdout + done.stderr
    if ci:
        # A collection error: the session stops, failed.
        assert done.returncode == pytest.ExitCode.INTERRUPTED, out
        assert "the object-storage tests cannot run" in out, out
        assert f"{broken} (ModuleNotFoundError: {missing})" in out, out
        assert "CI=true" in out and "passed" not in out, out
    else:
        assert done.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, out  # all skipped
        assert "1 skipped" in out and f"could not import '{broken}'" in out, out
