"""Fixtures for the object-storage tests: one real S3 server (moto) on loopback per session.

Without boto3 or moto these tests skip, except under CI, where they must run: there a failed
import fails them, naming the error and the fix (the rule is ``_s3_required.required_by``). The
fixtures import through ``_s3_required.import_or_skip``; test modules that import boto3 themselves
call ``pytest.importorskip`` at the top, and under CI the skip that makes is turned into a
failure here (``pytest_make_collect_report``). A skip raised while a conftest is imported would
be an error when the directory is named on the command line, so none is raised at import.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from _s3_required import import_errors, import_or_skip, message, required_by
from _s3server import S3Server  # imports neither boto3 nor moto at import time


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[Any]:
    # A test module here skipped (its importorskip) while boto3 or moto cannot be imported:
    # under CI that is a failure, not a skip.
    report = yield
    if report.skipped and isinstance(collector, pytest.Module):
        why = required_by(os.environ)
        errors = import_errors() if why is not None else {}
        if errors and why is not None:
            report.outcome = "failed"
            report.longrepr = f"{collector.nodeid}: {message(errors, why)}"
    return report


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    import_or_skip("boto3")
    import_or_skip("moto")
    with S3Server(tmp_path_factory.mktemp("s3server")) as server:
        yield server


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
