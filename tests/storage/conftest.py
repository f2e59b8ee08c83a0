"""Fixtures for the object-storage tests: one real S3 server (moto) on loopback per session.

Without boto3 or moto every test that uses these fixtures is skipped. (The skip is in the
fixtures, not at the top of this file: a skip raised while a conftest is imported is an error
when the directory is named on the command line. Test modules that import boto3 themselves
call ``pytest.importorskip("boto3")`` first.)
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from _s3server import S3Server  # imports neither boto3 nor moto at import time


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    pytest.importorskip("boto3")
    pytest.importorskip("moto")
    server = S3Server(tmp_path_factory.mktemp("s3server")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh bucket; the AWS variables (inherited by child processes) point at the server."""
    s3_server.reset()
    name = f"t-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(name)
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    try:
        yield name
    finally:
        s3_server.reset()  # releases held requests, lifts "down" for the next test
