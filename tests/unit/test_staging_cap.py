"""``MegatronStrategy(ckpt_max_staging_bytes=...)``: the option's checks, and the bounded staging
of our shard writer on real files, without processes.

The writer gets save requests shaped as Megatron-Core plans them (each part's shard files, each
file's tensors, torch DCP's write items and transforms) and writes them with its thread pool;
every record is read back and compared with the tensor at the save, which is changed as soon as
the save returns. Axes: cap (below the smallest tensor; between; above the largest tensor and
below the state; above the state) x write threads (1, 2, 3) x sync/async, every pair; then a
failing write, a failing copy and an abort, each while the ring is full.
"""

from __future__ import annotations

import functools
import io
import itertools
import queue
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt import MegatronStrategy
from lightning_mcore_ckpt.errors import ConfigurationError

pytestmark = pytest.mark.timeout(120)

# --- the option ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ckpt_max_staging_bytes": 0}, r"ckpt_max_staging_bytes=0\): must be a positive int"),
        ({"ckpt_max_staging_bytes": -1}, r"ckpt_max_staging_bytes=-1\): must be a positive"),
        ({"ckpt_max_staging_bytes": 2.5e9}, r"ckpt_max_staging_bytes=2500000000.0\): must be"),
        ({"ckpt_max_staging_bytes": True}, r"ckpt_max_staging_bytes=True\): must be"),
        ({"ckpt_max_staging_bytes": "8G"}, r"ckpt_max_staging_bytes='8G'\): .* or None"),
        (
            {"ckpt_max_staging_bytes": 2**30, "ckpt_writer": "megatron"},
            r"ckpt_max_staging_bytes=1073741824, ckpt_writer='megatron'\): Megatron-Core's "
            r"writer copies the whole state .* use ckpt_writer='threads'",
        ),
    ],
)
def test_a_bad_cap_is_refused_naming_the_argument_and_the_fix(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        MegatronStrategy(**kwargs)


def test_the_cap_reaches_the_writer_and_is_unbounded_by_default() -> None:
    assert MegatronStrategy()._writer.shards.bounded is None
    strategy = MegatronStrategy(ckpt_max_staging_bytes=2**20, ckpt_async_save=False)
    assert strategy.config.ckpt_max_staging_bytes == 2**20
    assert strategy._writer.shards.bounded is not None
    assert strategy._writer.shards.bounded.max_bytes == 2**20


# --- the writer, on real files ----------------------------------------------------------------

FLOAT = 4
# Two parts (model, optim) of 3 and 2 files: tensor sizes in floats.
PARTS = {"m": [[100, 2000, 300], [50, 400, 400, 10], [0, 700]], "o": [[1000, 10], [1500]]}
LARGEST = 2000 * FLOAT
TOTAL = sum(n for files in PARTS.values() for sizes in files for n in sizes) * FLOAT
CAPS = {
    "below-smallest": 16,
    "between": 3000,
    "above-largest": 10_000,
    "above-state": 10 * TOTAL,
}


class _Request:
    """What the writer reads of Megatron-Core's save request of one part."""

    def __init__(self, buckets: list[Any]) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms

        self.async_fn = functools.partial(print, [_StorageWriterTransforms()])
        self.results: queue.Queue[Any] = queue.Queue()
        self.async_fn_args = (0, buckets, self.results)
        self.finalize_fns: list[Any] = []


def _save(directory: Path, seed: int) -> tuple[list[tuple[str, _Request]], dict[str, Any]]:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    generator = torch.Generator().manual_seed(seed)
    requests, sources = [], {}
    for part, files in PARTS.items():
        buckets = []
        for f, sizes in enumerate(files):
            tensors = []
            for i, n in enumerate(sizes):
                key = f"{part}.{f}.{i}"
                sources[key] = torch.randn(n, generator=generator)
                item = WriteItem(index=MetadataIndex(key), type=WriteItemType.TENSOR)
                tensors.append((item, sources[key]))
            name = f"__0_{part}{f}.distcp"
            buckets.append((str(directory / name), name, ([], tensors)))
        requests.append((part, _Request(buckets)))
    return requests, sources


LAST = "o.1.0"
"""The last tensor staged: its write waits until training changed the sources."""


def _run(writer: Any, requests: list[tuple[str, _Request]], snapshot: bool) -> list[Any]:
    """Stage (this thread), then write as the background thread would; a deadlock fails."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from lightning_mcore_ckpt import _compat

    timer = torch.zeros(1, dtype=torch.float64)
    done: list[Any] = []
    changed = threading.Event()
    stock = filesystem_async._write_item

    def last_written_after_the_change(*args: Any, **kwargs: Any) -> Any:
        if args[3].index.fqn == LAST:  # (transforms, stream, data, item, ...)
            assert changed.wait(30)
        return stock(*args, **kwargs)

    def save() -> None:
        request = writer.request(requests, timer, snapshot, _compat.builtin_request_class())
        done.append(request)

    filesystem_async._write_item = last_written_after_the_change
    try:
        stager = threading.Thread(target=save)
        stager.start()
        stager.join(60)
        assert done, "staging did not return"
        # Training goes on: every source changes before the write is run (and, bounded, before
        # the last tensor is written).
        for _, req in requests:
            for _, _, (_, tensors) in req.async_fn_args[1]:
                for _, tensor in tensors:
                    tensor.add_(1.0)
        changed.set()
        request = done[0]
        request.async_fn(*request.async_fn_args)
        return [req.results.get(timeout=60) for _, req in requests]
    finally:
        changed.set()
        filesystem_async._write_item = stock


def _read_back(directory: Path, results: list[Any]) -> dict[str, torch.Tensor]:
    read = {}
    for per_file in results:
        assert not isinstance(per_file, BaseException), per_file
        for write_results in per_file.values():
            for result in write_results:
                info = result.storage_data
                raw = (directory / info.relative_path).read_bytes()
                record = raw[info.offset : info.offset + info.length]
                read[result.index.fqn] = torch.load(io.BytesIO(record))
    return read


PAIRS = [
    (cap, threads, snapshot)
    for cap, threads, snapshot in itertools.product(CAPS, (1, 2, 3), (True, False))
]


@pytest.mark.parametrize(
    ("cap", "threads", "snapshot"),
    PAIRS,
    ids=[f"{c}-{t}threads-{'async' if s else 'sync'}" for c, t, s in PAIRS],
)
def test_a_bounded_save_writes_the_snapshot_holding_at_most_the_cap_at_once(
    tmp_path: Path, cap: str, threads: int, snapshot: bool
) -> None:
    from lightning_mcore_ckpt.engine._shards import ShardWriter

    writer = ShardWriter(threads, max_staging_bytes=CAPS[cap])
    try:
        for save in range(2):  # the second save reuses the ring
            directory = tmp_path / f"save{save}"
            directory.mkdir()
            requests, sources = _save(directory, seed=save)
            expected = {key: tensor.clone() for key, tensor in sources.items()}
            if not snapshot:  # a sync save writes CPU tensors where they are: after the change
                expected = {key: tensor + 1.0 for key, tensor in expected.items()}
            read = _read_back(directory, _run(writer, requests, snapshot))
            assert sorted(read) == sorted(expected)
            for key, tensor in expected.items():
                assert torch.equal(read[key], tensor), key
            bounded = writer.bounded
            if not snapshot:
                assert bounded.nbytes == 0 and bounded.allocations == 0  # nothing copied
                continue
            # At most the cap held at once, but for one tensor larger than the cap, alone.
            peak = bounded.latest.peak_bytes
            assert 0 < peak <= max(CAPS[cap], LARGEST + 64), peak
            if CAPS[cap] < TOTAL:
                assert peak <= max(CAPS[cap], LARGEST + 64) < TOTAL
            assert bounded.nbytes <= CAPS[cap] + LARGEST + 64
            assert bounded.allocations == 1  # allocated at the first save, reused
    finally:
        writer.close()


# --- failures while the ring is full -----------------------------------------------------------


def _bounded_writer(threads: int = 2) -> Any:
    from lightning_mcore_ckpt.engine._shards import ShardWriter

    return ShardWriter(threads, max_staging_bytes=CAPS["between"])


def test_a_failed_write_stops_the_save_and_is_reported_and_the_next_save_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    stock = filesystem_async._write_item

    def failing(transforms: Any, stream: Any, data: Any, item: Any, *args: Any, **kw: Any) -> Any:
        if item.index.fqn == "m.1.1":  # the second file, while the ring is full
            raise OSError(errno.EIO, "Input/output error")
        return stock(transforms, stream, data, item, *args, **kw)

    writer = _bounded_writer()
    try:
        (tmp_path / "bad").mkdir()
        monkeypatch.setattr(filesystem_async, "_write_item", failing)
        results = _run(writer, _save(tmp_path / "bad", seed=0)[0], snapshot=True)
        # Every part fails, naming the cause (the other part's files were stopped by it).
        for result in results:
            assert isinstance(result, OSError | RuntimeError), result
            assert "Input/output error" in str(result), result
        monkeypatch.setattr(filesystem_async, "_write_item", stock)
        (tmp_path / "good").mkdir()
        requests, sources = _save(tmp_path / "good", seed=1)
        expected = {key: tensor.clone() for key, tensor in sources.items()}
        read = _read_back(tmp_path / "good", _run(writer, requests, snapshot=True))
        assert all(torch.equal(read[k], t) for k, t in expected.items())
        assert writer.bounded.allocations == 1
    finally:
        writer.close()


def test_a_failed_copy_stops_the_save_and_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_mcore_ckpt.engine import _staging

    stock = _staging.copy_to_host
    copies = itertools.count()

    def failing(buffer: torch.Tensor, source: torch.Tensor, non_blocking: bool) -> None:
        if next(copies) == 5:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        stock(buffer, source, non_blocking)

    monkeypatch.setattr(_staging, "copy_to_host", failing)
    writer = _bounded_writer()
    try:
        for result in _run(writer, _save(tmp_path, seed=0)[0], snapshot=True):
            assert isinstance(result, RuntimeError), result
            assert "illegal memory access" in str(result), result
    finally:
        writer.close()


def test_an_abort_while_staging_waits_stops_every_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from lightning_mcore_ckpt import _compat
    from lightning_mcore_ckpt.engine._shards import WriteAborted

    stock = filesystem_async._write_item
    writing = threading.Event()
    let_go = threading.Event()

    def held(*args: Any, **kwargs: Any) -> Any:
        writing.set()
        assert let_go.wait(30)
        return stock(*args, **kwargs)

    monkeypatch.setattr(filesystem_async, "_write_item", held)
    writer = _bounded_writer()
    try:
        requests = _save(tmp_path, seed=0)[0]
        timer = torch.zeros(1, dtype=torch.float64)
        done: list[Any] = []

        def save() -> None:
            done.append(writer.request(requests, timer, True, _compat.builtin_request_class()))

        stager = threading.Thread(target=save)
        stager.start()
        assert writing.wait(30)
        writer.abort()  # the ring is full and the writers held: the staging waits
        stager.join(30)
        assert done, "staging did not stop"
        let_go.set()
        done[0].async_fn(*done[0].async_fn_args)
        for _, req in requests:
            result = req.results.get(timeout=30)
            assert isinstance(result, WriteAborted), result
        writer.resume()
    finally:
        let_go.set()
        writer.close()
