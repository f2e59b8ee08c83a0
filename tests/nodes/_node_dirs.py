"""A node-local directory for simulated nodes, or the test is skipped (failed under CI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_mcore_ckpt.testing import nodes_unavailable


def _under_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def node_local(path: Path) -> Path:
    """``path`` as ``run_nodes(node_dir=...)``: each simulated node's own directory there.

    Needs root and mount and UTS namespaces. Without them the test is skipped, naming why,
    except under CI (``CI`` set), where it fails with the fix: CI runs as root, so a skip there
    would hide a broken runner."""
    why = nodes_unavailable()
    if why is not None:
        if _under_ci():
            pytest.fail(f"simulated nodes cannot run under CI: {why}")
        pytest.skip(why)
    return path
