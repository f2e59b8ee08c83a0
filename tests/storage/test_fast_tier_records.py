"""The fast tier's record (``fast_tier.jsonl``) is kept in the persistent tier, where
``lightning-mcore-ckpt report`` reads it: ``<dirpath>/fast_tier.jsonl`` for a local
``dirpath``, the object ``<prefix>/fast_tier.jsonl`` for an ``s3://`` one (never on a node's
own disk, where it would be lost with the node). A second run adds to what the first recorded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _cli import run_cli

from lightning_mcore_ckpt.testing import run_distributed

pytest.importorskip("boto3")

pytestmark = pytest.mark.timeout(600)


def _fit(
    rank: int, world_size: int, dirpath: str, local: str, fast: str, steps: int, resume: bool
) -> int:
    """Fit to ``steps`` (``resume``: from "last"): persistent steps every 2, a fast step at each
    other one; the step it started from."""
    import lightning.pytorch as pl
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import FastTier, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    resumed: list[int] = []

    class Resumed(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            resumed.append(trainer.global_step)

    checkpoint = MegatronCheckpoint(
        dirpath,
        every_n_train_steps=2,
        local_dir=local if dirpath.startswith("s3://") else None,
        fast_tier=FastTier(fast, every_n_train_steps=1, replicas=0),
    )
    trainer = make_trainer(
        steps, MegatronStrategy(), 1, callbacks=[checkpoint, Resumed()], enable_checkpointing=True
    )
    trainer.fit(TinyGPTModule(), train_dataloaders=loader(64), ckpt_path="last" if resume else None)
    return resumed[0]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_the_fast_tiers_record_is_in_the_persistent_tier_and_report_reads_it(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    env: dict[str, str] = {}
    dirpath = str(tmp_path / "ckpt")
    if where == "s3":
        dirpath = f"s3://{request.getfixturevalue('s3_bucket')}/run"
        env = request.getfixturevalue("s3_server").env()
    local, fast = str(tmp_path / "local"), str(tmp_path / "fast")
    first = run_distributed(_fit, 1, dirpath, local, fast, 4, False, env=env)  # fast steps 1, 3
    assert first == [0]
    again = run_distributed(_fit, 1, dirpath, local, fast, 6, True, env=env)  # resumes 4; 5
    assert again == [4]

    if where == "s3":
        from lightning_mcore_ckpt.storage.object_store import ObjectStore

        text = (ObjectStore.from_url(dirpath).get_bytes("fast_tier.jsonl") or b"").decode()
        assert not list(Path(local).rglob("fast_tier.jsonl"))  # not on the node's disk
    else:
        text = (Path(dirpath) / "fast_tier.jsonl").read_text()
    records = [json.loads(line) for line in text.splitlines()]
    saves = [r["step"] for r in records if r["kind"] == "fast_save" and r["complete"]]
    assert saves == [1, 3, 5]  # the second run added to the first one's record
    recoveries = [r for r in records if r["kind"] == "recovery"]
    assert [(r["tier"], r["persistent_step"]) for r in recoveries] == [("persistent", 4)]

    shown = run_cli("report", dirpath)
    assert shown.returncode == 0, shown.stderr
    assert "fast tier (fast_tier.jsonl): 3 fast save(s), 0 failed" in shown.stdout, shown.stdout
    assert '1 recovery(ies) with ckpt_path="last"' in shown.stdout


class _FlakyStore:
    """An object store of one object in memory whose next ``put_bytes`` can be made to fail."""

    def __init__(self, text: str | None) -> None:
        self.objects = {} if text is None else {"fast_tier.jsonl": text.encode()}
        self.fail_next = False

    def get_bytes(self, name: str) -> bytes | None:
        return self.objects.get(name)

    def put_bytes(self, name: str, data: bytes) -> str:
        if self.fail_next:
            self.fail_next = False
            raise OSError("the store is unreachable")
        self.objects[name] = data
        return "etag"

    def child(self, name: str) -> Any:
        return type("Url", (), {"url": f"s3://b/run/{name}"})()


def test_the_stores_record_keeps_earlier_runs_and_resends_what_a_failed_put_missed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning_mcore_ckpt.callback.fast_records import FastRecords

    store = _FlakyStore('{"kind": "fast_save", "step": 1}\n{"kind": "fast_sa')  # torn last line
    records = FastRecords(tmp_path, store)  # type: ignore[arg-type]
    store.fail_next = True
    records.append({"kind": "fast_save", "step": 2})
    assert "could not record the fast tier's figures in s3://b/run/fast_tier.jsonl" in caplog.text
    records.append({"kind": "fast_save", "step": 3})
    lines = store.objects["fast_tier.jsonl"].decode().splitlines()
    assert lines[:2] == ['{"kind": "fast_save", "step": 1}', '{"kind": "fast_sa']
    assert [json.loads(line)["step"] for line in lines[2:]] == [2, 3]
    assert not (tmp_path / "fast_tier.jsonl").exists()
