"""A real S3-compatible server on loopback for the tests: moto's S3 app, with fault injection.

Run as a script (``python _s3server.py --port-file PATH --control PATH``) it serves moto's
WSGI app in-process with werkzeug on ``127.0.0.1``, behind a middleware that re-reads the JSON
control file on every request (a missing or unreadable file means no faults). Its keys:

``"fail": "<regex>"``
    A PUT or POST (object put, multipart create/part upload/complete) whose request path
    (``/bucket/key``, no query string; ``re.search``) matches gets HTTP 500 ``InternalError``.
    The request body is drained first and moto never sees the request, so nothing is stored.
``"hold": "<regex>"``
    Such a request blocks (before moto sees it) until the control file no longer has that
    ``"hold"`` value. While at least one request is held the file ``<control>.held`` exists.
    A held request that is still held when the server goes down is dropped (connection
    closed, nothing stored), as a crash would drop it.
``"down": true``
    The server stops listening (connections are refused) until ``"down"`` is false or absent,
    then listens again on the same port. The buckets and objects live in this process's
    memory, so they survive the restart.

The process exits cleanly on SIGTERM. :class:`S3Server` runs it in a child process for a test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

_POLL = 0.05
_ACCESS_KEY = "testing"
_SECRET_KEY = "testing-secret"
_REGION = "us-east-1"

_ERROR_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
)


# --------------------------------------------------------------------------------------------
# Server side (the child process)
# --------------------------------------------------------------------------------------------


def _read_control(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _request_path(environ: dict[str, Any]) -> str:
    """``/bucket/key`` for path-style requests, and for virtual-host style (``bucket.localhost``)."""
    path = str(environ.get("PATH_INFO", "") or "/")
    host = str(environ.get("HTTP_HOST", "")).rsplit(":", 1)[0]
    if host.endswith(".localhost"):
        return "/" + host[: -len(".localhost")] + path
    return path


class _FaultMiddleware:
    def __init__(self, app: Callable[..., Iterable[bytes]], control: Path) -> None:
        self.app = app
        self.control = control
        self.held_marker = Path(str(control) + ".held")
        self._lock = threading.Lock()
        self._held = 0
        self.epoch = 0
        """Bumped each time the server goes down: held requests from an older epoch are dropped."""

    def _hold_changed(self, delta: int) -> None:
        with self._lock:
            self._held += delta
            if self._held == 1 and delta > 0:
                self.held_marker.touch()
            elif self._held == 0:
                self.held_marker.unlink(missing_ok=True)

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") not in ("PUT", "POST"):
            return self.app(environ, start_response)
        path = _request_path(environ)
        control = _read_control(self.control)

        hold = control.get("hold")
        if isinstance(hold, str) and re.search(hold, path):
            epoch = self.epoch
            self._hold_changed(+1)
            try:
                while _read_control(self.control).get("hold") == hold:
                    if self.epoch != epoch:
                        # The server went down while this request was held: drop it.
                        sock = environ.get("werkzeug.socket")
                        if sock is not None:
                            with contextlib.suppress(OSError):
                                sock.shutdown(socket.SHUT_RDWR)
                        # Consume what was buffered, or werkzeug reads it as the next request.
                        with contextlib.suppress(Exception):
                            environ["wsgi.input"].read()
                        raise ConnectionResetError("server went down while the request was held")
                    time.sleep(_POLL)
            finally:
                self._hold_changed(-1)
            control = _read_control(self.control)

        fail = control.get("fail")
        if isinstance(fail, str) and re.search(fail, path):
            from werkzeug.wsgi import get_input_stream

            stream = get_input_stream(environ)
            while stream.read(1 << 20):
                pass
            start_response(
                "500 Internal Server Error",
                [("Content-Type", "application/xml"), ("Content-Length", str(len(_ERROR_BODY)))],
            )
            return [_ERROR_BODY]

        return self.app(environ, start_response)


class _Serving:
    """One werkzeug server (a listening socket) serving in a thread."""

    def __init__(self, app: Any, port: int) -> None:
        from moto.moto_server.werkzeug_app import MotoRequestHandler
        from werkzeug.serving import make_server

        deadline = time.monotonic() + 30
        while True:
            try:
                self.server = make_server(
                    "127.0.0.1", port, app, threaded=True, request_handler=MotoRequestHandler
                )
                break
            except OSError:
                if port == 0 or time.monotonic() > deadline:
                    raise
                time.sleep(_POLL)
        self.port: int = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("--control", type=Path, required=True)
    args = parser.parse_args(argv)

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    os.environ.setdefault("MOTO_ALLOW_NONEXISTENT_REGION", "True")

    # As moto's ThreadedMotoServer builds it.
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

    app = _FaultMiddleware(DomainDispatcherApplication(create_backend_app), args.control)

    stopping = threading.Event()

    def _on_signal(signum: int, frame: types.FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)

    first = _Serving(app, 0)
    serving: _Serving | None = first
    port = first.port
    os.environ["MOTO_PORT"] = str(port)
    _write_atomic(args.port_file, str(port))

    try:
        while not stopping.wait(_POLL):
            down = _read_control(args.control).get("down") is True
            if down and serving is not None:
                app.epoch += 1
                serving.stop()
                serving = None
            elif not down and serving is None:
                serving = _Serving(app, port)
    finally:
        if serving is not None:
            app.epoch += 1
            serving.stop()
        app.held_marker.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------
# Client side (the test process)
# --------------------------------------------------------------------------------------------


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


class S3Server:
    """A moto S3 server in a child process, on 127.0.0.1."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.port_file = self.workdir / "s3server.port"
        self.control = self.workdir / "s3server.control.json"
        self.held_marker = Path(str(self.control) + ".held")
        self.log = self.workdir / "s3server.log"
        self.port = 0
        self.endpoint = ""
        self._control: dict[str, Any] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._client: Any = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> S3Server:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port_file.unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(self.env_without_endpoint())
        env["MOTO_ALLOW_NONEXISTENT_REGION"] = "True"
        env["PYTHONUNBUFFERED"] = "1"
        with open(self.log, "ab") as log:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--port-file",
                    str(self.port_file),
                    "--control",
                    str(self.control),
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while not self.port_file.exists():
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"the S3 server exited with {self._proc.returncode}:\n{self._log_tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the S3 server did not start in 60 s:\n{self._log_tail()}")
            time.sleep(_POLL)
        self.port = int(self.port_file.read_text())
        self.endpoint = f"http://127.0.0.1:{self.port}"
        return self

    def _log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    @staticmethod
    def env_without_endpoint() -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": _ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": _SECRET_KEY,
            "AWS_DEFAULT_REGION": _REGION,
        }

    def env(self) -> dict[str, str]:
        """The variables that point an AWS client (boto3, a child process) at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, **self.env_without_endpoint()}

    def client(self) -> Any:
        """A boto3 S3 client for this server (no retries: a failure shows at once)."""
        if self._client is None:
            import boto3
            from botocore.config import Config

            self._client = boto3.client(
                "s3",
                endpoint_url=self.endpoint,
                aws_access_key_id=_ACCESS_KEY,
                aws_secret_access_key=_SECRET_KEY,
                region_name=_REGION,
                config=Config(retries={"max_attempts": 1, "mode": "standard"}),
            )
        return self._client

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def faults(self, **control: Any) -> None:
        """Replace the control file with ``control`` (no arguments: no faults)."""
        self._control = dict(control)
        _write_atomic(self.control, json.dumps(self._control))

    def wait_held(self, timeout: float = 60) -> None:
        """Wait until a request is held by a ``hold`` fault."""
        deadline = time.monotonic() + timeout
        while not self.held_marker.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no request was held within {timeout} s")
            time.sleep(_POLL)

    def restart(self, down_for: float) -> None:
        """Stop listening for ``down_for`` seconds, then listen again; the data is kept."""
        others = {k: v for k, v in self._control.items() if k != "down"}
        self.faults(**others, down=True)
        self.wait_accepting(False)
        time.sleep(down_for)
        self.faults(**others)
        self.wait_accepting(True)

    def reset(self) -> None:
        """No faults, and the server listening."""
        self.faults()
        self.wait_accepting(True)

    def wait_accepting(self, accepting: bool, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while _accepts(self.port) != accepting:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"the S3 server exited:\n{self._log_tail()}")
            if time.monotonic() > deadline:
                state = "accept" if accepting else "refuse"
                raise TimeoutError(f"the S3 server did not {state} connections in {timeout} s")
            time.sleep(_POLL)

    def objects(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """Key -> size of the objects under ``prefix``."""
        out: dict[str, int] = {}
        pages = (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        )
        for page in pages:
            for obj in page.get("Contents", []):
                out[obj["Key"]] = int(obj["Size"])
        return out

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    main()
