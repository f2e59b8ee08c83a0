"""The digests: what is hashed on the way to a file equals the file's digest read back; the
commit marker's own digest does not depend on its formatting and catches a changed value."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lightning_mcore_ckpt.format import integrity


def test_hashing_writer_gives_the_digest_of_the_file_it_wrote(tmp_path: Path) -> None:
    target = tmp_path / "t.pt"
    with open(target, "wb") as f:
        writer = integrity.HashingWriter(f)
        torch.save({"w": torch.arange(10_000, dtype=torch.float32)}, writer)  # type: ignore[arg-type]
        writer.write(memoryview(torch.ones(7, dtype=torch.bfloat16).view(torch.uint8).numpy()))
    assert writer.digest == integrity.hash_file(target)
    assert writer.digest.startswith("xxh3-128:") and len(writer.digest) == len(
        integrity.PLACEHOLDER
    )
    # Another byte, another digest.
    data = bytearray(target.read_bytes())
    data[100] ^= 1
    target.write_bytes(bytes(data))
    assert integrity.hash_file(target) != writer.digest


def test_the_marker_digest_ignores_formatting_and_catches_a_changed_value() -> None:
    meta = {"global_step": 4, "files": {"a": 1}, integrity.METADATA_HASH: integrity.PLACEHOLDER}
    sealed = json.loads(integrity.seal(json.dumps(meta, indent=2)))
    assert sealed[integrity.METADATA_HASH] == integrity.json_digest(sealed)
    assert integrity.json_digest(json.loads(json.dumps(sealed))) == sealed[integrity.METADATA_HASH]
    assert integrity.json_digest({**sealed, "global_step": 5}) != sealed[integrity.METADATA_HASH]


def test_take_returns_the_digests_under_one_step_once(tmp_path: Path) -> None:
    integrity.record(tmp_path / "global_step_2" / "model" / "__0_0.distcp", "xxh3-128:a")
    integrity.record(tmp_path / "global_step_2" / "extra" / "rank_00000.pt", "xxh3-128:b")
    integrity.record(tmp_path / "global_step_20" / "model" / "__0_0.distcp", "xxh3-128:c")
    assert integrity.take(tmp_path / "global_step_2") == {
        "model/__0_0.distcp": "xxh3-128:a",
        "extra/rank_00000.pt": "xxh3-128:b",
    }
    assert integrity.take(tmp_path / "global_step_2") == {}
    assert integrity.take(tmp_path / "global_step_20") == {"model/__0_0.distcp": "xxh3-128:c"}


def test_check_hashes_names_every_changed_or_missing_file(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        (tmp_path / name).write_bytes(name.encode() * 1000)
    hashes = {n: integrity.hash_file(tmp_path / n) for n in ("a", "b", "c")}
    assert integrity.check_hashes(tmp_path, hashes, threads=2) == []
    (tmp_path / "b").write_bytes(b"x" * 1000)
    (tmp_path / "c").unlink()
    problems = integrity.check_hashes(tmp_path, hashes, threads=2)
    assert len(problems) == 2
    assert "b is damaged" in problems[0] and "c is missing" in problems[1]
    assert integrity.check_hashes(tmp_path, {"sub/x": "xxh3-128:0"}, skipped=["sub"]) == []
