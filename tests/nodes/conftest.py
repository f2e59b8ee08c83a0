"""Simulated nodes (``lightning_mcore_ckpt.testing.run_nodes``): the ``node_dir`` fixture, and
the ``s3`` server on loopback of the tests whose nodes share no filesystem."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _node_dirs import node_local


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real S3 server on loopback (moto), one per test module; skipped without boto3/moto."""
    from _s3_required import import_or_skip
    from _s3server import S3Server

    import_or_skip("boto3")
    import_or_skip("moto")
    with S3Server(tmp_path_factory.mktemp("s3server")) as server:
        yield server


@pytest.fixture
def node_dir(tmp_path: Path) -> Path:
    """A path that is each simulated node's own directory (``run_nodes(node_dir=...)``);
    skipped without root and namespaces, failed so under CI (``_node_dirs.node_local``)."""
    return node_local(tmp_path / "local")
