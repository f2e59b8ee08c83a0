"""Integrity: every file of a step hashed while it is written, damage found without loading.

Axes: writer (ours, Megatron-Core's) x sync/async on 2 gloo ranks; the damage: every file of a
step in turn, a flipped byte (size unchanged: only the hashes see it) and a truncation (the
fast check sees it); where it is found: ``fsck`` (fast, ``--deep``), ``"last"`` (falls back),
and a real resume asking for hashes (and, as the contrast, one that does not).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.cli import fsck
from lightning_mcore_ckpt.format import integrity, layout, markers
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

FIXTURE = Path(__file__).resolve().parents[1] / "compat" / "fixtures" / "v0_1" / "ckpt"


def _run(
    rank: int, world_size: int, root: str, async_save: bool, writer: str, max_steps: int = 4
) -> dict[str, Any]:
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    read_at_commit: list[str] = []
    hash_file = integrity.hash_file

    def counted(path: Any) -> str:
        read_at_commit.append(str(path))
        return hash_file(path)

    integrity.hash_file = counted  # type: ignore[assignment]
    strategy = MegatronStrategy(ckpt_async_save=async_save, ckpt_writer=writer)
    callback = MegatronCheckpoint(root, every_n_train_steps=2, save_last=False)
    trainer = make_trainer(
        max_steps, strategy, world_size, callbacks=[callback], enable_checkpointing=True
    )
    trainer.fit(TinyGPTModule(), train_dataloaders=loader(32, 2))
    return {"read_at_commit": read_at_commit}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("writer", ["threads", "megatron"])
def test_every_file_is_hashed_at_its_commit(tmp_path: Path, async_save: bool, writer: str) -> None:
    run = tmp_path / "run"
    ranks = run_distributed(_run, 2, str(run), async_save, writer, timeout=250)
    for step in layout.complete_steps(run):
        meta = markers.read_metadata(step.path)
        assert meta is not None and meta["format_version"] == 2
        # Every file of the step (metadata.json aside: it holds its own digest) has a digest,
        # and each is the digest of the file's bytes.
        assert set(meta["hashes"]) == set(meta["files"]), step.path
        for name, digest in meta["hashes"].items():
            assert integrity.hash_file(step.path / name) == digest, name
        assert meta[integrity.METADATA_HASH] == integrity.json_digest(meta)
        assert layout.verify_step(step.path, deep=True) == []
    read = [Path(p).name for r in ranks for p in r["read_at_commit"]]
    if writer == "threads":
        # Ours hashes the shards and extra/ while writing them: none is read back.
        assert not [n for n in read if n.endswith(".distcp") or n.startswith("rank_")], read
        assert read, "Megatron-Core's small index files are hashed at the commit"
    result = fsck.check(run, deep=True)
    assert [s.path.name for s in result.steps] == ["global_step_2", "global_step_4"]
    assert result.damaged == []


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("integrity") / "run"
    run_distributed(_run, 2, str(run), False, "threads", timeout=250)
    return run


def _flip(file: Path, at: int | None = None) -> tuple[int, bytes]:
    data = bytearray(file.read_bytes())
    where = len(data) // 2 if at is None else at
    old = bytes(data[where : where + 1])
    data[where] ^= 0x01
    file.write_bytes(bytes(data))
    return where, old


def test_a_flipped_byte_in_any_file_is_found_by_the_deep_check_and_last_falls_back(
    saved_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    step = saved_run / "global_step_4"
    meta = markers.read_metadata(step)
    assert meta is not None
    names = [*meta["files"], markers.METADATA_FILE]
    assert any(n.endswith(".distcp") for n in names) and any(n.startswith("extra/") for n in names)
    for name in names:
        run = tmp_path / name.replace("/", "_")
        shutil.copytree(saved_run, run)
        file = run / "global_step_4" / name
        if name == markers.METADATA_FILE:
            # A change that keeps it valid JSON (a digit of the save time).
            text = file.read_text()
            at = text.index('"saved_at": "') + len('"saved_at": "') + 3
            file.write_text(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1 :])
        else:
            _flip(file)
        assert fsck.check(run).steps[0].problems == []  # step 2 is intact
        found = fsck.check(run, deep=True)
        assert [s.path.name for s in found.damaged] == ["global_step_4"], name
        assert any(str(file) in p for p in found.damaged[0].problems), (name, found.damaged)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lightning_mcore_ckpt.format.layout"):
            assert layout.resolve_last(run, deep=True) == run / "global_step_2"
        assert str(file) in caplog.text and "skipping damaged" in caplog.text
        shutil.rmtree(run)


def test_a_truncated_file_is_found_by_the_fast_check(saved_run: Path, tmp_path: Path) -> None:
    meta = markers.read_metadata(saved_run / "global_step_4")
    assert meta is not None
    for name in meta["files"]:
        run = tmp_path / name.replace("/", "_")
        shutil.copytree(saved_run, run)
        file = run / "global_step_4" / name
        file.write_bytes(file.read_bytes()[:-1])
        found = fsck.check(run)
        assert [s.path.name for s in found.damaged] == ["global_step_4"], name
        assert any(str(file) in p for p in found.damaged[0].problems), name
        shutil.rmtree(run)


def _resume(rank: int, world_size: int, root: str, verify: bool) -> dict[str, Any]:
    import lightning.pytorch as pl
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    started: list[int] = []

    class Start(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: Any) -> None:
            started.append(trainer.global_step)

    strategy = MegatronStrategy(ckpt_verify_hashes=verify)
    callback = MegatronCheckpoint(root, every_n_train_steps=100, save_last=False)
    trainer = make_trainer(
        6, strategy, world_size, callbacks=[callback, Start()], enable_checkpointing=True
    )
    trainer.fit(TinyGPTModule(), train_dataloaders=loader(32, 2), ckpt_path="last")
    return {"start": started[0]}


@pytest.mark.parametrize("verify", [True, False], ids=["hashes", "sizes-only"])
def test_a_resume_asking_for_hashes_skips_a_silently_damaged_step(
    saved_run: Path, tmp_path: Path, verify: bool
) -> None:
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    # Inside a tensor's bytes (the middle of the largest record): it loads, but wrong.
    from lightning_mcore_ckpt.safety.safe_dcp import read_dcp_metadata

    optim = run / "global_step_4" / "optim"
    largest = max(read_dcp_metadata(optim).storage_data.values(), key=lambda i: i.length)
    _flip(optim / largest.relative_path, at=largest.offset + largest.length // 2)
    ranks = run_distributed(_resume, 2, str(run), verify, timeout=250)
    # With hashes the damaged step 4 is skipped for step 2 on every rank; with sizes only,
    # the flip goes unseen (the reason to ask for hashes).
    assert [r["start"] for r in ranks] == ([2, 2] if verify else [4, 4])


def test_fsck_command_exit_codes_and_steps_written_before_hashes(
    saved_run: Path, tmp_path: Path
) -> None:
    exe = Path(sys.executable).with_name("lightning-mcore-ckpt")

    def fsck_cli(*args: str) -> subprocess.CompletedProcess[str]:
        from _cli import run_cli  # in this process; the installed command is run once below

        return run_cli("fsck", *args)

    ok = subprocess.run(
        [str(exe), "fsck", str(saved_run), "--deep"], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "global_step_4  OK" in ok.stdout and "re-hashed" in ok.stdout
    # A step written before hashes were kept: sizes and structure, and it says so.
    old = fsck_cli(str(FIXTURE), "--deep")
    assert old.returncode == 0, old.stdout + old.stderr
    assert "no hashes recorded" in old.stdout
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    shard = sorted((run / "global_step_2" / "model").glob("*.distcp"))[0]
    _flip(shard)
    bad = fsck_cli(str(run / "global_step_2"), "--deep")
    assert bad.returncode == 1
    assert "global_step_2  DAMAGED" in bad.stdout and str(shard) in bad.stdout
    assert fsck_cli(str(run / "global_step_2")).returncode == 0  # the fast check cannot see it
    missing = fsck_cli(str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
