"""The installed package: silent import, console script, version."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import lightning_mcore_ckpt
from lightning_mcore_ckpt import cli


def test_import_prints_nothing_without_cuda() -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="always")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import lightning_mcore_ckpt; print(lightning_mcore_ckpt.__version__)",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0
    assert result.stderr == ""
    assert result.stdout.strip() == lightning_mcore_ckpt.__version__


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert (
        capsys.readouterr().out.strip()
        == f"lightning-mcore-ckpt {lightning_mcore_ckpt.__version__}"
    )


def test_console_script_help() -> None:
    exe = os.path.join(os.path.dirname(sys.executable), "lightning-mcore-ckpt")
    result = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "usage: lightning-mcore-ckpt" in result.stdout


def test_unknown_public_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        lightning_mcore_ckpt.Nope  # noqa: B018


def test_the_checkpoint_engine_does_not_import_the_lightning_side() -> None:
    import ast
    from pathlib import Path

    engine = Path(lightning_mcore_ckpt.__file__).parent / "engine"
    forbidden = (
        "lightning_mcore_ckpt.strategy",
        "lightning_mcore_ckpt.callback",
        "lightning_mcore_ckpt.hf",
    )
    found = []
    for source in sorted(engine.glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [f"{source.name}: {n}" for n in names if n.startswith(forbidden)]
    assert found == []
