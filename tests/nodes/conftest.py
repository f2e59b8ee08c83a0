"""Simulated nodes (``lightning_mcore_ckpt.testing.run_nodes``): the ``node_dir`` fixture.

A test that gives its nodes a directory of their own (``node_dir``) needs root and mount and UTS
namespaces. Without them it is skipped, naming why, except under CI (``CI`` set), where it fails
with the fix: CI runs as root, so a skip there would hide a broken runner.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_mcore_ckpt.testing import nodes_unavailable


def _under_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


@pytest.fixture
def node_dir(tmp_path: Path) -> Path:
    """A path that is each simulated node's own directory (``run_nodes(node_dir=...)``)."""
    why = nodes_unavailable()
    if why is not None:
        if _under_ci():
            pytest.fail(f"simulated nodes cannot run under CI: {why}")
        pytest.skip(why)
    return tmp_path / "local"
