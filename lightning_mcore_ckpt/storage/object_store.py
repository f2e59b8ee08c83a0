"""Object storage (S3 and S3-compatible stores) through boto3: URLs, the client, uploads with
bounded memory, ranged reads, conditional writes. Imports nothing from the package.

The endpoint and the credentials are boto3's: ``AWS_ENDPOINT_URL`` (``AWS_ENDPOINT_URL_S3``),
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, the
shared config files, instance roles. Nothing here logs or returns them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "INSTALL_HINT",
    "ObjectStore",
    "is_missing",
    "is_precondition_failed",
    "is_url",
    "require_client",
]

SCHEMES = ("s3://",)
INSTALL_HINT = "pip install 'lightning-mcore-ckpt[s3]'"
"""What installs the object-store client (boto3)."""


def is_url(path: Any) -> bool:
    """Whether ``path`` names an object store (``s3://bucket/prefix``) rather than a local path.

    Example::

        is_url("s3://ckpts/run1")  # True
    """
    return isinstance(path, str) and path.startswith(SCHEMES)


def require_client(argument: str, value: str) -> None:
    """Raise ``ImportError`` naming ``argument``, its ``value`` and the install line when the
    object-store client is missing (before any work is done)."""
    try:
        import boto3  # noqa: F401
    except ImportError:
        close = ")" if "(" in argument else ""
        raise ImportError(
            f"{argument}={value!r}{close}: an object-store URL needs boto3, which is not "
            f"installed: {INSTALL_HINT}"
        ) from None


@dataclass
class ObjectStore:
    """A bucket and a key prefix in an S3-compatible store, from ``s3://bucket/prefix``.

    Uploads are multipart above ``part_size`` bytes, with at most ``concurrency`` requests in
    flight per file: one upload holds at most ``concurrency * part_size`` bytes in memory.

    Example::

        store = ObjectStore.from_url("s3://ckpts/run1")
        store.put_bytes("hello.txt", b"hi")
        store.get_bytes("hello.txt")  # b'hi'
    """

    bucket: str
    prefix: str
    concurrency: int = 8
    part_size: int = 64 << 20

    @classmethod
    def from_url(cls, url: str, **options: Any) -> ObjectStore:
        if not is_url(url):
            raise ValueError(f"{url!r} is not an object-store URL (s3://bucket/prefix)")
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not bucket:
            raise ValueError(f"{url!r} names no bucket: use s3://bucket/prefix")
        require_client("dirpath", url)
        return cls(bucket, prefix.strip("/"), **options)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def child(self, name: str) -> ObjectStore:
        """The store at ``prefix/name`` (same client settings)."""
        return ObjectStore(
            self.bucket, self.key(name), concurrency=self.concurrency, part_size=self.part_size
        )

    def key(self, name: str) -> str:
        name = name.strip("/")
        return f"{self.prefix}/{name}" if self.prefix else name

    # --- the client (one per thread: boto3 clients are thread-safe, sessions are not) --------

    @property
    def client(self) -> Any:
        """The S3 client (thread-safe; shared by every store of this process with the same
        endpoint, credentials variables and concurrency)."""
        return _client(self.concurrency)

    def _transfer_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=self.part_size,
            multipart_chunksize=self.part_size,
            max_concurrency=self.concurrency,
            use_threads=self.concurrency > 1,
        )

    # --- objects --------------------------------------------------------------------------

    def put_file(self, local: str | os.PathLike[str], name: str) -> int:
        """Upload a file (multipart above ``part_size``); its size in bytes."""
        self.client.upload_file(
            os.fspath(local), self.bucket, self.key(name), Config=self._transfer_config()
        )
        return os.path.getsize(local)

    def put_bytes(
        self, name: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None
    ) -> str:
        """Write an object in one request; its ETag. ``if_none_match``: only if it does not
        exist; ``if_match``: only if its ETag is still that one (``PreconditionFailed``
        otherwise, see :func:`is_precondition_failed`)."""
        extra: dict[str, Any] = {}
        if if_none_match:
            extra["IfNoneMatch"] = "*"
        if if_match is not None:
            extra["IfMatch"] = if_match
        reply = self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=data, **extra)
        return str(reply.get("ETag", ""))

    def get_bytes(self, name: str) -> bytes | None:
        """An object's bytes, or ``None`` when it does not exist."""
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self.key(name))
        except Exception as err:
            if is_missing(err):
                return None
            raise
        return bytes(reply["Body"].read())

    def head(self, name: str) -> tuple[int, str, float] | None:
        """An object's size, ETag and modification time, or ``None`` when it does not exist."""
        try:
            reply = self.client.head_object(Bucket=self.bucket, Key=self.key(name))
        except Exception as err:
            if is_missing(err):
                return None
            raise
        return int(reply["ContentLength"]), str(reply["ETag"]), reply["LastModified"].timestamp()

    def get_range(self, name: str, start: int, length: int) -> bytes:
        reply = self.client.get_object(
            Bucket=self.bucket, Key=self.key(name), Range=f"bytes={start}-{start + length - 1}"
        )
        return bytes(reply["Body"].read())

    def download(self, name: str, local: str | os.PathLike[str]) -> None:
        self.client.download_file(
            self.bucket, self.key(name), os.fspath(local), Config=self._transfer_config()
        )

    def list(self, under: str = "") -> dict[str, int]:
        """Every object below ``prefix/under``: its name relative to ``prefix`` and its size."""
        base = self.key(under) + "/" if under else (self.prefix + "/" if self.prefix else "")
        found: dict[str, int] = {}
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=base
        )
        cut = len(self.prefix) + 1 if self.prefix else 0
        for page in pages:
            for entry in page.get("Contents", ()):
                found[entry["Key"][cut:]] = int(entry["Size"])
        return found

    def delete(self, names: Iterable[str]) -> None:
        """Delete objects (missing ones are not an error), 1000 per request."""
        keys = [{"Key": self.key(n)} for n in names]
        for start in range(0, len(keys), 1000):
            reply = self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": keys[start : start + 1000], "Quiet": True}
            )
            errors = reply.get("Errors") or []
            if errors:
                first = errors[0]
                raise OSError(
                    f"deleting {len(errors)} objects in s3://{self.bucket} failed, e.g. "
                    f"{first.get('Key')}: {first.get('Code')} {first.get('Message')}"
                )


_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()
_CLIENT_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_ACCESS_KEY_ID")


def _client(concurrency: int) -> Any:
    key = (concurrency, *(os.environ.get(name) for name in _CLIENT_ENV))
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            import boto3
            from botocore.config import Config

            config = Config(
                retries={"max_attempts": 8, "mode": "standard"},
                max_pool_connections=max(10, 2 * concurrency),
                connect_timeout=10,
                read_timeout=120,
            )
            client = _clients[key] = boto3.session.Session().client("s3", config=config)
        return client


def is_missing(err: BaseException) -> bool:
    code = getattr(err, "response", {}).get("Error", {}).get("Code", "")
    return str(code) in ("404", "NoSuchKey", "NotFound")


def is_precondition_failed(err: BaseException) -> bool:
    code = getattr(err, "response", {}).get("Error", {}).get("Code", "")
    return str(code) in ("412", "PreconditionFailed", "ConditionalRequestConflict")
