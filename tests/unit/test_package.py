"""The installed package: silent import, console script, version."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import lightning_mcore_ckpt
from lightning_mcore_ckpt.cli import entry as cli


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


def test_the_import_contracts_hold() -> None:
    # The layers of docs/architecture.md, as pyproject.toml's import-linter contracts state them.
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    lint = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    if not Path(lint).exists():
        pytest.skip("import-linter is not installed (the dev extra)")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([lint], cwd=root, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "0 broken" in proc.stdout


def test_no_import_cycle_between_modules() -> None:
    # Imports of a module's own enclosing package (its __init__ re-exports) aside.
    grimp = pytest.importorskip("grimp", reason="import-linter (the dev extra) brings grimp")
    graph = grimp.build_graph("lightning_mcore_ckpt")
    edges = {
        module: {
            imported
            for imported in graph.find_modules_directly_imported_by(module)
            if not module.startswith(imported + ".")
        }
        for module in graph.modules
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(edges.get(module, ())):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt] if nxt in path else [module, nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert cycles == []
