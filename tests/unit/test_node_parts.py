"""The logic of a step's parts on nodes that share no file system (``storage/node_parts.py``):
what a node uploads and confirms, how rank 0 waits for the confirmations, and how it checks
them against the commit record. An in-memory store stands in for S3 here; the real path (moto
on loopback, simulated nodes) is ``tests/nodes/test_store_without_shared_fs.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.format import integrity
from lightning_mcore_ckpt.format.markers import METADATA_FILE, STARTED_MARKER
from lightning_mcore_ckpt.storage import node_parts


class MemoryStore:
    """The part of ``ObjectStore`` that node_parts uses, in memory."""

    url = "s3://bucket/run"
    concurrency = 2

    def __init__(self, failing: str | None = None) -> None:
        self.objects: dict[str, bytes] = {}
        self.failing = failing

    def put_file(self, local: Path, name: str) -> int:
        if self.failing is not None and self.failing in name:
            raise OSError(f"injected: {name}")
        data = Path(local).read_bytes()
        self.objects[name] = data
        return len(data)

    def put_bytes(self, name: str, data: bytes) -> None:
        self.objects[name] = data

    def get_bytes(self, name: str) -> bytes | None:
        return self.objects.get(name)

    def list(self, under: str = "") -> dict[str, int]:
        prefix = f"{under}/" if under else ""
        return {k: len(v) for k, v in self.objects.items() if k.startswith(prefix)}


def _part(root: Path, ranks: list[int]) -> Path:
    """A node's part of a step: its ranks' files, the start marker, and a shared file."""
    step = root / "global_step_4"
    for rank in ranks:
        (step / "model").mkdir(parents=True, exist_ok=True)
        (step / "extra").mkdir(parents=True, exist_ok=True)
        (step / "model" / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 100)
        (step / "extra" / f"rank_{rank:05d}.pt").write_bytes(b"x" * (10 + rank))
    (step / STARTED_MARKER).write_text("{}")
    (step / METADATA_FILE).write_text("{}")  # a seal's, never part of a node's upload
    (root / "shared").mkdir(exist_ok=True)
    (root / "shared" / "frozen.bin").write_bytes(b"f" * 7)
    return step


def _recorded(step: Path, ranks: list[int]) -> dict[str, str]:
    found = {}
    for rank in ranks:
        for rel in (f"model/__{rank}_0.distcp", f"extra/rank_{rank:05d}.pt"):
            found[rel] = integrity.hash_file(step / rel)
    found["../shared/frozen.bin"] = integrity.hash_file(step.parent / "shared" / "frozen.bin")
    return found


@pytest.mark.parametrize("leader", [0, 2], ids=["global-rank-0s-node", "another-node"])
def test_a_node_uploads_its_ranks_files_and_confirms_each_with_its_size_and_digest(
    tmp_path: Path, leader: int
) -> None:
    store = MemoryStore()
    step = _part(tmp_path, [leader, leader + 1])
    hashes = _recorded(step, [leader, leader + 1])
    confirmation = node_parts.upload_part(store, step, hashes, leader)  # type: ignore[arg-type]
    objects = confirmation["objects"]
    expected = {f"global_step_4/model/__{r}_0.distcp" for r in (leader, leader + 1)}
    expected |= {f"global_step_4/extra/rank_{r:05d}.pt" for r in (leader, leader + 1)}
    expected |= {"shared/frozen.bin"}
    if leader == 0:  # the step has one start marker: global rank 0's node's
        expected.add(f"global_step_4/{STARTED_MARKER}")
    assert set(objects) == expected
    for key, found in objects.items():
        assert store.objects[key] and found["size"] == len(store.objects[key])
    assert objects["global_step_4/model/__2_0.distcp" if leader else "shared/frozen.bin"][
        "digest"
    ] == (hashes["model/__2_0.distcp"] if leader else hashes["../shared/frozen.bin"])
    stored = json.loads(store.objects[node_parts.part_name("global_step_4", leader)])
    assert stored["objects"] == objects and stored["rank"] == leader
    # A shared file already in the store with its size is not sent again.
    again = node_parts.upload_part(store, step, hashes, leader)  # type: ignore[arg-type]
    assert "shared/frozen.bin" not in again["objects"]


def test_a_node_whose_upload_fails_confirms_the_error_and_raises(tmp_path: Path) -> None:
    store = MemoryStore(failing="__3_0")
    step = _part(tmp_path, [2, 3])
    with pytest.raises(OSError, match="injected"):
        node_parts.upload_part(store, step, _recorded(step, [2, 3]), 2)  # type: ignore[arg-type]
    stored = json.loads(store.objects[node_parts.part_name("global_step_4", 2)])
    assert "injected" in stored["error"] and "objects" not in stored


def test_rank_0_waits_for_every_confirmation_and_names_a_failed_or_missing_node() -> None:
    store = MemoryStore()
    for rank in (2, 4):
        body = {"rank": rank, "host": f"node{rank // 2}", "objects": {}}
        store.put_bytes(node_parts.part_name("global_step_4", rank), json.dumps(body).encode())
    found = node_parts.await_parts(store, "global_step_4", [2, 4], 5.0)  # type: ignore[arg-type]
    assert [f["rank"] for f in found] == [2, 4]
    with pytest.raises(TimeoutError, match=r"ranks \[6\] did not confirm .* within 0 s"):
        node_parts.await_parts(store, "global_step_4", [2, 4, 6], 0.05)  # type: ignore[arg-type]
    failed = {"rank": 6, "host": "node3", "error": "OSError: disk gone"}
    store.put_bytes(node_parts.part_name("global_step_4", 6), json.dumps(failed).encode())
    with pytest.raises(OSError, match=r"rank 6 \(node3\) failed to upload .*disk gone"):
        node_parts.await_parts(store, "global_step_4", [2, 4, 6], 5.0)  # type: ignore[arg-type]


def _confirmed(rank: int, objects: dict[str, tuple[int, str]]) -> dict[str, Any]:
    return {"rank": rank, "objects": {k: {"size": s, "digest": d} for k, (s, d) in objects.items()}}


def test_the_confirmations_are_checked_against_the_digests_the_ranks_recorded() -> None:
    recorded = {"model/__0_0.distcp": "xxh3-128:a", "model/__2_0.distcp": "xxh3-128:b"}
    parts = [
        _confirmed(0, {"global_step_4/model/__0_0.distcp": (100, "xxh3-128:a")}),
        _confirmed(2, {"global_step_4/model/__2_0.distcp": (100, "xxh3-128:b")}),
        # Files nobody hashed while writing (Megatron-Core's index) are taken as confirmed; a
        # shared file may come from two nodes.
        _confirmed(0, {"global_step_4/model/.metadata": (9, "xxh3-128:c")}),
        _confirmed(0, {"shared/f.bin": (7, "xxh3-128:d")}),
        _confirmed(2, {"shared/f.bin": (7, "xxh3-128:d")}),
    ]
    merged = node_parts.merge_parts("global_step_4", parts, recorded)
    assert merged == {
        "model/__0_0.distcp": (100, "xxh3-128:a"),
        "model/__2_0.distcp": (100, "xxh3-128:b"),
        "model/.metadata": (9, "xxh3-128:c"),
        "../shared/f.bin": (7, "xxh3-128:d"),
    }
    changed = [_confirmed(2, {"global_step_4/model/__2_0.distcp": (100, "xxh3-128:z")})]
    with pytest.raises(OSError, match=r"rank 2 uploaded a file whose digest .*z differs"):
        node_parts.merge_parts("global_step_4", changed, recorded)
    twice = [parts[0], _confirmed(2, {"global_step_4/model/__0_0.distcp": (100, "xxh3-128:a")})]
    with pytest.raises(OSError, match="uploaded by two nodes"):
        node_parts.merge_parts("global_step_4", twice, recorded)
