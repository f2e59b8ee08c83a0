"""A save's ``.metadata`` written ahead with its shards (``_metadata_ahead``): while every
rank's write results are those of the part's last finalisation, the finalisation skips
Megatron-Core's gather and ``.metadata`` write; whenever any rank's differ, it gathers and
writes as before. Either way each part's ``.metadata`` indexes exactly the records written.

Axes, on 2 gloo ranks with data parallelism (Megatron-Core's fully parallel save), four saves
of a Trainer run:
- mode: async (written ahead by the background write), sync (by the inline write);
- which rank's records move at the second save (8 bytes written before one record of each of
  its files, as a record whose size changed would move them): none, the coordinator (rank 0),
  another rank (rank 1);
- which part's records move: ``model/``, ``optim/``;
every pair of the three in six cells. And, in both modes, rank 0's write ahead fails at the
third save (the finalisation writes ``.metadata`` itself).

Each cell asserts, on every rank, which saves were finalised by Megatron-Core (its gather: the
first save, the moved one and the one after it, whose records moved back), how often rank 0
wrote ``.metadata`` ahead, and for every committed step and part that its ``.metadata``
indexes exactly the records every rank wrote (file, offset, length of each).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

EVERY = 2
SAVES = 4
MOVED_AT = 1  # the save (0-based) whose records move
AHEAD_FAILS_AT = 2


def _run(
    rank: int, world_size: int, root: str, async_save: bool, moved: str | None, case: str
) -> dict[str, Any]:
    import threading

    import torch
    from _trainer import loader, make_trainer
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.engine import _metadata_ahead, _shards
    from lightning_mcore_ckpt.format import layout
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    save_index = {"n": -1}
    finalised_by_mcore: list[int] = []  # per save: this rank's retrievals of its write results
    written_ahead: list[int] = []  # per save: .metadata written on the background thread
    records: dict[int, dict[str, list[Any]]] = {}  # per save, per part: this rank's results

    writer_class = filesystem_async.FileSystemWriterAsync
    retrieve, finish = writer_class.retrieve_write_results, writer_class.finish

    def counted_retrieve(self: Any) -> Any:
        finalised_by_mcore[-1] += 1
        return retrieve(self)

    ahead = threading.local()  # set while a SaveAhead checks its records (and writes ahead)
    check = _metadata_ahead.SaveAhead.written

    def watched_check(self: Any) -> bool:
        ahead.inside = True
        try:
            return check(self)
        finally:
            ahead.inside = False

    def watched_finish(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(ahead, "inside", False):
            if case == "ahead-fails" and save_index["n"] == AHEAD_FAILS_AT:
                raise OSError("no space left on device (injected into the write ahead)")
            written_ahead[-1] += 1
        return finish(self, *args, **kwargs)

    _metadata_ahead.SaveAhead.written = watched_check  # type: ignore[method-assign]
    writer_class.retrieve_write_results = counted_retrieve
    writer_class.finish = watched_finish

    # A record moved: 8 bytes before the first record of each of this rank's files of the part.
    write_item = filesystem_async._write_item
    padded: set[str] = set()

    def moving_write_item(*args: Any, **kwargs: Any) -> Any:
        stream = next(a for a in args if hasattr(a, "digest") and hasattr(a, "tell"))
        part = Path(stream.name).parent.name
        if moved is not None and save_index["n"] == MOVED_AT and part == moved.split(":")[1]:
            if int(moved.split(":")[0]) == rank and stream.name not in padded:
                padded.add(stream.name)
                stream.write(b"\0" * 8)
        return write_item(*args, **kwargs)

    filesystem_async._write_item = moving_write_item

    shard_write = _shards.ShardWriter.write

    def recorded_write(self: Any, jobs: Any, *args: Any, **kwargs: Any) -> Any:
        out = shard_write(self, jobs, *args, **kwargs)
        records[save_index["n"]] = {
            job.name: [r for part in job.results.last.values() for r in part] for job in jobs
        }
        return out

    _shards.ShardWriter.write = recorded_write

    strategy = MegatronStrategy(ckpt_async_save=async_save)
    writer = strategy._writer
    save = writer.save

    def counted_save(*args: Any, **kwargs: Any) -> Any:
        writer.finalize(blocking=True)  # the previous save's finalisation is not this one's
        save_index["n"] += 1
        finalised_by_mcore.append(0)
        written_ahead.append(0)
        out = save(*args, **kwargs)
        writer.finalize(blocking=True)
        return out

    writer.save = counted_save  # type: ignore[method-assign]
    callback = MegatronCheckpoint(
        Path(root, "ckpt"), every_n_train_steps=EVERY, save_last=False, save_top_k=-1
    )
    trainer = make_trainer(
        SAVES * EVERY, strategy, world_size, callbacks=[callback], enable_checkpointing=True
    )
    torch.manual_seed(0)
    trainer.fit(TinyGPTModule(), train_dataloaders=loader(64, 2))
    return {
        "finalised_by_mcore": finalised_by_mcore,
        "written_ahead": written_ahead,
        "records": records,
        "padded": len(padded),
        "committed": [s.path.name for s in layout.complete_steps(Path(root, "ckpt"))],
    }


def _check(tmp_path: Path, results: list[dict[str, Any]], moved: str | None, case: str) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    steps = [f"global_step_{EVERY * (i + 1)}" for i in range(SAVES)]
    gathered = {0}  # the first save: nothing kept yet
    if moved is not None:
        gathered |= {MOVED_AT, MOVED_AT + 1}  # moved, then moved back
    elif case == "ahead-fails":
        gathered |= {AHEAD_FAILS_AT}
    for rank, out in enumerate(results):
        assert out["committed"] == steps, (rank, out["committed"])
        expected = [2 if i in gathered else 0 for i in range(SAVES)]  # model/ and optim/
        assert out["finalised_by_mcore"] == expected, (rank, out["finalised_by_mcore"])
        # Rank 0 writes a part's .metadata ahead whenever its own records of the part are the
        # kept ones (from the second save on), whatever the other ranks' turn out to be.
        mine_moved = moved is not None and moved.startswith("0:")
        ahead = [
            0 if i == 0 or rank != 0 else 1 if mine_moved and i - MOVED_AT in (0, 1) else 2
            for i in range(SAVES)
        ]
        if case == "ahead-fails":
            ahead[AHEAD_FAILS_AT] = 0
        assert out["written_ahead"] == ahead, (rank, out["written_ahead"])
        mover = moved is not None and int(moved.split(":")[0]) == rank
        assert (out["padded"] > 0) == mover, (rank, out["padded"])
    # Each part's .metadata indexes exactly the records every rank wrote at that save.
    for index, step in enumerate(steps):
        for part in ("model", "optim"):
            metadata = FileSystemReader(str(tmp_path / "ckpt" / step / part)).read_metadata()
            written = {
                result.index: result.storage_data
                for out in results
                for result in out["records"][index].get(part, [])
            }
            assert metadata.storage_data == written, (step, part)


@pytest.mark.parametrize(
    ("async_save", "moved"),
    [
        (True, None),
        (True, "0:model"),
        (True, "1:optim"),
        (False, "1:model"),
        (False, "0:optim"),
        (False, None),
    ],
    ids=[
        "async",
        "async-rank0-model",
        "async-rank1-optim",
        "sync-rank1-model",
        "sync-rank0-optim",
        "sync",
    ],
)
def test_metadata_indexes_the_records_written_whether_written_ahead_or_gathered(
    tmp_path: Path, async_save: bool, moved: str | None
) -> None:
    results = run_distributed(_run, 2, str(tmp_path), async_save, moved, "", timeout=240)
    _check(tmp_path, results, moved, "")


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_failed_write_ahead_leaves_the_finalisation_to_write_the_metadata(
    tmp_path: Path, async_save: bool
) -> None:
    results = run_distributed(_run, 2, str(tmp_path), async_save, None, "ahead-fails", timeout=240)
    _check(tmp_path, results, None, "ahead-fails")
