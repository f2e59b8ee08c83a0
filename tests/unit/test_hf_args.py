"""Bad Hugging Face export / import input gets a clear error before any work is done.

A bad option is a ``ConfigurationError``: a ``ValueError`` and Lightning's
``MisconfigurationException``, so that code written for either catches it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_mcore_ckpt.cli.entry import main as cli_main


@contextlib.contextmanager
def refused(match: str) -> Iterator[None]:
    """The block raises an error matching ``match`` that is both a ``ValueError`` and Lightning's
    ``MisconfigurationException``."""
    with pytest.raises(MisconfigurationException, match=match) as caught:
        yield
    assert isinstance(caught.value, ValueError), type(caught.value)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    return tiny_hf_model(tmp_path_factory.mktemp("hf") / "qwen2", "qwen2")


def _unknown_family(tmp_path: Path) -> Path:
    path = tmp_path / "unknown"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "not_a_family"}))
    return path


def test_hf_export_arguments_are_checked(qwen2: Path, tmp_path: Path) -> None:
    from lightning_mcore_ckpt import HFExport

    assert HFExport(qwen2).when == "end"
    with refused(r"HFExport\(when='always'\): use one of"):
        HFExport(qwen2, when="always")  # type: ignore[arg-type]
    with refused(r"HFExport\(dtype=.bf16.\): pass one of torch.float32"):
        HFExport(qwen2, dtype="bf16")  # type: ignore[arg-type]
    with refused(r"HFExport\(head='critic'\): use one of"):
        HFExport(qwen2, head="critic")  # type: ignore[arg-type]
    with refused(r"HFExport: adapters='lora' \(--adapters\): use 'merged'"):
        HFExport(qwen2, adapters="lora")  # type: ignore[arg-type]
    with refused(r"HFExport\(upload_to='not a repo'\): pass a Hub model repository"):
        HFExport(qwen2, upload_to="not a repo")
    with refused(r"HFExport\(upload_attempts=0\): pass an int >= 1"):
        HFExport(qwen2, upload_to="org/name", upload_attempts=0)
    with pytest.raises(FileNotFoundError, match=r"hf_model_path=...\): '.*nope' does not exist"):
        HFExport(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        HFExport(tmp_path)
    with refused(r"model_type='not_a_family'.*supported model types: .*qwen2"):
        HFExport(_unknown_family(tmp_path))


def test_callback_and_strategy_refuse_bad_hf_settings(qwen2: Path, tmp_path: Path) -> None:
    from lightning_mcore_ckpt import HFExport, MegatronCheckpoint, MegatronStrategy

    with refused(r"hf_export='x'\): pass lightning_mcore_ckpt.HFExport"):
        MegatronCheckpoint(tmp_path / "c", hf_export="x")  # type: ignore[arg-type]
    with refused("'hf_model' needs hf_export=HFExport"):
        MegatronCheckpoint(tmp_path / "c", save_contents=["model", "hf_model"])
    MegatronCheckpoint(
        tmp_path / "c", save_contents=["model", "hf_model"], hf_export=HFExport(qwen2)
    )
    with refused(r"init_from='.*nope'\): '.*nope' does not exist\. Pass a local directory"):
        MegatronStrategy(init_from=tmp_path / "nope")
    with refused("model_type='not_a_family'"):
        MegatronStrategy(init_from=_unknown_family(tmp_path))
    assert not (tmp_path / "c").exists()


def test_export_refuses_an_incomplete_step_and_writes_nothing(
    qwen2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    step = tmp_path / "global_step_4"
    (step / "model").mkdir(parents=True)
    out = tmp_path / "out"
    assert cli_main(["export", str(step), "--hf-model", str(qwen2), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "global_step_4 is incomplete" in err and "metadata.json" in err
    assert not out.exists()
    assert cli_main(["export", str(tmp_path), "--hf-model", str(qwen2), "--out", str(out)]) == 2
    assert "not a step directory" in capsys.readouterr().err
    assert not out.exists()


def test_import_refuses_unknown_families_and_non_empty_outputs(
    qwen2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert cli_main(["import", str(_unknown_family(tmp_path)), "--out", str(out)]) == 2
    assert "model_type='not_a_family'" in capsys.readouterr().err
    assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli_main(["import", str(qwen2), "--out", str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    assert cli_main(["import", str(qwen2), "--out", str(tmp_path / "x"), "--prefix", "gpt"]) == 2
    assert "--prefix 'gpt' must end with '.'" in capsys.readouterr().err


def test_verify_needs_two_real_directories(
    qwen2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["verify", str(qwen2), "--reference", str(qwen2)]) == 0
    assert "OK: they match" in capsys.readouterr().out
    assert cli_main(["verify", str(tmp_path), "--reference", str(qwen2)]) == 2
    assert "not a Hugging Face directory" in capsys.readouterr().err
    assert cli_main(["verify", str(qwen2), "--reference", str(tmp_path)]) == 2
    assert "neither a Hugging Face directory" in capsys.readouterr().err


def test_verify_reports_the_largest_difference(
    qwen2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    changed = tmp_path / "changed"
    shutil.copytree(qwen2, changed)
    tensors = load_file(changed / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 0.5
    tensors["lm_head.weight"] = tensors["lm_head.weight"].to(torch.float16)
    save_file(tensors, str(changed / "model.safetensors"), metadata={"format": "pt"})
    assert cli_main(["verify", str(changed), "--reference", str(qwen2)]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH lm_head.weight: dtype torch.float16 != torch.float32" in out
    assert "largest |difference| 0.5 (model.norm.weight)" in out
    assert "FAILED" in out
    assert cli_main(["verify", str(changed), "--reference", str(qwen2), "--atol", "1"]) == 1


@pytest.mark.parametrize("where", ["step", "run", "hf_model"])
def test_export_never_replaces_what_it_reads(
    qwen2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    step = tmp_path / "run" / "global_step_4"
    (step / "model").mkdir(parents=True)
    out = {"step": step, "run": tmp_path / "run", "hf_model": qwen2}[where]
    argv = ["export", str(step), "--hf-model", str(qwen2), "--out", str(out), "--overwrite"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert f"--out {out} is the" in err and "would delete what is being read" in err
    assert (step / "model").is_dir() and (qwen2 / "config.json").is_file()


def test_import_never_replaces_the_model_it_reads(
    qwen2: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["import", str(qwen2), "--out", str(qwen2.parent), "--overwrite"]
    assert cli_main(argv) == 2
    assert "would delete what is being read" in capsys.readouterr().err
    assert (qwen2 / "config.json").is_file()


@pytest.mark.parametrize("atol", ["-1", "nan", "inf"])
def test_verify_refuses_a_tolerance_that_is_not_a_finite_number_at_least_0(
    qwen2: Path, capsys: pytest.CaptureFixture[str], atol: str
) -> None:
    assert cli_main(["verify", str(qwen2), "--reference", str(qwen2), "--atol", atol]) == 2
    assert f"atol={float(atol)!r} (--atol): pass a finite number >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool])
def test_hf_export_refuses_a_dtype_weights_cannot_have(qwen2: Path, dtype: torch.dtype) -> None:
    from lightning_mcore_ckpt import HFExport

    with refused(rf"HFExport\(dtype={dtype}\): pass one of torch.float32"):
        HFExport(qwen2, dtype=dtype)


def test_strategy_timeout_must_be_a_timedelta() -> None:
    from lightning_mcore_ckpt import MegatronStrategy

    with refused(r"timeout=60\): pass a positive datetime.timedelta"):
        MegatronStrategy(timeout=60)  # type: ignore[arg-type]
