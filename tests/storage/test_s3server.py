"""The loopback S3 server of the storage tests: objects, injected failures, held requests, restarts."""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

import pytest
from _s3server import S3Server

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")

from botocore.config import Config  # noqa: E402
from botocore.exceptions import ClientError  # noqa: E402


def _client() -> Any:
    # From the environment, as the code under test and its child processes see it.
    return boto3.client("s3", config=Config(retries={"max_attempts": 1}))


def test_put_get_fail_hold_restart(s3_server: S3Server, s3_bucket: str) -> None:
    assert os.environ["AWS_ENDPOINT_URL"] == s3_server.endpoint
    s3 = _client()
    s3.put_object(Bucket=s3_bucket, Key="run/a.bin", Body=b"abc")
    got = s3.get_object(Bucket=s3_bucket, Key="run/a.bin")["Body"].read()
    assert got == b"abc"

    # "fail": a matching put gets InternalError and stores nothing; another put succeeds.
    s3_server.faults(fail=r"/global_step_4/.*\.distcp$")
    with pytest.raises(ClientError) as err:
        s3.put_object(
            Bucket=s3_bucket, Key="run/global_step_4/model/__0_0.distcp", Body=b"x" * 1000
        )
    assert err.value.response["Error"]["Code"] == "InternalError"
    s3.put_object(Bucket=s3_bucket, Key="run/global_step_2/model/__0_0.distcp", Body=b"y")
    assert s3_server.objects(s3_bucket, "run/") == {
        "run/a.bin": 3,
        "run/global_step_2/model/__0_0.distcp": 1,
    }

    # "hold": a matching put blocks until the hold is lifted.
    s3_server.faults(hold=r"held\.bin$")
    errors: list[BaseException] = []

    def put() -> None:
        try:
            s3.put_object(Bucket=s3_bucket, Key="run/held.bin", Body=b"1234")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=put)
    thread.start()
    s3_server.wait_held(timeout=10)
    thread.join(0.3)
    assert thread.is_alive()
    assert "run/held.bin" not in s3_server.objects(s3_bucket)
    s3_server.faults()
    thread.join(10)
    assert not thread.is_alive() and not errors
    assert s3_server.objects(s3_bucket)["run/held.bin"] == 4
    assert not s3_server.held_marker.exists()

    # "down": connections are refused; back up on the same port with the objects kept.
    before = s3_server.objects(s3_bucket)
    s3_server.faults(down=True)
    s3_server.wait_accepting(False)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", s3_server.port), timeout=1).close()
    s3_server.reset()
    s3_server.restart(down_for=0.5)
    assert s3_server.objects(s3_bucket) == before
