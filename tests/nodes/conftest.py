"""Simulated nodes (``lightning_mcore_ckpt.testing.run_nodes``): the ``node_dir`` fixture."""

from __future__ import annotations

from pathlib import Path

import pytest
from _node_dirs import node_local


@pytest.fixture
def node_dir(tmp_path: Path) -> Path:
    """A path that is each simulated node's own directory (``run_nodes(node_dir=...)``);
    skipped without root and namespaces, failed so under CI (``_node_dirs.node_local``)."""
    return node_local(tmp_path / "local")
