"""``HFExport(upload_to=...)`` in real 2-rank Trainer runs: the Hub upload happens after the
export is committed, in the background, and its failure is reported without losing the step.

The Hub cannot be reached from here: inside each rank process ``huggingface_hub.HfApi``'s
``create_repo``/``repo_info``/``upload_folder`` are replaced by a recorder (rank 0 calls them);
training, checkpoints, exports and their verification are real.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(400)

REPO = "my-org/tiny-sft"


def _train(rank: int, world_size: int, tmp: str, case: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from _trainer import loader, make_trainer
    from huggingface_hub import HfApi
    from lightning.pytorch.loggers.logger import Logger

    from lightning_mcore_ckpt import HFExport, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.format import layout, markers
    from lightning_mcore_ckpt.hf import _upload
    from lightning_mcore_ckpt.tiny import HFGPTModule

    _upload.BACKOFF_S = 0.01
    ckpt = Path(tmp, "ckpt")
    max_steps = 6 if case == "every_save" else 3
    out: dict[str, Any] = {"calls": [], "rows": [], "error": None}
    last_step_ran = threading.Event()

    def exported_steps() -> list[int]:
        # Committed steps whose metadata records the export (it is committed after the copy).
        return [
            s.step
            for s in layout.complete_steps(ckpt)
            if "hf_model" in (markers.read_metadata(s.path) or {}).get("contents", [])
        ]

    def create_repo(api: Any, repo_id: str, **kwargs: Any) -> Any:
        out["calls"].append(("create_repo", repo_id, kwargs, exported_steps()))
        return repo_id

    def repo_info(api: Any, repo_id: str, **kwargs: Any) -> Any:
        out["calls"].append(("repo_info", repo_id, kwargs, exported_steps()))
        return type("Info", (), {"private": True})()

    def upload_folder(api: Any, **kwargs: Any) -> Any:
        folder = Path(kwargs["folder_path"])
        if case == "every_save" and folder.parent.name == "global_step_2":
            # Blocks until training has run its last step: a blocked training would never get
            # there, and this upload would time out.
            kwargs["released"] = last_step_ran.wait(240)
        kwargs["files"] = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else None
        out["calls"].append(("upload_folder", kwargs["repo_id"], kwargs, exported_steps()))
        if case == "fails":
            raise ConnectionError("503 Service Unavailable")
        return type("Commit", (), {"commit_url": "https://hub.example/c"})()

    HfApi.create_repo = create_repo  # type: ignore[method-assign]
    HfApi.repo_info = repo_info  # type: ignore[method-assign]
    HfApi.upload_folder = upload_folder  # type: ignore[method-assign]

    class Rows(Logger):
        name = "rows"  # type: ignore[assignment]
        version = 0  # type: ignore[assignment]

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            out["rows"].append((step, dict(metrics)))

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

    class LastStep(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == max_steps:
                last_step_ran.set()

    src = str(Path(tmp, "src"))
    export = HFExport(
        src, when="end" if case != "every_save" else "every_save", upload_to=REPO,
        upload_attempts=2,
    )  # fmt: skip
    trainer = make_trainer(
        max_steps,
        MegatronStrategy(tensor_model_parallel_size=2, init_from=src),
        world_size,
        callbacks=[
            MegatronCheckpoint(ckpt, every_n_train_steps=2, max_to_keep=1, hf_export=export),
            LastStep(),
        ],
        enable_checkpointing=True,
        logger=Rows(),
        log_every_n_steps=1,
    )
    try:
        trainer.fit(HFGPTModule(src, lr=1e-2), train_dataloaders=loader(32, 2))
    except Exception as err:  # noqa: BLE001 - the test looks at it
        out["error"] = f"{type(err).__name__}: {err}"
    out["global_step"] = trainer.global_step
    return out


def _run(tmp_path: Path, case: str) -> list[dict[str, Any]]:
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    tiny_hf_model(tmp_path / "src")
    return run_distributed(_train, 2, str(tmp_path), case, timeout=380)


def _uploads(calls: list[Any]) -> list[tuple[str, dict[str, Any], list[int]]]:
    return [(Path(kw["folder_path"]).parent.name, kw, done) for n, _, kw, done in calls if n == "upload_folder"]  # fmt: skip


def test_when_end_uploads_the_committed_export_once_after_it_is_complete(tmp_path: Path) -> None:
    zero, one = _run(tmp_path, "end")
    assert zero["error"] is None and one["error"] is None and one["calls"] == []
    step = tmp_path / "ckpt" / "global_step_3"
    exported = sorted(p.name for p in (step / "huggingface").iterdir())
    assert [(name, repo, kwargs) for name, repo, kwargs, _ in zero["calls"]] == [
        ("create_repo", REPO, {"private": True, "exist_ok": True, "repo_type": "model"}),
        ("repo_info", REPO, {"repo_type": "model"}),
        (
            "upload_folder",
            REPO,
            {
                "repo_id": REPO,
                "folder_path": str(step / "huggingface"),
                "repo_type": "model",
                "revision": None,
                "commit_message": "global_step_3: Hugging Face export by lightning-mcore-ckpt",
                "delete_patterns": ["*.safetensors", "*.safetensors.index.json"],
                "files": exported,
            },
        ),
    ]
    # No call before the export of step 3 was committed.
    assert all(3 in done for *_, done in zero["calls"])
    [(step_of_row, row)] = [(s, r) for s, r in zero["rows"] if "checkpoint/hf_upload_time_s" in r]
    assert step_of_row == 3 and row["checkpoint/hf_upload_time_s"] > 0


def test_every_save_uploads_in_the_background_while_training_goes_on(tmp_path: Path) -> None:
    zero, one = _run(tmp_path, "every_save")
    assert zero["error"] is None and one["error"] is None and zero["global_step"] == 6
    uploads = _uploads(zero["calls"])
    sent = [name for name, _, _ in uploads]
    # Step 2's upload was held until step 6 had run: training did not wait for it. Step 4's
    # may have been superseded by step 6's while it waited.
    assert uploads[0][1]["released"] is True
    assert sent[0] == "global_step_2" and sent[-1] == "global_step_6"
    assert sent in (["global_step_2", "global_step_4", "global_step_6"], [sent[0], sent[-1]])
    for name, kwargs, done in uploads:
        # Complete and committed when sent; max_to_keep=1 did not delete it while uploading.
        assert int(name.rsplit("_", 1)[1]) in done
        assert kwargs["files"] is not None and "config.json" in kwargs["files"]
    assert (tmp_path / "ckpt" / "global_step_6" / "huggingface" / "config.json").is_file()


def test_a_permanent_upload_failure_is_reported_on_every_rank_and_the_step_stays(
    tmp_path: Path,
) -> None:
    from lightning_mcore_ckpt import hf
    from lightning_mcore_ckpt.format import layout

    zero, one = _run(tmp_path, "fails")
    names = [n for n, *_ in zero["calls"]]
    assert names == ["create_repo", "repo_info", "upload_folder"] * 2  # upload_attempts=2
    for result in (zero, one):
        error = result["error"]
        assert error is not None and error.startswith(
            "CheckpointSaveError: upload of global_step_3"
        )
        assert f"to {REPO} failed after 2 attempt(s): ConnectionError: 503" in error
        assert "the step is intact on disk" in error
    step = tmp_path / "ckpt" / "global_step_3"
    assert layout.is_complete(step) and layout.read_tracker(tmp_path / "ckpt") == 3
    assert hf.verify_export(step / "huggingface", step).ok
    failed = [(s, r) for s, r in zero["rows"] if "checkpoint/hf_upload_failed" in r]
    assert failed == [(3, {"checkpoint/hf_upload_failed": 1.0})]
