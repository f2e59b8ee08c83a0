"""``pip install lightning-mcore-ckpt`` next to the Megatron-Core users have.

Resolved by pip itself (``--dry-run --report``) against the wheel built from this checkout, in
this environment (megatron-core 0.19 on Python 3.12, or 0.16 on Python 3.11): installing must
keep the installed megatron-core, torch and transformers, and a fresh install must pick the
newest megatron-core this Python can run. Needs the package registry.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)


def _pip(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout + done.stderr


def _resolve(wheel: Path, report: Path, *args: str) -> dict[str, str]:
    _pip("install", "--dry-run", "--quiet", "--report", str(report), *args, str(wheel))
    found: dict[str, Any] = json.loads(report.read_text())
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in found["install"]}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy of what the wheel is made of: setuptools builds inside the source tree
    # (build/), and a test writes only under its temporary directories.
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    package = "lightning_mcore_ckpt"
    shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    said = _pip("wheel", "--no-deps", "--wheel-dir", str(out), str(src))
    (built,) = out.glob("lightning_mcore_ckpt-*.whl")
    (out / "build.log").write_text(said)
    return built


def test_the_wheel_declares_its_license_as_spdx_and_builds_without_a_deprecation(
    wheel: Path,
) -> None:
    import zipfile

    said = (wheel.parent / "build.log").read_text()
    assert "Deprecat" not in said and "BuildBackendWarning" not in said, said[-3000:]
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode()
        assert "License-Expression: Apache-2.0" in text
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in archive.namelist())


def _installed(name: str) -> str:
    from importlib import metadata

    return metadata.version(name)


def test_installing_keeps_the_installed_megatron_core(wheel: Path, tmp_path: Path) -> None:
    to_install = _resolve(wheel, tmp_path / "report.json")
    # Nothing but the package itself: megatron-core, torch, transformers and mbridge stay.
    assert set(to_install) <= {"lightning-mcore-ckpt"}, (
        f"installing next to megatron-core {_installed('megatron-core')} would change "
        f"{ {k: v for k, v in to_install.items() if k != 'lightning-mcore-ckpt'} }"
    )


def test_a_fresh_install_gets_the_newest_megatron_core_this_python_runs(
    wheel: Path, tmp_path: Path
) -> None:
    to_install = _resolve(wheel, tmp_path / "report.json", "--ignore-installed")
    version = to_install["megatron-core"]
    if sys.version_info >= (3, 12):
        assert version.startswith("0.19."), to_install
    else:
        # megatron-core 0.17 and newer need Python >= 3.12.
        assert version == "0.16.1", to_install
    assert to_install["mbridge"].startswith("0.15."), to_install


def test_an_image_pinning_the_oldest_supported_megatron_core_installs(
    wheel: Path, tmp_path: Path
) -> None:
    # A training image that pins megatron-core 0.16.1 (as a constraint) on any supported Python.
    pin = tmp_path / "image-constraints.txt"
    pin.write_text("megatron-core==0.16.1\n")
    to_install = _resolve(
        wheel, tmp_path / "report.json", "--ignore-installed", "--constraint", str(pin)
    )
    assert to_install["megatron-core"] == "0.16.1", to_install
