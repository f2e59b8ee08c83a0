"""The object-store layer against the real S3 server: multipart uploads, ranged reads through
a view, conditional writes, and the order in which a step is published (marker last, tracker
after it)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("boto3")


def _store(bucket: str, prefix: str = "run", **options: Any) -> Any:
    from lightning_mcore_ckpt.storage.object_store import ObjectStore

    return ObjectStore.from_url(f"s3://{bucket}/{prefix}", **options)


def test_large_files_go_up_in_parts_and_come_back_by_range(
    s3_bucket: str, s3_server: Any, tmp_path: Path
) -> None:
    from lightning_mcore_ckpt.storage import remote_files

    data = os.urandom(12 << 20)
    (tmp_path / "shard.distcp").write_bytes(data)
    store = _store(s3_bucket, part_size=5 << 20, concurrency=2)
    assert store.put_file(tmp_path / "shard.distcp", "big/shard.distcp") == len(data)
    etag = s3_server.client().head_object(Bucket=s3_bucket, Key="run/big/shard.distcp")["ETag"]
    assert etag.strip('"').endswith("-3")  # three parts of at most 5 MiB
    # Read through a remote file: requests of at most part_size, any offset.
    local = tmp_path / "view" / "shard.distcp"
    remote_files.register_remote(local, store, "big/shard.distcp", len(data))
    assert remote_files.size_of(local) == len(data) and not local.exists()
    with remote_files.open_read(local) as stream:
        assert stream.read() == data
        stream.seek(7 << 20)
        assert stream.read(10) == data[7 << 20 : (7 << 20) + 10]
        buffer = bytearray(6 << 20)
        stream.seek(1)
        assert stream.readinto(buffer) == len(buffer) and bytes(buffer) == data[1 : 1 + len(buffer)]
    remote_files.forget_remote(tmp_path / "view")
    assert remote_files.remote_size(local) is None


def test_conditional_writes_and_missing_objects(s3_bucket: str) -> None:
    from lightning_mcore_ckpt.storage import object_store

    store = _store(s3_bucket)
    etag = store.put_bytes("lock", b"a", if_none_match=True)
    with pytest.raises(Exception) as taken:
        store.put_bytes("lock", b"b", if_none_match=True)
    assert object_store.is_precondition_failed(taken.value)
    with pytest.raises(Exception) as moved:
        store.put_bytes("lock", b"c", if_match='"0123"')
    assert object_store.is_precondition_failed(moved.value)
    store.put_bytes("lock", b"d", if_match=etag)
    assert store.get_bytes("lock") == b"d"
    assert store.get_bytes("nothing") is None and store.head("nothing") is None


def _committed_step(root: Path, step: int) -> Path:
    path = root / f"global_step_{step}"
    (path / "model").mkdir(parents=True)
    (path / "model" / "__0_0.distcp").write_bytes(os.urandom(1000))
    (path / "model" / ".metadata").write_bytes(b"index")
    (path / ".lightning_mcore_ckpt").write_text("{}")
    files = {"model/__0_0.distcp": 1000, "model/.metadata": 5}
    meta = {"format_version": 2, "global_step": step, "contents": ["model"], "files": files}
    (path / "metadata.json").write_text(json.dumps(meta))
    return path


def test_a_step_is_published_objects_first_then_its_marker_then_the_tracker(
    s3_bucket: str, s3_server: Any, tmp_path: Path
) -> None:
    from lightning_mcore_ckpt.format import layout
    from lightning_mcore_ckpt.storage import publication, store_views

    store = _store(s3_bucket)
    step = _committed_step(tmp_path, 3)
    # An earlier attempt at step 3 (another layout) left an object the new save does not have.
    store.put_bytes("global_step_3/extra/rank_00007.pt", b"stale")
    s3_server.faults(hold=rf"/{s3_bucket}/run/global_step_3/metadata\.json")
    done: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: done.update(publication.publish_step(store, step)))
    thread.start()
    s3_server.wait_held()
    # The marker is being written: every other object is complete, the tracker not moved.
    listed = s3_server.objects(s3_bucket)
    assert set(listed) == {
        "run/global_step_3/.lightning_mcore_ckpt",
        "run/global_step_3/model/.metadata",
        "run/global_step_3/model/__0_0.distcp",
    }
    assert publication.published_steps(store) == {}
    view = store_views.open_view(store.url)
    assert layout.incomplete_steps(view)[0].step == 3
    assert layout.resolve_last(view, verify=False) is None
    s3_server.faults()
    thread.join(30)
    assert done["upload_bytes"] == 1000 + 5 + 2 + len((step / "metadata.json").read_bytes())
    assert store.get_bytes("latest_checkpointed_iteration.txt") == b"3\n"
    # An older step published later never moves the tracker back.
    publication.publish_step(store, _committed_step(tmp_path, 1))
    assert store.get_bytes("latest_checkpointed_iteration.txt") == b"3\n"
    assert sorted(publication.published_steps(store)) == [1, 3]
    view = store_views.open_view(store.url)
    assert layout.resolve_last(view, verify=False) == view / "global_step_3"  # a fake index
    # Deleting a step takes its marker first, then everything else.
    publication.remove_published(store, 3)
    assert not any("global_step_3" in k for k in s3_server.objects(s3_bucket))
