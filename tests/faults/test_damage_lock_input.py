"""Promises 4-7: damaged checkpoints are detected, one writer per directory, bad input is
refused before any work, and nothing outside the layout is deleted."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _faulty import MAX_STEPS, listing, train

from lightning_mcore_ckpt.format import layout, markers, retention
from lightning_mcore_ckpt.storage.lock import LOCK_FILE, DirectoryLock
from lightning_mcore_ckpt.testing import DistributedFailure, run_distributed

pytestmark = pytest.mark.timeout(300)

KEEP_ALL = {"max_to_keep": None}


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A run that saved steps 2, 4 and 6, and what it computed."""
    tmp = tmp_path_factory.mktemp("finished")
    result = run_distributed(train, 1, str(tmp), None, KEEP_ALL, timeout=200)[0]
    return tmp, result


@pytest.fixture
def copy(finished: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    shutil.copytree(finished[0] / "ckpt", tmp_path / "ckpt")
    return tmp_path


def _first_shard(step: Path, sub: str) -> Path:
    return sorted((step / sub).glob("*.distcp"))[0]


# How to damage step 6 -> what the error names.
DAMAGE = {
    "truncated-model-shard": (
        lambda s: os.truncate(_first_shard(s, "model"), 10),
        "is truncated (10 of",
    ),
    "missing-optimizer-shard": (lambda s: _first_shard(s, "optim").unlink(), "is missing"),
    "missing-index": (lambda s: (s / "model" / ".metadata").unlink(), ".metadata is missing"),
    "missing-rank-file": (
        lambda s: (s / "extra" / "rank_00000.pt").unlink(),
        "rank_00000.pt is missing",
    ),
    "truncated-rank-file": (
        lambda s: os.truncate(s / "extra" / "rank_00000.pt", 100),
        "rank_00000.pt is truncated (100 of",
    ),
    "missing-mcore-config": (
        lambda s: (s / "optim" / "metadata.json").unlink(),
        "optim/metadata.json is missing",
    ),
    # Steps committed before their files were listed get the other checks.
    "unlisted-missing-rank-file": (
        lambda s: (_unlisted(s), (s / "extra" / "rank_00000.pt").unlink()),
        "has 0 rank files, the save had 1",
    ),
    "unlisted-truncated-rank-file": (
        lambda s: (_unlisted(s), os.truncate(s / "extra" / "rank_00000.pt", 100)),
        "rank_00000.pt is truncated or damaged",
    ),
    "unlisted-missing-mcore-config": (
        lambda s: (_unlisted(s), (s / "model" / "metadata.json").unlink()),
        "model/metadata.json is missing",
    ),
}


def _unlisted(step: Path) -> None:
    # As committed before files were listed: no list, no digests, no seal.
    meta = markers.read_metadata(step)
    assert meta is not None and "files" in meta
    for field in ("files", "hashes", "metadata_hash"):
        del meta[field]
    (step / markers.METADATA_FILE).write_text(json.dumps(meta))


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_step_is_named_and_last_takes_the_previous_one(
    copy: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    damage, says = DAMAGE[case]
    root = copy / "ckpt"
    step6 = layout.step_dir(root, 6)
    damage(step6)
    problems = layout.verify_step(step6)
    assert any(says in p for p in problems), problems
    with caplog.at_level(logging.WARNING, logger="lightning_mcore_ckpt.format.layout"):
        assert layout.resolve_last(root) == layout.step_dir(root, 4)
    assert f"skipping damaged {step6}" in caplog.text and says in caplog.text
    with pytest.raises(FileNotFoundError) as err:
        layout.resolve_checkpoint(step6)
    message = str(err.value)
    assert f"checkpoint {step6} is damaged" in message and says in message
    assert "complete undamaged steps in" in message and "global_step_2, global_step_4." in message


def test_corrupt_metadata_or_garbage_tracker_fall_back_to_the_scan(
    copy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = copy / "ckpt"
    (root / layout.TRACKER_FILE).write_text("garbage\x00\n")
    with caplog.at_level(logging.WARNING, logger="lightning_mcore_ckpt.format.layout"):
        assert layout.resolve_last(root) == layout.step_dir(root, 6)
    assert "is unreadable; newest complete step by scan: global_step_6" in caplog.text
    (layout.step_dir(root, 6) / markers.METADATA_FILE).write_text('{"global_step": 6, ')
    assert layout.resolve_last(root) == layout.step_dir(root, 4)
    with pytest.raises(FileNotFoundError, match=r"global_step_6 is incomplete .*global_step_4"):
        layout.resolve_checkpoint(layout.step_dir(root, 6))


def _resume(rank: int, world_size: int, tmp: str, ckpt_path: str) -> dict[str, Any]:
    try:
        return train(rank, world_size, tmp, None, {"max_to_keep": None, "ckpt_path": ckpt_path})
    except FileNotFoundError as err:
        return {"error": str(err)}


def test_a_real_resume_skips_the_damaged_newest_step_and_continues_exactly(
    copy: Path, finished: tuple[Path, dict[str, Any]]
) -> None:
    step6 = layout.step_dir(copy / "ckpt", 6)
    shard = _first_shard(step6, "model")
    os.truncate(shard, 10)
    # Asked for explicitly: refused, naming the file and what remains.
    (refused,) = run_distributed(_resume, 1, str(copy), str(step6), timeout=200)
    assert f"{shard} is truncated" in refused["error"]
    assert "global_step_2, global_step_4" in refused["error"]
    # "last": resumes from step 4, and computes what the uninterrupted run computed.
    (resumed,) = run_distributed(_resume, 1, str(copy), "last", timeout=200)
    reference = finished[1]
    assert resumed["start"] == 4 and resumed["end"] == MAX_STEPS
    for got, want in zip(resumed["losses"], reference["losses"][4:], strict=True):
        assert torch.equal(got, want)


# --- one writer per directory -------------------------------------------------------------


def _lock_for(pid: int, host: str | None = None) -> str:
    import psutil

    return json.dumps(
        {
            "host": host or socket.gethostname(),
            "pid": pid,
            "create_time": psutil.Process(pid).create_time() if host is None else 0.0,
            "started_at": "2026-11-22T00:00:00+00:00",
        }
    )


def _try_fit(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    try:
        return train(rank, world_size, tmp, None, {"max_steps": 2})
    except RuntimeError as err:
        return {"error": str(err)}


def test_a_second_writer_is_refused_and_a_dead_ones_lock_is_recovered(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (root / LOCK_FILE).write_text(_lock_for(other.pid))
        (refused,) = run_distributed(_try_fit, 1, str(tmp_path), timeout=200)
        assert (
            f"is in use by another run (pid {other.pid} on {socket.gethostname()}"
            in (refused["error"])
        )
        assert f"if it is dead, delete {root / LOCK_FILE}" in refused["error"]
        assert listing(tmp_path) == [LOCK_FILE]  # nothing was written
    finally:
        other.kill()
        other.wait()
    (ran,) = run_distributed(_try_fit, 1, str(tmp_path), timeout=200)
    assert ran["end"] == 2  # the dead owner's lock was recovered
    assert listing(tmp_path) == ["global_step_2", layout.TRACKER_FILE]


def test_a_lock_from_another_host_is_honoured_until_its_heartbeat_stops(tmp_path: Path) -> None:
    lock_file = tmp_path / LOCK_FILE
    lock_file.write_text(_lock_for(12345, host="another-node"))
    with pytest.raises(RuntimeError, match="in use by another run \\(pid 12345 on another-node"):
        DirectoryLock(tmp_path, stale_after_s=300).acquire()
    stale = time.time() - 301
    os.utime(lock_file, (stale, stale))
    lock = DirectoryLock(tmp_path, stale_after_s=300)
    lock.acquire()
    assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    with pytest.raises(RuntimeError, match=f"pid {os.getpid()}"):
        DirectoryLock(tmp_path).acquire()  # a live owner on this host: refused
    lock.release()
    assert not lock_file.exists()


# --- bad input ------------------------------------------------------------------------------


def _bad_loads(rank: int, world_size: int, tmp: str) -> dict[str, str]:
    out = {}
    for name, options in (
        ("missing", {"ckpt_path": str(Path(tmp, "ckpt", "global_step_99"))}),
        ("shapes", {"ckpt_path": str(Path(tmp, "ckpt", "global_step_6")), "num_layers": 3}),
    ):
        try:
            train(rank, world_size, tmp, None, {**options, "max_to_keep": None})
        except (FileNotFoundError, ValueError) as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out


def test_bad_checkpoint_paths_and_shapes_are_refused_clearly(copy: Path) -> None:
    before = listing(copy)
    (errors,) = run_distributed(_bad_loads, 1, str(copy), timeout=200)
    assert errors["missing"].startswith("FileNotFoundError: checkpoint path ")
    assert "global_step_99 does not exist" in errors["missing"]
    assert "complete steps in" in errors["missing"]
    assert "global_step_2, global_step_4, global_step_6" in errors["missing"]
    assert errors["shapes"].startswith("ValueError: checkpoint ")
    assert "does not fit the model: gpt.decoder.layers." in errors["shapes"]
    assert "has shape [2, " in errors["shapes"] and "but [3, " in errors["shapes"]
    assert listing(copy) == before  # nothing written, nothing deleted


def _indivisible(rank: int, world_size: int, tmp: str) -> None:
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    strategy = MegatronStrategy(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    make_trainer(2, strategy, world_size).fit(TinyGPTModule(), train_dataloaders=loader(8))


def test_a_world_size_that_the_layout_does_not_divide_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DistributedFailure, match="world size 2 is not divisible by"):
        run_distributed(_indivisible, 2, str(tmp_path), timeout=200)


def test_dirpath_must_be_writable_and_new_options_are_checked(tmp_path: Path) -> None:
    from lightning_mcore_ckpt import MegatronCheckpoint

    with pytest.raises(
        ValueError, match=r"dirpath='/proc/checkpoints'\): cannot write under /proc"
    ):
        MegatronCheckpoint("/proc/checkpoints")
    with pytest.raises(ValueError, match=r"on_save_error='ignore'\): use 'raise'"):
        MegatronCheckpoint(tmp_path / "c", on_save_error="ignore")
    with pytest.raises(ValueError, match=r"save_on_preemption=1\): must be True/False"):
        MegatronCheckpoint(tmp_path / "c", save_on_preemption=1)  # type: ignore[arg-type]
    assert not (tmp_path / "c").exists()


def test_nothing_without_this_packages_marker_is_deleted(tmp_path: Path) -> None:
    foreign = layout.step_dir(tmp_path, 3)
    (foreign / "model").mkdir(parents=True)
    (foreign / "model" / "data.bin").write_bytes(b"user data")
    with pytest.raises(ValueError, match="has no lightning-mcore-ckpt marker"):
        retention.remove_step(foreign)
    assert (foreign / "model" / "data.bin").read_bytes() == b"user data"
    assert not markers.is_ours(foreign)
    markers.mark_step_started(layout.step_dir(tmp_path, 5))
    assert markers.is_ours(layout.step_dir(tmp_path, 5))
    retention.remove_step(layout.step_dir(tmp_path, 5))
    assert not layout.step_dir(tmp_path, 5).exists()
