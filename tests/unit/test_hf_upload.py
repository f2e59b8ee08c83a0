"""Hub upload at the ``huggingface_hub`` boundary: what is sent, in which order, retries, failures.

The Hub cannot be reached from the test machines: ``HfApi``'s methods are replaced by a recorder
(the only stand-in); the steps, exports and verification are real.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt.cli.entry import main as cli_main

TOKEN = "hf_not_a_real_token_0123456789"
REPO = "my-org/tiny-sft"


class Hub:
    """Stands in for the Hub behind ``huggingface_hub.HfApi``: records every call in order, with
    the files of the uploaded folder at the time of the call; fails the first ``fail`` calls of
    ``failing``; ``upload_folder`` waits for ``release`` when given."""

    def __init__(
        self,
        fail: int = 0,
        failing: str = "upload_folder",
        public: bool = False,
        release: threading.Event | None = None,
    ) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail, self.failing, self.public, self.release = fail, failing, public, release
        self.started = threading.Event()

    def _call(self, name: str, kwargs: dict[str, Any]) -> None:
        self.calls.append((name, kwargs))
        if name == self.failing and self.fail > 0:
            self.fail -= 1
            raise ConnectionError(f"503 Service Unavailable (Authorization: Bearer {TOKEN})")

    def install(self, monkeypatch: pytest.MonkeyPatch) -> Hub:
        from huggingface_hub import HfApi

        hub = self

        def create_repo(api: Any, repo_id: str, **kwargs: Any) -> Any:
            hub._call("create_repo", {"repo_id": repo_id, **kwargs})
            return f"https://hub.example/{repo_id}"

        def repo_info(api: Any, repo_id: str, **kwargs: Any) -> Any:
            hub._call("repo_info", {"repo_id": repo_id, **kwargs})
            return type("Info", (), {"private": not hub.public})()

        def upload_folder(api: Any, **kwargs: Any) -> Any:
            hub.started.set()
            if hub.release is not None:
                assert hub.release.wait(60), "never released"
            folder = Path(kwargs["folder_path"])
            files = sorted(p.name for p in folder.iterdir())
            hub._call("upload_folder", {**kwargs, "files": files})
            return type(
                "Commit", (), {"commit_url": f"https://hub.example/{kwargs['repo_id']}/c"}
            )()

        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "repo_info", repo_info)
        monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
        return self

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


@pytest.fixture(autouse=True)
def _fast_retries_and_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_mcore_ckpt.hf import _upload

    monkeypatch.setattr(_upload, "BACKOFF_S", 0.01)
    monkeypatch.setenv("HF_TOKEN", TOKEN)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A Hugging Face model, and a complete step imported from it with its export inside."""
    from lightning_mcore_ckpt import hf
    from lightning_mcore_ckpt.callback._export import export_into_committed
    from lightning_mcore_ckpt.format import markers
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    root = tmp_path_factory.mktemp("upload")
    src = tiny_hf_model(root / "src", "qwen2")
    step = root / "ckpt" / "global_step_7"
    hf.import_checkpoint(src, step)
    # As a run does it: exported into the committed step, the copy's digests sealed.
    export_into_committed(hf.HFExport(src), step)
    assert any(k.startswith("huggingface/") for k in markers.read_metadata(step)["hashes"])
    return src, step


@pytest.fixture
def step(made: tuple[Path, Path], tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt" / made[1].name
    shutil.copytree(made[1], copy)
    return copy


def _digest(path: Path) -> dict[str, str]:
    files = sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _expected_calls(step: Path) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("create_repo", {"repo_id": REPO, "private": True, "exist_ok": True, "repo_type": "model"}),
        ("repo_info", {"repo_id": REPO, "repo_type": "model"}),
        (
            "upload_folder",
            {
                "repo_id": REPO,
                "folder_path": str(step / "huggingface"),
                "repo_type": "model",
                "revision": None,
                "commit_message": f"{step.name}: Hugging Face export by lightning-mcore-ckpt",
                "delete_patterns": ["*.safetensors", "*.safetensors.index.json"],
                "files": sorted(p.name for p in (step / "huggingface").iterdir()),
            },
        ),
    ]


def test_a_verified_export_is_sent_as_create_repo_then_one_upload_folder_commit(
    step: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_mcore_ckpt import hf

    hub = Hub().install(monkeypatch)
    result = hf.upload_export(step / "huggingface", step, REPO, private=True)
    assert hub.calls == _expected_calls(step)
    assert {"config.json", "model.safetensors"} <= set(hub.calls[-1][1]["files"])
    assert (result.repo_id, result.step, result.attempts) == (REPO, "global_step_7", 1)
    assert result.commit_url == f"https://hub.example/{REPO}/c"


def test_a_failed_attempt_is_retried_with_backoff_and_the_success_reported(
    step: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning_mcore_ckpt import hf

    hub = Hub(fail=1).install(monkeypatch)
    slept: list[float] = []
    with caplog.at_level(logging.INFO, logger="lightning_mcore_ckpt.hf._upload"):
        result = hf.upload_export(step / "huggingface", step, REPO, sleep=slept.append)
    assert result.attempts == 2 and slept == [0.01]
    assert hub.names == ["create_repo", "repo_info", "upload_folder"] * 2
    assert hub.calls[3:] == _expected_calls(step)
    assert "attempt 1/3 failed: ConnectionError: 503" in caplog.text
    assert f"uploaded global_step_7 to {REPO}" in caplog.text
    assert TOKEN not in caplog.text and "Bearer ***" in caplog.text


def test_a_permanent_failure_is_raised_naming_repo_step_and_error_and_the_step_stays(
    step: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning_mcore_ckpt import hf

    before = _digest(step)
    hub = Hub(fail=99).install(monkeypatch)
    slept: list[float] = []
    with pytest.raises(hf.UploadError) as raised:
        hf.upload_export(step / "huggingface", step, REPO, attempts=3, sleep=slept.append)
    message = str(raised.value)
    assert f"upload of global_step_7 ({step / 'huggingface'}) to {REPO} failed after 3" in message
    assert "ConnectionError: 503 Service Unavailable" in message and "step is intact" in message
    assert TOKEN not in message and TOKEN not in caplog.text
    assert slept == [0.01, 0.02]  # doubled
    assert hub.names == ["create_repo", "repo_info", "upload_folder"] * 3
    assert _digest(step) == before


@pytest.mark.parametrize(
    ("where", "match"),
    [
        # The step's own copy: its bytes differ from those the export's commit sealed.
        ("step", r"refused: .* is not what its export committed: .*model.safetensors is damaged"),
        # A directory outside the step: compared tensor by tensor with the step.
        ("outside", r"refused: .* does not match .*\(largest difference .*not uploaded"),
    ],
)
def test_an_export_that_differs_from_its_step_is_never_sent(
    step: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, match: str
) -> None:
    from safetensors.torch import load_file, save_file

    from lightning_mcore_ckpt import hf

    folder = step / "huggingface"
    if where == "outside":
        folder = Path(shutil.copytree(folder, tmp_path / "out"))
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + torch.finfo(tensors[name].dtype).eps
    save_file(tensors, weights, metadata={"format": "pt"})
    hub = Hub().install(monkeypatch)
    with pytest.raises(hf.UploadError, match=match):
        hf.upload_export(folder, step, REPO)
    assert hub.calls == []


def test_private_is_honoured_an_existing_public_repository_is_refused(
    step: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_mcore_ckpt import hf

    hub = Hub(public=True).install(monkeypatch)
    with pytest.raises(hf.UploadError, match=r"exists and is public, and private=True was asked"):
        hf.upload_export(step / "huggingface", step, REPO, private=True)
    assert hub.names == ["create_repo", "repo_info"]  # not retried, nothing uploaded
    hub.calls.clear()
    hf.upload_export(step / "huggingface", step, REPO, private=False)
    assert hub.names == ["create_repo", "upload_folder"]
    assert hub.calls[0][1]["private"] is False


def test_the_uploader_runs_in_the_background_and_the_newest_waiting_step_supersedes(
    step: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_mcore_ckpt.hf import HubUploader

    steps = [step] + [step.with_name(f"global_step_{n}") for n in (8, 9)]
    for other in steps[1:]:
        shutil.copytree(step, other)
    release = threading.Event()
    hub = Hub(release=release).install(monkeypatch)
    uploader = HubUploader(REPO, private=True)
    uploader.submit(steps[0])  # returns at once: its upload waits for `release`
    assert hub.started.wait(60)
    uploader.submit(steps[1])
    uploader.submit(steps[2])  # step 8 has not started: superseded by step 9
    assert uploader.steps() == {7, 9}
    release.set()
    assert uploader.finish(timeout_s=60) == []
    sent = [Path(kw["folder_path"]).parent.name for n, kw in hub.calls if n == "upload_folder"]
    assert sent == ["global_step_7", "global_step_9"]
    rows = uploader.take_outcomes()
    assert [r["global_step"] for r in rows] == [7, 9]
    assert all(r["hf_upload_time_s"] > 0 and "hf_upload_failed" not in r for r in rows)
    assert uploader.steps() == set()
    uploader.close()


def test_the_uploader_reports_a_permanent_failure_and_a_timeout_at_finish(
    step: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_mcore_ckpt.hf import HubUploader

    Hub(fail=99).install(monkeypatch)
    uploader = HubUploader(REPO, attempts=2)
    uploader.submit(step)
    [(failed, error)] = uploader.finish(timeout_s=60)
    assert failed == str(step) and f"to {REPO} failed after 2 attempt(s)" in error
    assert uploader.take_outcomes() == [{"global_step": 7, "hf_upload_failed": 1.0}]
    assert (step / "metadata.json").is_file() and (step / "huggingface" / "config.json").is_file()

    release = threading.Event()
    Hub(release=release).install(monkeypatch)
    uploader.submit(step)
    [(failed, error)] = uploader.finish(timeout_s=0.2)
    assert "had not finished after upload_timeout_s=0.2" in error
    release.set()
    assert uploader.finish(timeout_s=60) == []
    uploader.close()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (
            {"upload_to": "no-slash"},
            r"HFExport\(upload_to='no-slash'\): pass a Hub model .*'org/name'",
        ),
        ({"upload_to": "a/b/c"}, r"upload_to='a/b/c'\).*one '/'"),
        ({"upload_to": "org/name", "private": "yes"}, r"HFExport\(private='yes'\): pass True or"),
        ({"upload_to": "org/name", "upload_attempts": 0}, r"upload_attempts=0\): pass an int >= 1"),
        (
            {"upload_to": "org/name", "upload_timeout_s": -1},
            r"upload_timeout_s=-1\): pass a finite",
        ),
    ],
)
def test_bad_upload_options_are_refused_at_construction(
    made: tuple[Path, Path], options: dict[str, Any], match: str
) -> None:
    from lightning_mcore_ckpt import HFExport

    with pytest.raises(ValueError, match=match):
        HFExport(made[0], **options)
    assert HFExport(made[0], upload_to="my-org/qwen.sft-2").private is True


def test_upload_options_come_from_yaml(made: tuple[Path, Path]) -> None:
    import yaml
    from jsonargparse import ArgumentParser

    from lightning_mcore_ckpt import HFExport, MegatronCheckpoint

    config = yaml.safe_load(
        f"""
        callback:
          class_path: lightning_mcore_ckpt.MegatronCheckpoint
          init_args:
            dirpath: ckpt
            hf_export:
              hf_model_path: {made[0]}
              when: every_save
              upload_to: {REPO}
              private: false
              upload_attempts: 5
              upload_timeout_s: 600
        """
    )
    parser = ArgumentParser()
    parser.add_argument("--callback", type=MegatronCheckpoint)
    built = parser.instantiate_classes(parser.parse_object(config))
    assert built.callback.hf_export == HFExport(
        str(made[0]), "every_save", upload_to=REPO, private=False, upload_attempts=5,
        upload_timeout_s=600,
    )  # fmt: skip


def test_cli_export_uploads_after_the_export_and_fails_with_exit_1(
    made: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src, step = made
    out = tmp_path / "out"
    hub = Hub().install(monkeypatch)
    args = ["export", str(step), "--hf-model", str(src), "--out", str(out)]
    assert cli_main([*args, "--upload-to", REPO]) == 0
    assert hub.names == ["create_repo", "repo_info", "upload_folder"]
    assert hub.calls[0][1]["private"] is True
    sent = hub.calls[-1][1]
    assert sent["folder_path"] == str(out) and sent["files"] == sorted(
        p.name for p in out.iterdir()
    )
    assert sent["commit_message"].startswith("global_step_7: ")
    assert f"uploaded to {REPO} (1 attempt(s))" in capsys.readouterr().out

    hub = Hub(fail=99).install(monkeypatch)
    again = tmp_path / "again"
    assert cli_main([*args[:-1], str(again), "--upload-to", REPO, "--no-private"]) == 1
    err = capsys.readouterr().err
    assert (
        f"error: export: upload of global_step_7 ({again}) to {REPO} failed after 3 attempt" in err
    )
    assert TOKEN not in err and hub.calls[0][1]["private"] is False
    assert json.loads((again / "config.json").read_text())  # the export stays

    # A malformed repository is refused before anything is written.
    bad = tmp_path / "bad"
    assert cli_main([*args[:-1], str(bad), "--upload-to", "not a repo"]) == 2
    assert "export --upload-to(upload_to='not a repo')" in capsys.readouterr().err
    assert not bad.exists()
