"""Checkpoints in an S3-compatible store (a real S3 server on loopback: moto, in its own
process), on 2 gloo processes with real Trainers.

The flow, sync and async: train with ``dirpath="s3://..."``; the run is killed while step 6 is
being uploaded (the server holds its objects); a new Trainer resumes from "last" (step 4, the
newest published one) and finishes bit-identically to an uninterrupted run; retention leaves
the newest two steps in the store; the final step's Hugging Face export is published with it
and exports again from the store through the CLI. Faults: an upload error mid-step (nothing
published, the error on every rank), a marker whose step lost an object (detected, "last"
falls back), the server restarted mid-save (the upload retries and the step is published).
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

from lightning_mcore_ckpt.testing import DistributedFailure, run_distributed

pytestmark = pytest.mark.timeout(400)

EVERY, KILLED_AT, TOTAL = 2, 6, 8


def _fit(
    rank: int,
    world_size: int,
    tmp: str,
    url: str,
    max_steps: int,
    ckpt_path: str | None,
    options: dict[str, Any],
) -> dict[str, Any]:
    import torch
    from _trainer import gathered_weights, loader, make_trainer, record_losses

    from lightning_mcore_ckpt import HFExport, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.engine import LOADED_FROM_KEY
    from lightning_mcore_ckpt.tiny import HFGPTModule

    src = str(Path(tmp, "src"))
    Path(tmp, f"pid-{rank}").write_text(str(os.getpid()))  # for the test to kill
    torch.manual_seed(0)
    module = HFGPTModule(src, dropout=0.1)
    losses = record_losses(module)
    loaded_from = types.SimpleNamespace(path="")
    original_load = module.on_load_checkpoint

    def on_load_checkpoint(checkpoint: dict[str, Any]) -> None:
        loaded_from.path = checkpoint[LOADED_FROM_KEY]["path"]
        original_load(checkpoint)

    module.on_load_checkpoint = on_load_checkpoint  # type: ignore[method-assign]
    callbacks: list[Any] = []
    if url:
        callbacks.append(
            MegatronCheckpoint(
                url,
                every_n_train_steps=options.get("every", EVERY),
                max_to_keep=options.get("max_to_keep", 2),
                monitor=options.get("monitor"),
                save_top_k=options.get("save_top_k"),
                hf_export=HFExport(src),
                upload_part_mb=5,
                on_save_error=options.get("on_save_error", "raise"),
                durability=options.get("durability", "store"),
                local_dir=options.get("local_dir"),
            )
        )
    logger: Any = False
    if options.get("csv"):
        from lightning.pytorch.loggers import CSVLogger

        logger = CSVLogger(options["csv"], name="", version="")
    trainer = make_trainer(
        max_steps,
        MegatronStrategy(seed=1, ckpt_async_save=options.get("async", False)),
        world_size,
        callbacks=callbacks,
        enable_checkpointing=bool(url),
        logger=logger,
    )
    trainer.fit(module, train_dataloaders=loader(64, 2, shuffle=True), ckpt_path=ckpt_path)
    failed = callbacks[0].failed_saves if callbacks else 0
    best = callbacks[0].best_model_path if callbacks else ""
    if options.get("validate_best"):
        trainer.validate(module, dataloaders=loader(8, 2), ckpt_path="best")
    loaded = getattr(loaded_from, "path", "")
    weights = {k: v.clone() for k, v in gathered_weights(trainer).items()}
    return {
        "losses": losses,
        "weights": weights,
        "failed": failed,
        "loaded_from": loaded,
        "best": best,
    }


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    tmp = tmp_path_factory.mktemp("s3src")
    tiny_hf_model(tmp / "src", family="qwen2")
    return tmp


@pytest.fixture(scope="module")
def reference(hf_source: Path) -> dict[str, Any]:
    return run_distributed(_fit, 2, str(hf_source), "", TOTAL, None, {}, timeout=300)[0]


def _steps(objects: dict[str, int]) -> dict[str, bool]:
    """Step name -> whether it is published (its marker is there)."""
    out: dict[str, bool] = {}
    for key in objects:
        head, _, tail = key.split("/", 1)[1].partition("/")
        if head.startswith("global_step_"):
            out[head] = out.get(head, False) or tail == "metadata.json"
    return out


def _kill_ranks_when_held(server: Any, tmp: str) -> threading.Thread:
    def kill() -> None:
        server.wait_held(timeout=240)
        for rank in range(2):  # SIGKILL: a machine lost mid-upload
            os.kill(int(Path(tmp, f"pid-{rank}").read_text()), signal.SIGKILL)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


# The axes of a save to a store: sync or async writes; durability "store" or "local"; the local
# tier a staging directory or the user's local_dir; the resume on the same machine (its local
# copy) or on a new one (through a view of the store). Every value, and every pair of the first
# three, in four cases.
CASES = {
    "sync-store-staging-new_machine": (False, "store", False, True),
    "async-store-staging-same_machine": (True, "store", False, False),
    "sync-local-local_dir-same_machine": (False, "local", True, False),
    "async-local-local_dir-new_machine": (True, "local", True, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_save_kill_mid_upload_resume_retention_export(
    s3_server: Any, s3_bucket: str, hf_source: Path, reference: dict[str, Any], case: str
) -> None:
    import shutil

    import torch

    async_save, durability, local_tier, new_machine = CASES[case]
    url = f"s3://{s3_bucket}/run"
    tmp = str(hf_source)
    local_dir = Path(tmp, f"tier-{case}")
    options: dict[str, Any] = {"async": async_save, "durability": durability}
    if local_tier:
        options["local_dir"] = str(local_dir)
    # Killed while step 6's shards are uploaded: steps 2 and 4 are published, 6 is not.
    s3_server.faults(hold=rf"/{s3_bucket}/run/global_step_{KILLED_AT}/model/__")
    killer = _kill_ranks_when_held(s3_server, tmp)
    with pytest.raises(DistributedFailure) as killed:
        run_distributed(
            _fit, 2, tmp, url, TOTAL, None, dict(options), timeout=300, env=s3_server.env()
        )
    killer.join(5)
    assert "exit code -9" in str(killed.value), killed.value
    s3_server.faults()
    objects = s3_server.objects(s3_bucket)
    assert _steps(objects) == {
        "global_step_2": True,
        "global_step_4": True,
        f"global_step_{KILLED_AT}": False,
    }
    tracker = s3_server.client().get_object(
        Bucket=s3_bucket, Key="run/latest_checkpointed_iteration.txt"
    )
    assert tracker["Body"].read() == b"4\n"
    assert "run/.lightning_mcore_ckpt.lock" in objects  # left by the killed run
    staging = Path(tempfile.gettempdir(), "lightning-mcore-ckpt", s3_bucket, "run")
    tier = local_dir if local_tier else staging
    assert (tier / f"global_step_{KILLED_AT}" / "metadata.json").is_file()  # committed here
    if new_machine:  # the local tier is lost with the machine
        shutil.rmtree(tier)

    # Resumes from "last" (the lock of the dead run is taken over), bit-identically: step 6
    # from the local tier with durability="local" on the same machine, else step 4, the
    # store's newest (read through a view of the store on a new machine).
    resumed = run_distributed(
        _fit, 2, tmp, url, TOTAL, "last", dict(options), timeout=300, env=s3_server.env()
    )[0]
    start = KILLED_AT if durability == "local" and not new_machine else 4
    assert sorted(resumed["losses"]) == list(range(start, TOTAL))
    source = resumed["loaded_from"]
    assert source.startswith(str(tier)) != new_machine, source
    for step, loss in resumed["losses"].items():
        assert loss == reference["losses"][step], step
    for name, tensor in reference["weights"].items():
        assert torch.equal(resumed["weights"][name], tensor), name

    # Retention (max_to_keep=2) in the store; the dead run's partial step 6 was replaced (or,
    # with durability="local", uploaded when the fit started); the export at the end is
    # published with step 8; the lock is released.
    objects = s3_server.objects(s3_bucket)
    assert _steps(objects) == {"global_step_6": True, f"global_step_{TOTAL}": True}
    assert f"run/global_step_{TOTAL}/huggingface/model.safetensors" in objects
    assert "run/.lightning_mcore_ckpt.lock" not in objects
    local_steps = sorted(p.name for p in tier.glob("global_step_*"))
    expected = (
        [f"global_step_{TOTAL}"] if not local_tier else ["global_step_6", f"global_step_{TOTAL}"]
    )
    assert local_steps == expected  # a staging tier keeps the newest step only
    marker = json.loads(
        s3_server.client()
        .get_object(Bucket=s3_bucket, Key=f"run/global_step_{TOTAL}/metadata.json")["Body"]
        .read()
    )
    assert "hf_model" in marker["contents"]
    assert "testing-secret" not in json.dumps(marker)  # no credentials in the commit
    assert marker == json.loads((tier / f"global_step_{TOTAL}" / "metadata.json").read_text())

    # The CLI reads the store: fsck (deep: every byte by range), and an export from it.
    from _cli import run_cli

    assert run_cli("fsck", url, "--deep").returncode == 0
    out = Path(tmp, f"export-{case}")
    step = f"{url}/global_step_{TOTAL}"
    done = run_cli("export", step, "--hf-model", str(Path(tmp, "src")), "--out", str(out))
    assert done.returncode == 0, done.stderr
    key = f"run/global_step_{TOTAL}/huggingface/model.safetensors"
    published = s3_server.client().get_object(Bucket=s3_bucket, Key=key)["Body"].read()
    assert (out / "model.safetensors").read_bytes() == published
    # ... and from the store to the store, through a scratch directory that goes afterwards.
    scratch = Path(tmp, f"scratch-{case}")
    scratch.mkdir()
    with mock.patch.object(tempfile, "tempdir", str(scratch)):
        done = run_cli("export", step, "--hf-model", str(Path(tmp, "src")), "--out", f"{url}-hf")
    assert done.returncode == 0, done.stderr
    # (The source step's view stays until the process exits, as every view does.)
    assert not list(scratch.glob("lmc-export-*")), "the export's scratch directory was left"
    exported = {k.split("/", 1)[1] for k in s3_server.objects(s3_bucket, "run-hf/")}
    assert exported == {p.name for p in out.iterdir()}


@pytest.mark.parametrize("durability", ["store", "local"])
def test_an_upload_error_mid_step_publishes_nothing_and_reaches_every_rank(
    s3_server: Any, s3_bucket: str, hf_source: Path, durability: str
) -> None:
    import csv

    url = f"s3://{s3_bucket}/run"
    tier = Path(hf_source, f"tier-error-{durability}")
    csv_dir = Path(hf_source, f"csv-{durability}")
    s3_server.faults(fail=rf"/{s3_bucket}/run/global_step_4/optim/")
    options = {"on_save_error": "warn", "durability": durability, "local_dir": str(tier)}
    options["csv"] = str(csv_dir)
    result = run_distributed(
        _fit, 2, str(hf_source), url, 6, None, options, timeout=300, env=s3_server.env()
    )
    assert [r["failed"] for r in result] == [1, 1]  # every rank counted the failed upload
    steps = _steps(s3_server.objects(s3_bucket))
    assert steps["global_step_2"] and steps["global_step_6"]
    assert not steps.get("global_step_4", False)  # never published: "last" cannot name it
    # Durability "store": step 4 was not saved (its local copy is gone); "local": it was
    # saved here, and only its upload failed.
    assert (tier / "global_step_4" / "metadata.json").is_file() == (durability == "local")
    # The uploads' figures are logged with their steps; the failure is counted.
    with next(csv_dir.rglob("metrics.csv")).open() as f:
        rows = list(csv.DictReader(f))
    column = "checkpoint/upload_throughput_gbps"
    sent = {int(r["step"]): float(r[column]) for r in rows if r.get(column)}
    assert sorted(sent) == [2, 6] and min(sent.values()) > 0, rows
    assert [float(r["checkpoint/failed"]) for r in rows if r.get("checkpoint/failed")] == [1.0]


def test_a_step_missing_an_object_is_detected_and_last_falls_back(
    s3_server: Any, s3_bucket: str, hf_source: Path, reference: dict[str, Any]
) -> None:
    from _cli import run_cli

    from lightning_mcore_ckpt.format import layout
    from lightning_mcore_ckpt.storage import remote_files, store_views

    url = f"s3://{s3_bucket}/run"
    run_distributed(_fit, 2, str(hf_source), url, 4, None, {}, timeout=300, env=s3_server.env())
    client = s3_server.client()
    shard = next(k for k in s3_server.objects(s3_bucket) if "global_step_4/model/__" in k)
    client.delete_object(Bucket=s3_bucket, Key=shard)  # its marker stays

    report = run_cli("fsck", url)
    assert report.returncode != 0
    assert f"{shard.split('/', 1)[1]} is missing" in report.stdout + report.stderr
    listing = run_cli("ls", url)
    assert listing.returncode == 0 and "global_step_2" in listing.stdout, listing.stderr
    assert "DAMAGED" in listing.stdout  # step 4
    table = run_cli("report", url)
    assert table.returncode == 0 and "global_step_4" in table.stdout + table.stderr
    assert run_cli("inspect", f"{url}/global_step_2", "--tp", "1").returncode == 0
    # A view streams: its small files are here, no shard file is; "last" skips step 4.
    view = store_views.open_view(url)
    assert not list(view.rglob("*.distcp"))
    assert layout.resolve_last(view) == view / "global_step_2"
    assert store_views.resolve_url(url) == f"{url}/global_step_2"  # ckpt_path="s3://..." loads it
    with pytest.raises(FileNotFoundError, match="is damaged"):
        store_views.resolve_url(f"{url}/global_step_4")  # named explicitly: refused, not skipped
    # A rank's view of the step it loads lists that step alone, and downloads no other rank's
    # extra/ file (rank 5 of a larger run: rank 0's file is the one it reads).
    mine = store_views.open_view(f"{url}/global_step_2", rank=5)
    assert [p.name for p in mine.parent.iterdir()] == ["global_step_2"]
    assert [p.name for p in (mine / "extra").iterdir()] == ["rank_00000.pt"]
    assert remote_files.size_of(mine / "extra" / "rank_00001.pt")  # read by range if ever read
    kept = next(k for k in s3_server.objects(s3_bucket) if "global_step_2/model/__" in k)
    with remote_files.open_read(view / kept.split("/", 1)[1]) as stream:
        stream.seek(100)
        body = client.get_object(Bucket=s3_bucket, Key=kept)["Body"].read()
        assert stream.read(1000) == body[100:1100]

    # The staging tier keeps step 4 alone: step 2 is read from the store, through a view.
    resumed = run_distributed(
        _fit, 2, str(hf_source), url, 6, "last", {}, timeout=300, env=s3_server.env()
    )[0]
    assert "lmc-view-" in resumed["loaded_from"]
    assert sorted(resumed["losses"]) == [2, 3, 4, 5]  # fell back to step 2
    for step, loss in resumed["losses"].items():
        assert loss == reference["losses"][step], step


def test_one_writer_per_store_prefix(s3_server: Any, s3_bucket: str, hf_source: Path) -> None:
    from lightning_mcore_ckpt.storage.object_store import ObjectStore
    from lightning_mcore_ckpt.storage.store_lock import StoreLock

    url = f"s3://{s3_bucket}/run"
    store = ObjectStore.from_url(url)
    first = StoreLock(store)
    first.acquire()
    with pytest.raises(RuntimeError, match="in use by another run"):
        StoreLock(store).acquire()  # this host, its holder alive
    # A fit is refused on every rank before it writes anything.
    with pytest.raises(DistributedFailure, match="in use by another run") as refused:
        run_distributed(_fit, 2, str(hf_source), url, 2, None, {}, timeout=300, env=s3_server.env())
    assert "rank 0" in str(refused.value) or "rank 1" in str(refused.value)
    assert set(s3_server.objects(s3_bucket)) == {"run/.lightning_mcore_ckpt.lock"}
    # Another host's lock whose heartbeat is stale is taken over; its holder learns it.
    foreign = {**first._record, "host": "elsewhere", "pid": 1}
    store.put_bytes(".lightning_mcore_ckpt.lock", json.dumps(foreign).encode())
    second = StoreLock(store, stale_after_s=0.0)
    second.acquire()
    first._etag = '"stale"'
    first.heartbeat()
    with pytest.raises(RuntimeError, match="took over"):
        first.check()
    first.release()  # never deletes the new holder's lock
    assert "run/.lightning_mcore_ckpt.lock" in s3_server.objects(s3_bucket)
    second.release()
    assert s3_server.objects(s3_bucket) == {}


def test_a_new_run_into_a_used_store_is_refused(
    s3_server: Any, s3_bucket: str, hf_source: Path
) -> None:
    url = f"s3://{s3_bucket}/run"
    run_distributed(_fit, 2, str(hf_source), url, 2, None, {}, timeout=300, env=s3_server.env())
    before = s3_server.objects(s3_bucket)
    with pytest.raises(DistributedFailure, match="holds complete steps of another run"):
        run_distributed(_fit, 2, str(hf_source), url, 4, None, {}, timeout=300, env=s3_server.env())
    after = s3_server.objects(s3_bucket)
    after.pop("run/.lightning_mcore_ckpt.lock", None)  # its ranks were killed before releasing it
    assert after == before


def test_a_server_restart_mid_save_is_retried(
    s3_server: Any, s3_bucket: str, hf_source: Path
) -> None:
    url = f"s3://{s3_bucket}/run"
    s3_server.faults(hold=rf"/{s3_bucket}/run/global_step_2/model/__")

    restarted = threading.Event()

    def restart() -> None:
        s3_server.wait_held(timeout=240)
        s3_server.faults(down=True)  # the held upload is dropped; the data survives
        time.sleep(1.0)
        s3_server.faults()
        s3_server.wait_accepting(True)
        restarted.set()

    thread = threading.Thread(target=restart, daemon=True)
    thread.start()
    result = run_distributed(
        _fit, 2, str(hf_source), url, 2, None, {}, timeout=300, env=s3_server.env()
    )
    thread.join(5)
    assert restarted.is_set()  # the server went down while step 2 was uploaded
    assert [r["failed"] for r in result] == [0, 0]
    assert _steps(s3_server.objects(s3_bucket)) == {"global_step_2": True}


def test_top_k_runs_on_the_store_and_best_is_read_from_it(
    s3_server: Any, s3_bucket: str, hf_source: Path
) -> None:
    url = f"s3://{s3_bucket}/run"
    options = {"every": 1, "max_to_keep": None, "monitor": "train_loss", "save_top_k": 2}
    options["validate_best"] = True
    result = run_distributed(
        _fit, 2, str(hf_source), url, 6, None, options, timeout=300, env=s3_server.env()
    )[0]
    best = Path(result["best"]).name
    steps = _steps(s3_server.objects(s3_bucket))
    # Lightning's bookkeeping decides (the best two, and the newest as "last"); the store
    # follows it, marker first, and holds nothing else.
    assert all(steps.values()) and "global_step_6" in steps and best in steps
    assert 2 <= len(steps) <= 3, steps
    # "best" is loaded from the store when the staging tier no longer holds it.
    assert Path(result["loaded_from"]).name == best
    assert ("lmc-view-" in result["loaded_from"]) == (best != "global_step_6")
