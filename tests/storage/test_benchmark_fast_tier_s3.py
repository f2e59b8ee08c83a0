"""The fast-tier benchmark's S3 stand-in (``benchmarks.fast_tier.S3Stand``) against its own
S3 server on loopback: a committed step published with the library's uploader, what a launch
adds to the bucket (its lock, its records) read and then deleted, a changed step refused, the
server's spooled objects dropped from the page cache, and the server stopped."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import fast_tier  # noqa: E402 - the repository's benchmarks, not a package

MiB = 2**20
STEP = fast_tier.PERSISTED


@pytest.fixture
def stand(tmp_path: Path) -> Iterator[fast_tier.S3Stand]:
    got, why = fast_tier.S3Stand.open(tmp_path / "scratch")
    assert got is not None, why
    try:
        yield got
    finally:
        got.close()


def _committed_step(ckpt: Path) -> Path:
    """A sealed ``global_step_<STEP>`` under ``ckpt``: one shard over moto's 8 MiB in-memory
    limit (spooled to a file by the server), one small file."""
    from lightning_mcore_ckpt.storage.seal import seal_step

    step = ckpt / f"global_step_{STEP}"
    (step / "model").mkdir(parents=True)
    (step / "model" / "__0_0.distcp").write_bytes(b"\x01" * (9 * MiB))
    (step / "model" / ".metadata").write_bytes(b"small")
    seal_step(step, {"format_version": 2, "global_step": STEP})
    return step


def test_the_step_is_published_and_each_launch_finds_the_bucket_as_it_was(
    stand: fast_tier.S3Stand, tmp_path: Path
) -> None:
    from lightning_mcore_ckpt.callback.fast_tier import RECORDS
    from lightning_mcore_ckpt.storage import publication
    from lightning_mcore_ckpt.storage.object_store import ObjectStore

    assert stand.url.startswith("s3://bench-") and stand.url.endswith("/run")
    assert stand.env()["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
    assert "127.0.0.1" in stand.describe() and "not throttled" in stand.describe()
    _committed_step(tmp_path / "ckpt")
    figures = stand.publish(tmp_path / "ckpt", STEP)
    assert figures["objects"] == len(stand.baseline) >= 3  # the shards, the marker, the tracker
    assert figures["upload_bytes"] >= 9 * MiB
    assert stand.records() == []
    # The server's spooled object (9 MiB) is among the files dropped from the page cache.
    assert stand.drop_cache() >= 9 * MiB
    assert stand.cpu_s() > 0

    # What a launch leaves: its lock and its record; both gone after the reset, the step kept.
    with pytest.MonkeyPatch.context() as env:
        for key, value in stand.env().items():
            env.setenv(key, value)
        store = ObjectStore.from_url(stand.url)
        store.put_bytes(".lightning_mcore_ckpt.lock", b"{}")
        line = {"kind": "recovery", "tier": "persistent", "step": STEP, "time_s": 0.01}
        store.put_bytes(RECORDS, (json.dumps(line) + "\n").encode())
        assert stand.records() == [line]
        stand.reset()
        assert store.list() == stand.baseline
        assert stand.records() == []
        assert STEP in publication.published_steps(store)

        # A launch that changed the published step fails the run, naming the bucket.
        store.delete([f"global_step_{STEP}/model/__0_0.distcp"])
        with pytest.raises(RuntimeError, match=f"changed 1 objects of {stand.url}"):
            stand.reset()


def test_a_step_not_committed_is_not_published(stand: fast_tier.S3Stand, tmp_path: Path) -> None:
    (tmp_path / "ckpt" / f"global_step_{STEP}").mkdir(parents=True)  # no seal
    with pytest.raises(ValueError, match="not sealed"):
        stand.publish(tmp_path / "ckpt", STEP)


def test_the_server_is_stopped_on_close(tmp_path: Path) -> None:
    got, why = fast_tier.S3Stand.open(tmp_path / "scratch")
    assert got is not None, why
    proc = got.server._proc
    got.close()
    assert proc.poll() is not None
    assert got.drop_cache() == 0
