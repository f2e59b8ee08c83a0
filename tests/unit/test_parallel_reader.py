"""The parallel shard reader: every record lands in its tensor with the exact bytes saved.

Axes: dtype (fp32, bf16, int64), layout of the saved tensor (contiguous, transposed, 0-dim,
empty), the tensor loaded into (whole, a slice of a saved chunk, strided), reader threads (1, 3).
Records laid out in the file as in memory go straight into their tensor; the others go through
torch.load and a copy, with the same result.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_mcore_ckpt.engine import _parallel_reader


def _saved() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "fp32": torch.randn(64, 33, generator=g),
        "bf16": torch.randn(17, 5, generator=g).to(torch.bfloat16),
        "int64": torch.randint(-(2**40), 2**40, (300,), generator=g),
        "transposed": torch.randn(8, 12, generator=g).t(),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "extra": {"lr": 0.1, "names": ["a", "b"]},
    }


def _targets(strided: bool) -> dict[str, Any]:
    like = {k: torch.full_like(v, -7) for k, v in _saved().items() if isinstance(v, torch.Tensor)}
    if strided:  # the tensor loaded into is itself a transposed view
        like["fp32"] = torch.full((33, 64), -7.0).t()
    return {**like, "extra": {"lr": 0.0, "names": []}}


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous-target", "strided-target"])
def test_every_record_loads_exactly(
    tmp_path: Path, threads: int, strided: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = _saved()
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path), thread_count=2))
    direct: list[int] = []
    read_at = _parallel_reader._read_at

    def counted(stream: Any, position: int, target: torch.Tensor) -> None:
        read_at(stream, position, target)
        direct.append(target.data_ptr())

    monkeypatch.setattr(_parallel_reader, "_read_at", counted)
    loaded = _targets(strided)
    dcp.load(loaded, storage_reader=_parallel_reader.ParallelFileSystemReader(tmp_path, threads))
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype
            assert torch.equal(loaded[key], value), key
    assert loaded["extra"] == saved["extra"]
    # Contiguous records into contiguous tensors are read straight into them, each once (the
    # place its head gave is the place its layout confirms); the transposed record and a
    # strided target go through torch.load. The empty tensor has nothing to read.
    names = {t.data_ptr(): k for k, t in loaded.items() if isinstance(t, torch.Tensor)}
    read = sorted(names[ptr] for ptr in direct)
    assert read == sorted(["bf16", "int64", "scalar", *([] if strided else ["fp32"])])


class _Recording(io.FileIO):
    """A shard file that records where each read of it starts, whichever way it is read."""

    starts: list[int]

    def readinto(self, buffer: Any) -> int:
        self.starts.append(self.tell())
        return super().readinto(buffer)


def _record_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Every read of a shard file by the reader, in order: through its stream (what torch.load
    reads) and by position (``os.pread``, ``os.preadv``)."""
    from lightning_mcore_ckpt.storage import remote_files

    starts: dict[str, list[int]] = {}
    names: dict[int, str] = {}

    def open_read(path: Any) -> Any:
        raw = _Recording(str(path), "rb")
        raw.starts = starts.setdefault(Path(path).name, [])
        names[raw.fileno()] = Path(path).name
        return io.BufferedReader(raw)

    pread, preadv = os.pread, os.preadv

    def positioned(fd: int, *args: Any) -> Any:
        if fd in names:
            starts[names[fd]].append(args[-1])
        return (pread if isinstance(args[0], int) else preadv)(fd, *args)

    monkeypatch.setattr(remote_files, "open_read", open_read)
    monkeypatch.setattr(os, "pread", positioned)
    monkeypatch.setattr(os, "preadv", positioned)
    return starts


def test_records_are_read_forward_each_byte_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Records larger than a head and a tail, in one file: each is read head, data, tail, and
    # the file front to back (torch.load alone starts each record at its end, then jumps back).
    g = torch.Generator().manual_seed(1)
    saved = {f"w{i}": torch.randn(100 + i, 64, generator=g) for i in range(4)}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path), thread_count=1))
    starts = _record_reads(monkeypatch)
    read_at = _parallel_reader._read_at
    direct: list[int] = []

    def counted(stream: Any, position: int, target: torch.Tensor) -> None:
        direct.append(target.data_ptr())
        read_at(stream, position, target)

    monkeypatch.setattr(_parallel_reader, "_read_at", counted)
    loaded = {k: torch.zeros_like(v) for k, v in saved.items()}
    dcp.load(loaded, storage_reader=_parallel_reader.ParallelFileSystemReader(tmp_path, 1))
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())
    (positions,) = [v for k, v in starts.items() if k.endswith(".distcp")]
    assert positions == sorted(positions), positions
    assert len(positions) == 3 * len(saved)  # head, data, tail: nothing read twice
    assert sorted(direct) == sorted(t.data_ptr() for t in loaded.values())


def test_a_place_the_layout_does_not_confirm_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A head pointing elsewhere than the record's layout (a record written otherwise): the
    # layout decides, and the tensor is read again from its place.
    from lightning_mcore_ckpt.engine import _record_order

    g = torch.Generator().manual_seed(2)
    saved = {"w": torch.randn(100, 64, generator=g), "v": torch.randn(3000, generator=g)}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path), thread_count=1))
    monkeypatch.setattr(_record_order.Record, "data_start", lambda self: 64)
    reads: list[int] = []
    read_at = _parallel_reader._read_at

    def counted(stream: Any, position: int, target: torch.Tensor) -> None:
        reads.append(position)
        read_at(stream, position, target)

    monkeypatch.setattr(_parallel_reader, "_read_at", counted)
    loaded = {k: torch.zeros_like(v) for k, v in saved.items()}
    dcp.load(loaded, storage_reader=_parallel_reader.ParallelFileSystemReader(tmp_path, 2))
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())
    assert len(reads) == 4  # each record: the wrong place, then its own


def _alike(count: int) -> dict[str, torch.Tensor]:
    """``count`` records of each of four layouts with the same number of bytes: fp32 (32, 16),
    the same shape transposed (other strides), int32 (32, 16) (another dtype), fp32 (16, 32)
    (another shape); and one fp64 record (another length)."""
    g = torch.Generator().manual_seed(3)
    saved: dict[str, torch.Tensor] = {"fp64": torch.randn(32, 16, generator=g).double()}
    for i in range(count):
        saved[f"fp32_{i}"] = torch.randn(32, 16, generator=g)
        saved[f"strided_{i}"] = torch.randn(16, 32, generator=g).t()
        saved[f"int32_{i}"] = torch.randint(-(2**30), 2**30, (32, 16), generator=g).int()
        saved[f"wide_{i}"] = torch.randn(16, 32, generator=g)
    return saved


@pytest.mark.parametrize("threads", [1, 3])
def test_each_distinct_head_is_parsed_once(
    tmp_path: Path, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Records pickled alike (a layer's shards) share one parse of their layout; records alike
    # in bytes but not in layout (strides, dtype, shape) are told apart by their heads.
    from lightning_mcore_ckpt.engine import _record_layouts

    saved = _alike(6)
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path), thread_count=threads))
    parses: list[int] = []
    load = torch.load

    def counted(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("map_location") == "meta":
            parses.append(1)
        return load(*args, **kwargs)

    monkeypatch.setattr(_record_layouts.torch, "load", counted)
    loaded = {k: torch.full_like(v, -7) for k, v in saved.items()}
    dcp.load(loaded, storage_reader=_parallel_reader.ParallelFileSystemReader(tmp_path, threads))
    for key, value in saved.items():
        assert loaded[key].dtype == value.dtype
        assert torch.equal(loaded[key], value), key
    # One parse per layout on one thread; a head parsed on two threads at once costs at most
    # one parse more per thread.
    assert len(parses) == 5 if threads == 1 else 5 <= len(parses) <= 5 * threads


def test_a_record_with_a_known_head_skips_its_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A record whose layout is known is read head and data: its tail (the zip's directory,
    # which only the parse needs) is not read.
    g = torch.Generator().manual_seed(4)
    saved = {f"w{i}": torch.randn(100, 64, generator=g) for i in range(4)}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path), thread_count=1))
    starts = _record_reads(monkeypatch)
    loaded = {k: torch.zeros_like(v) for k, v in saved.items()}
    dcp.load(loaded, storage_reader=_parallel_reader.ParallelFileSystemReader(tmp_path, 1))
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())
    (positions,) = [v for k, v in starts.items() if k.endswith(".distcp")]
    assert positions == sorted(positions), positions
    assert len(positions) == 3 + 2 * (len(saved) - 1)  # the first record's tail only


def test_a_slice_of_a_saved_chunk_is_read_from_its_place(tmp_path: Path) -> None:
    # A load that wants rows 10..20 of a saved tensor (a reshard's partial read).
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    saved = torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6)
    dcp.save({"w": saved}, storage_writer=dcp.FileSystemWriter(str(tmp_path)))
    reader = _parallel_reader.ParallelFileSystemReader(tmp_path, 2)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, is_coordinator=True)
    chunk = metadata.state_dict_metadata["w"].chunks[0]
    assert isinstance(chunk, ChunkStorageMetadata)
    item = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("w", torch.Size([0, 0])),
        dest_offsets=torch.Size([0, 0]),
        storage_index=MetadataIndex("w", chunk.offsets),
        storage_offsets=torch.Size([10, 0]),
        lengths=torch.Size([10, 6]),
    )
    target = torch.zeros(10, 6)

    class Planner:
        def resolve_tensor(self, read_item: Any) -> torch.Tensor:
            return target

        def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
            assert tensor.data_ptr() == target.data_ptr()

    from torch.distributed.checkpoint.planner import LoadPlan

    reader.read_data(LoadPlan([item]), Planner()).wait()
    assert torch.equal(target, saved[10:20])


@pytest.mark.parametrize(
    "nbytes", [1, 4096, 3 * 4096, 3 * 4096 + 17], ids=["byte", "chunk", "chunks", "ragged"]
)
@pytest.mark.parametrize("remote", [False, True], ids=["local-file", "ranged-reads"])
def test_a_record_bounced_through_two_buffers_arrives_whole(
    tmp_path: Path, nbytes: int, remote: bool
) -> None:
    # The device path's chunking, on the host: two buffers of 4 KiB taking turns, a record of
    # one byte, exactly one chunk, several, and several plus a ragged end; from a local file
    # (preadv) and from a stream read by range (a view of a step in an object store).
    import io

    payload = torch.randint(0, 256, (nbytes + 100,), dtype=torch.uint8, generator=None)
    path = tmp_path / "shard"
    path.write_bytes(bytes(payload.tolist()))
    bounce = _parallel_reader.DeviceBounce(torch.device("cpu"), 4096, pinned=False)
    dest = torch.zeros(nbytes, dtype=torch.uint8)
    with open(path, "rb") as f:
        stream = io.BufferedReader(io.BytesIO(f.read())) if remote else f
        bounce.read(stream, 50, dest)
    assert torch.equal(dest, payload[50 : 50 + nbytes])
    # A record beyond the end of the file is an error, not a short read.
    with open(path, "rb") as f, pytest.raises(OSError, match="ends inside a record"):
        bounce.read(f, payload.numel() - 10, torch.zeros(20, dtype=torch.uint8))
