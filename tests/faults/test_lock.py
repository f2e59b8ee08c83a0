"""Promise 5, one writer per directory: how the lock changes hands.

Real processes and real files: processes racing for one stale lock, locks written as a run on
another host writes them, a heartbeat thread whose lock was taken over, and a training run
whose lock is taken over between two saves.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _locks import OTHER_HOST, race, write_lock

from lightning_mcore_ckpt.format import layout
from lightning_mcore_ckpt.storage.lock import JOB_ID_ENV, LOCK_FILE, DirectoryLock, job_identity

pytestmark = pytest.mark.timeout(300)

SCHEDULER_ENV = (
    JOB_ID_ENV,
    "SLURM_JOB_ID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "TORCHELASTIC_RUN_ID",
)


@pytest.fixture(autouse=True)
def outside_a_job(monkeypatch: pytest.MonkeyPatch) -> None:
    # The machine running the tests may itself run them inside a SLURM job.
    for name in SCHEDULER_ENV:
        monkeypatch.delenv(name, raising=False)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# --- racing -------------------------------------------------------------------------------

RACERS = 6
ROUNDS = 20


@pytest.mark.parametrize(
    "left",
    ["nothing", "a dead process here", "a stale heartbeat elsewhere", "the same job elsewhere"],
)
def test_of_processes_racing_for_a_lock_exactly_one_wins_every_round(
    tmp_path: Path, left: str
) -> None:
    """Six processes start together, round after round, on a directory holding ``left``: one
    takes the lock, every other one is refused naming it, and no claim or temporary file is
    left behind."""
    job = "slurm:4242" if left == "the same job elsewhere" else None
    ctx = multiprocessing.get_context("spawn")
    start, done, results = ctx.Barrier(RACERS + 1), ctx.Barrier(RACERS + 1), ctx.Queue()
    racers = [
        ctx.Process(target=race, args=(str(tmp_path), job, start, done, ROUNDS, results))
        for _ in range(RACERS)
    ]
    for p in racers:
        p.start()
    lock_file = tmp_path / LOCK_FILE
    try:
        for number in range(ROUNDS):
            lock_file.unlink(missing_ok=True)
            if left == "a dead process here":
                write_lock(tmp_path, pid=_dead_pid(), host=socket.gethostname())
            elif left == "a stale heartbeat elsewhere":
                write_lock(tmp_path, heartbeat_age_s=301)
            elif left == "the same job elsewhere":
                write_lock(tmp_path, job_id=job)
            start.wait(timeout=120)
            outcomes = {
                pid: outcome for _, pid, outcome in (results.get(timeout=120) for _ in racers)
            }
            winners = [pid for pid, outcome in outcomes.items() if outcome == "won"]
            assert len(winners) == 1, (number, outcomes)
            holder = f"is in use by another run (pid {winners[0]} on {socket.gethostname()},"
            for pid, outcome in outcomes.items():
                assert pid == winners[0] or holder in outcome, (number, outcome)
            assert json.loads(lock_file.read_text())["pid"] == winners[0]
            assert sorted(os.listdir(tmp_path)) == [LOCK_FILE]
            done.wait(timeout=120)
    finally:
        for p in racers:
            p.kill()
            p.join()


# --- a requeued job, another job ----------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "identity"),
    [
        ({}, None),
        ({"SLURM_JOB_ID": "4242"}, "slurm:4242"),
        (
            {"SLURM_JOB_ID": "4250", "SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "7"},
            "slurm:4242_7",
        ),
        ({"TORCHELASTIC_RUN_ID": "run-9"}, "torchelastic:run-9"),
        ({"TORCHELASTIC_RUN_ID": "none"}, None),  # torchrun's default: every job has it
        ({JOB_ID_ENV: "exp-1", "SLURM_JOB_ID": "4242"}, "exp-1"),
    ],
)
def test_the_job_identity_is_the_schedulers_own_or_the_one_named(
    env: dict[str, str], identity: str | None
) -> None:
    assert job_identity(env) == identity


@pytest.mark.parametrize(
    "env",
    [
        {"SLURM_JOB_ID": "4242"},
        {"SLURM_JOB_ID": "5001", "SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "7"},
        {"TORCHELASTIC_RUN_ID": "4242"},
        {JOB_ID_ENV: "my-experiment"},
    ],
    ids=["slurm", "slurm-array", "torchelastic", "named"],
)
def test_a_requeued_job_takes_over_its_lock_from_another_host_at_once(
    tmp_path: Path,
    env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    job = job_identity()
    write_lock(tmp_path, job_id=job)  # its heartbeat is fresh: the node was just lost
    lock = DirectoryLock(tmp_path)
    with caplog.at_level(logging.WARNING, logger="lightning_mcore_ckpt"):
        lock.acquire()
    held = json.loads((tmp_path / LOCK_FILE).read_text())
    assert (held["pid"], held["host"], held["job_id"]) == (os.getpid(), socket.gethostname(), job)
    assert f"from a run that is gone (pid 4242 on {OTHER_HOST}, job {job}," in caplog.text
    lock.release()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("theirs", "ours"),
    [("slurm:4243", {"SLURM_JOB_ID": "4242"}), (None, {})],
    ids=["another-job", "no-job-identity"],
)
def test_a_live_lock_of_another_job_is_refused_naming_its_holder(
    tmp_path: Path, theirs: str | None, ours: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in ours.items():
        monkeypatch.setenv(name, value)
    before = write_lock(tmp_path, job_id=theirs, heartbeat_age_s=200)
    with pytest.raises(RuntimeError) as refused:
        DirectoryLock(tmp_path, stale_after_s=300).acquire()
    message = str(refused.value)
    holder = f"in use by another run (pid 4242 on {OTHER_HOST}, job {theirs}, since "
    assert holder in message
    assert re.search(r"heartbeat 20\ds ago", message)
    assert f"this run's job: {job_identity()}" in message
    assert f"if it is dead, delete {tmp_path / LOCK_FILE}" in message
    assert (tmp_path / LOCK_FILE).read_bytes() == before
    assert os.listdir(tmp_path) == [LOCK_FILE]


def test_the_same_job_does_not_take_over_from_a_process_here_that_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A requeue ends the previous incarnation: one that still runs on this host is another
    writer (e.g. a second launch inside the same allocation), refused; once it dies, its lock is
    taken at once."""
    monkeypatch.setenv(JOB_ID_ENV, "exp-1")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from lightning_mcore_ckpt.storage.lock import DirectoryLock; "
            f"DirectoryLock({str(tmp_path)!r}).acquire(); print('held', flush=True); "
            "time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(RuntimeError, match=f"pid {holder.pid} on .*, job exp-1,"):
            DirectoryLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = DirectoryLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


# --- a holder that lost the lock ----------------------------------------------------------


def test_a_heartbeat_that_lost_its_lock_leaves_the_new_holders_lock_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lock_file = tmp_path / LOCK_FILE
    lock = DirectoryLock(tmp_path)
    lock.acquire()
    old = time.time() - 100
    os.utime(lock_file, (old, old))
    with caplog.at_level(logging.ERROR, logger="lightning_mcore_ckpt"):
        lock.start_heartbeat(every_s=0.02)
        deadline = time.monotonic() + 30
        while lock_file.stat().st_mtime < old + 50 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lock_file.stat().st_mtime > old + 50  # its own lock: refreshed
        lock.check()

        theirs = write_lock(tmp_path, job_id="slurm:99", heartbeat_age_s=200)
        theirs_mtime = lock_file.stat().st_mtime
        time.sleep(0.5)  # some 25 heartbeats
        assert lock_file.read_bytes() == theirs
        assert lock_file.stat().st_mtime == theirs_mtime  # not refreshed by the loser
        assert lock.lost is not None and f"pid 4242 on {OTHER_HOST}, job slurm:99" in lock.lost
        with pytest.raises(RuntimeError, match=r"this run lost the lock of .*another run holds"):
            lock.check()
        lock.release()
    assert lock_file.read_bytes() == theirs
    assert "this run lost the lock" in caplog.text


def test_a_release_while_another_run_takes_the_lock_over_leaves_theirs(tmp_path: Path) -> None:
    lock = DirectoryLock(tmp_path)
    lock.acquire()
    theirs = write_lock(tmp_path, job_id="slurm:99")
    lock.release()  # no heartbeat noticed it: the release itself must look
    assert (tmp_path / LOCK_FILE).read_bytes() == theirs


def _fit_until_error(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    from _faulty import train

    try:
        return train(rank, world_size, tmp, None, {"max_steps": 6, "steal_lock_at": 3})
    except RuntimeError as err:
        return {"error": str(err)}


def test_a_run_whose_lock_was_taken_over_writes_no_more_steps(tmp_path: Path) -> None:
    """Between the saves of steps 2 and 4, a requeue of the job takes the lock over from
    another host: the save of step 4 fails, naming the new holder, before anything is written,
    and the run leaves that holder's lock alone."""
    from _faulty import listing

    from lightning_mcore_ckpt.testing import run_distributed

    (result,) = run_distributed(_fit_until_error, 1, str(tmp_path), timeout=200)
    assert "error" in result, "the run went on saving after its lock was taken over"
    assert "this run lost the lock" in result["error"]
    assert f"pid 4242 on {OTHER_HOST}, job slurm:4242" in result["error"]
    root = tmp_path / "ckpt"
    assert listing(tmp_path) == [LOCK_FILE, "global_step_2", layout.TRACKER_FILE]
    assert layout.read_tracker(root) == 2
    assert json.loads((root / LOCK_FILE).read_text())["job_id"] == "slurm:4242"


def test_a_claim_left_by_a_run_killed_while_releasing_its_lock_does_not_block_the_next(
    tmp_path: Path,
) -> None:
    """Killed between taking the claim on its own lock and removing the lock (a scheduler's
    SIGKILL at the end of a job): the next run takes over at once and the claim is gone."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from lightning_mcore_ckpt.storage.lock import DirectoryLock; "
            f"lock = DirectoryLock({str(tmp_path)!r}); lock.acquire(); "
            "assert lock._create(lock._claim_path(lock._data), lock._data); "
            "print('claimed', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "claimed\n"
    finally:
        holder.kill()
        holder.wait()
    assert len(list(tmp_path.glob(f"{LOCK_FILE}.claim-*"))) == 1
    started = time.monotonic()
    lock = DirectoryLock(tmp_path)
    lock.acquire()
    assert time.monotonic() - started < 5  # not the 10 s wait for a live claimant
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert list(tmp_path.glob(f"{LOCK_FILE}.claim-*")) == []
    lock.release()


def test_an_old_claim_from_another_host_does_not_block_the_next_run(tmp_path: Path) -> None:
    data = write_lock(tmp_path, heartbeat_age_s=3600)  # another host's, stale
    claim = tmp_path / f"{LOCK_FILE}.claim-{hashlib.sha256(data).hexdigest()[:16]}"
    claim.write_bytes(data.replace(b"4242", b"4343"))  # a takeover by another host, never done
    old = time.time() - 3600
    os.utime(claim, (old, old))
    lock = DirectoryLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not claim.exists()
    lock.release()


def test_a_temporary_lock_file_left_by_a_killed_run_is_removed_and_a_young_one_kept(
    tmp_path: Path,
) -> None:
    """A run killed while creating the lock (its complete file written, not yet linked to the
    lock's name) leaves that file; the next run that takes the lock removes it once it is old
    (a live process's exists for a moment, on this host or another)."""
    old = tmp_path / f"{LOCK_FILE}.tmp.4242.0badcafe"
    young = tmp_path / f"{LOCK_FILE}.tmp.4343.0badcafe"
    for path in (old, young):
        path.write_bytes(b"{}\n")
    then = time.time() - 3600
    os.utime(old, (then, then))
    lock = DirectoryLock(tmp_path)
    lock.acquire()
    assert not old.exists()
    assert young.exists()
    lock.release()
