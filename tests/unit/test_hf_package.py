"""The ``hf`` package: its public names, small modules, imports in one direction."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import lightning_mcore_ckpt

HF = Path(lightning_mcore_ckpt.__file__).parent / "hf"
ORDER = [
    "_refused",
    "_names",
    "_heads",
    "_bridge",
    "_reader",
    "_safetensors",
    "_plan",
    "_adapters",
    "_verify",
    "_upload",
    "_export",
    "_load",
    "_import",
    "_logits",
]
"""Each module may import only modules before it."""
ALLOWED = {
    "lightning_mcore_ckpt.storage.atomic",
    "lightning_mcore_ckpt._compat",
    "lightning_mcore_ckpt._cpu",
    "lightning_mcore_ckpt.storage.remote_files",
    "lightning_mcore_ckpt.training.parallel",
    "lightning_mcore_ckpt.safety.safe_dcp",
    "lightning_mcore_ckpt.safety.safe_load",
    "lightning_mcore_ckpt.safety.names",
    "lightning_mcore_ckpt.training.adapters",
    "lightning_mcore_ckpt.errors",
    "lightning_mcore_ckpt.format.integrity",
    "lightning_mcore_ckpt.format.layout",
    "lightning_mcore_ckpt.format.markers",
}
PUBLIC = [
    "DEFAULT_MAX_SHARD_BYTES",
    "HF_DIR",
    "WHEN",
    "HFBridge",
    "HFExport",
    "HubUploader",
    "LOGITS_ATOL",
    "LogitsResult",
    "UploadError",
    "UploadResult",
    "VerifyResult",
    "check_logits",
    "check_model_matches",
    "check_upload_options",
    "export_checkpoint",
    "gpt_model_prefixes",
    "import_checkpoint",
    "is_exported",
    "load_hf_weights",
    "supported_model_types",
    "upload_export",
    "verify_export",
]


def _is_module(name: str) -> bool:
    path = Path(lightning_mcore_ckpt.__file__).parent.joinpath(*name.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _package_imports(path: Path) -> set[str]:
    """Every ``lightning_mcore_ckpt`` module ``path`` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lightning_mcore_ckpt")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "lightning_mcore_ckpt"
        ):
            assert node.module is not None
            for alias in node.names:
                # A module imported from its package counts as that module.
                sub = f"{node.module}.{alias.name}"
                found.add(
                    sub if _is_module(sub) or node.module == "lightning_mcore_ckpt" else node.module
                )
    return found


def test_every_module_imports_in_one_direction() -> None:
    modules = sorted(p.stem for p in HF.glob("*.py") if p.stem != "__init__")
    assert modules == sorted(ORDER)
    for position, name in enumerate(ORDER):
        imported = _package_imports(HF / f"{name}.py")
        earlier = {f"lightning_mcore_ckpt.hf.{m}" for m in ORDER[:position]}
        assert imported <= ALLOWED | earlier, (name, imported - ALLOWED - earlier)
    init = _package_imports(HF / "__init__.py")
    assert init <= {f"lightning_mcore_ckpt.hf.{m}" for m in ORDER}


def test_the_public_names_are_reexported() -> None:
    from lightning_mcore_ckpt import hf

    assert sorted(hf.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(hf, name) is not None
    namespace: dict[str, object] = {}
    exec("from lightning_mcore_ckpt.hf import *", namespace)
    assert set(PUBLIC) <= set(namespace)
    assert hf.HF_DIR == "huggingface"
    assert lightning_mcore_ckpt.HFExport is hf.HFExport


def test_importing_hf_loads_neither_the_strategy_nor_the_callback() -> None:
    code = (
        "import sys, lightning_mcore_ckpt.hf as hf; hf.HFExport; "
        "print(sorted(m for m in sys.modules if m.startswith('lightning_mcore_ckpt')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = done.stdout
    for module in ("strategy", "callback", "testing", "cli"):
        assert f"'lightning_mcore_ckpt.{module}'" not in loaded, module
