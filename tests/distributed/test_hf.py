"""Hugging Face export and import through mbridge, with real models, Trainers and files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli import installed_cli, run_cli

from lightning_mcore_ckpt.cli.entry import main as cli_main
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

FAMILIES = {
    # Qwen2: biased QKV, separate lm_head, one safetensors file.
    "qwen2": dict(family="qwen2"),
    # Llama: no biases, tied embeddings, weights in shards with an index.
    "llama-tied-sharded": dict(family="llama", tie_word_embeddings=True, max_shard_size="100KB"),
}
LOGITS_ATOL = 1e-4
"""fp32 Megatron-Core (local layers, TP=2) against fp32 transformers on the same weights."""


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_then_export_gives_back_the_same_files(
    tmp_path: Path, family: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    src = tiny_hf_model(tmp_path / "src", **FAMILIES[family])
    step = tmp_path / "imported"
    done = installed_cli("import", str(src), "--out", str(step))
    assert done.returncode == 0, done.stderr
    assert "lightning" not in done.imported, sorted(done.imported)  # the import needs none
    assert sorted(p.name for p in step.iterdir()) == ["metadata.json", "model"]
    assert json.loads((step / "metadata.json").read_text())["contents"] == ["model"]

    out = tmp_path / "exported"
    done = run_cli("export", str(step), "--hf-model", str(src), "--out", str(out))
    assert done.returncode == 0, done.stderr
    # Train 0 steps: every file is byte-identical to the source, weights and index included.
    assert _files(out) == _files(src)
    if "sharded" in family:
        assert len(list(out.glob("*.safetensors"))) > 1

    done = run_cli("verify", str(out), "--reference", str(src))
    assert done.returncode == 0, done.stdout
    assert "OK: they match" in done.stdout

    # A Hugging Face model of other shapes is refused before anything is written.
    other = tiny_hf_model(tmp_path / "other", **{**FAMILIES[family], "hidden_size": 32})
    bad = tmp_path / "bad"
    assert cli_main(["export", str(step), "--hf-model", str(other), "--out", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "does not match the Hugging Face config" in err and "config expects" in err
    assert not bad.exists() and not list(tmp_path.glob(".bad*"))
    # An existing export is kept unless --overwrite.
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    assert cli_main(["export", str(step), "--hf-model", str(src), "--out", str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (
        cli_main(["export", str(step), "--hf-model", str(src), "--out", str(out), "--overwrite"])
        == 0
    )
    assert _files(out) == _files(src)


def _train_from_hf(rank: int, world_size: int, tmp: str, family: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from _trainer import loader, make_trainer
    from lightning.pytorch.loggers import CSVLogger

    from lightning_mcore_ckpt import HFExport, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import HFGPTModule

    probe = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(7))
    out: dict[str, Any] = {}

    class Probe(pl.Callback):
        def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            with torch.no_grad():
                out["logits_at_start"] = module.logits(probe)

    src = str(Path(tmp, "src"))
    trainer = make_trainer(
        3,
        MegatronStrategy(tensor_model_parallel_size=2, init_from=src),
        world_size,
        callbacks=[
            MegatronCheckpoint(
                Path(tmp, "ckpt"), every_n_train_steps=2, hf_export=HFExport(src, when="end")
            ),
            Probe(),
        ],
        enable_checkpointing=True,
        logger=CSVLogger(tmp, name="csv", version=0),
        log_every_n_steps=1,
    )
    module = HFGPTModule(src, lr=1e-2)
    trainer.fit(module, train_dataloaders=loader(32, 2))
    with torch.no_grad():
        out["logits_at_end"] = module.logits(probe)
    out["probe"] = probe
    return out


def _hf_logits(path: Path, probe: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(probe).logits


def _export_at_tp1(rank: int, world_size: int, tmp: str) -> None:
    from _trainer import resave_on_this_layout_and_export

    resave_on_this_layout_and_export(tmp, "ckpt/global_step_3", "tp1")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_train_from_hf_at_tp2_export_once_and_match_logits(tmp_path: Path, family: str) -> None:
    import csv

    from lightning_mcore_ckpt.tiny import tiny_hf_model

    src = tiny_hf_model(tmp_path / "src", **FAMILIES[family])
    run = run_distributed(_train_from_hf, 2, str(tmp_path), family, timeout=280)[0]
    ckpt = tmp_path / "ckpt"

    # init_from: at the start, Megatron-Core computes what transformers computes from src.
    torch.testing.assert_close(
        run["logits_at_start"], _hf_logits(src, run["probe"]), rtol=0, atol=LOGITS_ATOL
    )
    # when="end": one export, into the final step (saved at the end: the cadence saved step 2).
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == [
        "global_step_2",
        "global_step_3",
    ]
    assert not (ckpt / "global_step_2" / "huggingface").exists()
    exported = ckpt / "global_step_3" / "huggingface"
    meta = json.loads((ckpt / "global_step_3" / "metadata.json").read_text())
    assert meta["contents"] == ["model", "optimizer", "extra", "hf_model"]
    assert meta["hf_export_time_s"] > 0
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("checkpoint/hf_export_time_s")]
    assert [(int(r["step"]), float(r["checkpoint/hf_export_time_s"])) for r in rows] == [
        (3, meta["hf_export_time_s"])
    ]
    # After training, the exported model computes the trained Megatron-Core model's logits.
    end = _hf_logits(exported, run["probe"])
    assert (end - _hf_logits(src, run["probe"])).abs().max() > 100 * LOGITS_ATOL  # it trained
    torch.testing.assert_close(run["logits_at_end"], end, rtol=0, atol=LOGITS_ATOL)
    # The tokenizer and generation config travel with it.
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (exported / name).read_bytes() == (src / name).read_bytes()

    # The same weights loaded at TP=1 and exported there give the same files.
    run_distributed(_export_at_tp1, 1, str(tmp_path), timeout=200)
    assert _files(tmp_path / "tp1_hf") == _files(exported)
    done = run_cli("verify", str(exported), "--reference", str(ckpt / "global_step_3"))
    assert done.returncode == 0, done.stdout


def _fit_until(rank: int, world_size: int, tmp: str, max_steps: int, crash_at: int | None) -> None:
    import lightning.pytorch as pl
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import HFExport, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import HFGPTModule

    class Crash(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == crash_at:
                raise RuntimeError(f"simulated crash at step {crash_at}")

    src = str(Path(tmp, "src"))
    trainer = make_trainer(
        max_steps,
        MegatronStrategy(init_from=src),
        world_size,
        callbacks=[
            MegatronCheckpoint(
                Path(tmp, "ckpt"), every_n_train_steps=1, max_to_keep=2, hf_export=HFExport(src)
            ),
            Crash(),
        ],
        enable_checkpointing=True,
    )
    try:
        trainer.fit(HFGPTModule(src), train_dataloaders=loader(32, 2), ckpt_path="last")
    except RuntimeError as err:
        if "simulated crash" not in str(err):
            raise


def test_export_at_end_happens_once_across_a_crash_and_resumes(tmp_path: Path) -> None:
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    tiny_hf_model(tmp_path / "src", family="qwen2")
    ckpt = tmp_path / "ckpt"

    def exported() -> list[str]:
        return sorted(p.parent.name for p in ckpt.glob("global_step_*/huggingface"))

    # Crashes at step 3, before its save (checkpoint callbacks run last): fit never ended,
    # nothing is exported.
    run_distributed(_fit_until, 1, str(tmp_path), 5, 3, timeout=200)
    assert sorted(p.name for p in ckpt.glob("global_step_*")) == ["global_step_1", "global_step_2"]
    assert exported() == []
    # Resumes at 2; step 5 is saved by the cadence, then exported once when fit ends.
    run_distributed(_fit_until, 1, str(tmp_path), 5, None, timeout=200)
    assert sorted(p.name for p in ckpt.glob("global_step_*")) == ["global_step_4", "global_step_5"]
    assert exported() == ["global_step_5"]
    meta = json.loads((ckpt / "global_step_5" / "metadata.json").read_text())
    assert "hf_model" in meta["contents"] and meta["hf_export_time_s"] > 0
    from lightning_mcore_ckpt.format.metrics import tree_bytes

    assert meta["size_bytes"] == tree_bytes(ckpt / "global_step_5")
    stamp = (ckpt / "global_step_5" / "huggingface" / "model.safetensors").stat().st_mtime_ns
    # The same command again: already at max_steps and exported; nothing is written.
    run_distributed(_fit_until, 1, str(tmp_path), 5, None, timeout=200)
    assert exported() == ["global_step_5"]
    again = (ckpt / "global_step_5" / "huggingface" / "model.safetensors").stat().st_mtime_ns
    assert again == stamp
    assert json.loads((ckpt / "global_step_5" / "metadata.json").read_text()) == meta


def _fit_with_mismatched_export(rank: int, world_size: int, tmp: str) -> str:
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import HFExport, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import HFGPTModule

    trainer = make_trainer(
        3,
        MegatronStrategy(),
        world_size,
        callbacks=[
            MegatronCheckpoint(
                Path(tmp, "ckpt"), every_n_train_steps=1, hf_export=HFExport(Path(tmp, "other"))
            )
        ],
        enable_checkpointing=True,
    )
    module = HFGPTModule(str(Path(tmp, "src")))
    try:
        trainer.fit(module, train_dataloaders=loader(8, 2))
    except ValueError as err:
        assert not module.step_losses  # refused before the first step
        return str(err)
    raise AssertionError("a mismatched HFExport was accepted")


def test_a_mismatched_hf_export_fails_before_training(tmp_path: Path) -> None:
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    tiny_hf_model(tmp_path / "src", "qwen2")
    tiny_hf_model(tmp_path / "other", "qwen2", intermediate_size=96)
    error = run_distributed(_fit_with_mismatched_export, 1, str(tmp_path), timeout=200)[0]
    assert "HFExport(hf_model_path=...)" in error and "the model does not match" in error
    assert "linear_fc1.weight: the model has [256, 64], the config gives [192, 64]" in error
    assert not list((tmp_path / "ckpt").glob("global_step_*"))


_IMPORT_IN_A_FRESH_PROCESS = r"""
import json, os, sys

import torch.distributed as dist
from megatron.core import parallel_state

from lightning_mcore_ckpt import hf
from lightning_mcore_ckpt.hf import _import

src, out = sys.argv[1], sys.argv[2]
during = []
load_hf_weights = _import.load_hf_weights


def spy(*args, **kwargs):
    # Megatron-Core's GPTModel, built just before, sets its attention backend in NVTE_* itself;
    # import_checkpoint puts those back when it returns.
    during.append(
        {
            "environ": {k: v for k, v in os.environ.items() if not k.startswith("NVTE_")},
            "world_size": dist.get_world_size(),
            "model_parallel": parallel_state.model_parallel_is_initialized(),
        }
    )
    return load_hf_weights(*args, **kwargs)


_import.load_hf_weights = spy
before = dict(os.environ)
assert not any(k.startswith("NVTE_") for k in before)
report = {}
# No process group: one is created for the call, without the environment, and destroyed.
hf.import_checkpoint(src, os.path.join(out, "fresh"))
report["fresh"] = {
    "environ_unchanged_during": during[-1]["environ"] == before,
    "environ_unchanged_after": dict(os.environ) == before,
    "world_size_during": during[-1]["world_size"],
    "model_parallel_during": during[-1]["model_parallel"],
    "dist_initialized_after": dist.is_initialized(),
    "model_parallel_after": parallel_state.model_parallel_is_initialized(),
}
# An existing single-process group is used and left as it was.
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
world = dist.group.WORLD
hf.import_checkpoint(src, os.path.join(out, "existing"))
report["existing"] = {
    "environ_unchanged_during": during[-1]["environ"] == before,
    "environ_unchanged_after": dict(os.environ) == before,
    "model_parallel_during": during[-1]["model_parallel"],
    "same_group_after": dist.is_initialized() and dist.group.WORLD is world,
    "model_parallel_after": parallel_state.model_parallel_is_initialized(),
}
dist.destroy_process_group()
print("REPORT " + json.dumps(report))
"""


def test_import_leaves_the_environment_and_process_groups_as_it_found_them(
    tmp_path: Path,
) -> None:
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    src = tiny_hf_model(tmp_path / "src", "qwen2")
    # Launcher variables that point nowhere: a group made from the environment would fail or hang.
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVTE_")}
    env.update(
        {
            "PYTHONWARNINGS": "ignore",
            "RANK": "3",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "4",
            "MASTER_ADDR": "host.invalid",
            "MASTER_PORT": "1",
        }
    )
    env.pop("TORCHELASTIC_RUN_ID", None)
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_IN_A_FRESH_PROCESS, str(src), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("REPORT "))
    report = json.loads(line.removeprefix("REPORT "))
    assert report["fresh"] == {
        "environ_unchanged_during": True,
        "environ_unchanged_after": True,
        "world_size_during": 1,
        "model_parallel_during": True,
        "dist_initialized_after": False,
        "model_parallel_after": False,
    }
    assert report["existing"] == {
        "environ_unchanged_during": True,
        "environ_unchanged_after": True,
        "model_parallel_during": True,
        "same_group_after": True,
        "model_parallel_after": False,
    }
    for name in ("fresh", "existing"):
        step = tmp_path / name
        assert sorted(p.name for p in step.iterdir()) == ["metadata.json", "model"]
    assert not list(tmp_path.glob(".fresh*")) and not list(tmp_path.glob(".existing*"))


def _train_bf16_true(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import HFExport, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import HFGPTModule

    src = str(Path(tmp, "src"))
    trainer = make_trainer(
        2,
        MegatronStrategy(tensor_model_parallel_size=2, init_from=src),
        world_size,
        precision="bf16-true",
        callbacks=[MegatronCheckpoint(Path(tmp, "ckpt"), hf_export=HFExport(src))],
        enable_checkpointing=True,
    )
    module = HFGPTModule(src, lr=1e-2)
    trainer.fit(module, train_dataloaders=loader(8, 2))
    trainer.strategy.teardown()
    probe = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = module.logits(probe).float()
    return {"logits": logits, "probe": probe, "dtypes": {str(p.dtype) for p in module.parameters()}}


def test_a_bf16_model_exports_in_bf16_and_computes_what_it_computed(tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from lightning_mcore_ckpt.tiny import tiny_hf_model

    tiny_hf_model(tmp_path / "src", "qwen2")
    out = run_distributed(_train_bf16_true, 2, str(tmp_path), timeout=240)[0]
    assert out["dtypes"] == {"torch.bfloat16"}
    exported = tmp_path / "ckpt" / "global_step_2" / "huggingface"
    files = list(exported.glob("*.safetensors"))
    assert files
    for file in files:
        with safe_open(file, framework="pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}, file
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():
        hf = model(out["probe"]).logits.float()
    # Both compute in bf16, with different kernels (fused QKV, layer order of the sums).
    torch.testing.assert_close(out["logits"], hf, rtol=0, atol=5e-2)
