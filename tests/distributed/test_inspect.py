"""``lightning-mcore-ckpt inspect``: whether a step loads into a layout and a model, from
metadata only.

Axes: the model (as saved, a key renamed, Megatron-Core's HybridModel and a GPTModel in its
place), the layout (as saved, a data-parallel change, a
tensor-parallel size the model cannot be split into, a model-parallel change a
``dp_reshardable`` optimizer state cannot follow), the dataloader (stateful, plain, saved inside
an epoch), and the step's tensor files (present, removed: the answers must not change).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from _cli import installed_cli

from lightning_mcore_ckpt.cli import entry as cli
from lightning_mcore_ckpt.format import layout, markers
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).resolve().parent


def _run(rank: int, world_size: int, root: str, stateful: bool) -> None:
    from _inspect_models import WithScale
    from _trainer import loader, make_trainer
    from torch.utils.data import DataLoader

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TokenDataset

    data = loader(64, 2) if stateful else DataLoader(TokenDataset(64), batch_size=2)
    callback = MegatronCheckpoint(root, every_n_train_steps=2, save_last=False)
    trainer = make_trainer(
        4, MegatronStrategy(), world_size, callbacks=[callback], enable_checkpointing=True
    )
    trainer.fit(WithScale(), train_dataloaders=data)


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inspect")
    run_distributed(_run, 2, str(root / "stateful"), True, timeout=250)
    run_distributed(_run, 2, str(root / "plain"), False, timeout=250)
    return {
        "stateful": root / "stateful" / "global_step_4",
        "plain": root / "plain" / "global_step_4",
    }


def _run_hybrid(rank: int, world_size: int, root: str) -> None:
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyHybridModule

    callback = MegatronCheckpoint(root, every_n_train_steps=2, save_last=False)
    strategy = MegatronStrategy(tensor_model_parallel_size=2)
    trainer = make_trainer(2, strategy, world_size, callbacks=[callback], enable_checkpointing=True)
    trainer.fit(TinyHybridModule(), train_dataloaders=loader(8, 2))


@pytest.fixture(scope="module")
def hybrid_step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("inspect-hybrid")
    run_distributed(_run_hybrid, 2, str(root), timeout=250)
    return root / "global_step_2"


def _config(tmp_path: Path, model: str, tp: int = 1, devices: int = 2) -> Path:
    text = f"""
trainer:
  accelerator: cpu
  devices: {devices}
  strategy:
    class_path: lightning_mcore_ckpt.MegatronStrategy
    init_args:
      tensor_model_parallel_size: {tp}
model:
  class_path: {model if "." in model else f"_inspect_models.{model}"}
"""
    path = tmp_path / f"{model}-{tp}-{devices}.yaml"
    path.write_text(text)
    return path


def _inspect(step: Path, *args: str) -> tuple[int, dict[str, Any]]:
    """The command, run in this process (its exit code and its --json report)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))  # the configs' model classes
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["inspect", str(step), "--json", *args])
    assert code in (0, 1), out.getvalue()
    return code, json.loads(out.getvalue())


def _blockers(report: dict[str, Any]) -> list[str]:
    return [f"[{f['topic']}] {f['message']}" for f in report["findings"] if f["blocker"]]


def _without_tensor_files(step: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy" / step.parent.name / step.name
    shutil.copytree(step, copy)
    removed = [p for p in copy.rglob("*.distcp")]
    for p in removed:
        p.unlink()
    assert removed and not list(copy.rglob("*.distcp"))
    return copy


def test_a_step_that_loads_says_so(steps: dict[str, Path], tmp_path: Path) -> None:
    config = _config(tmp_path, "WithScale")
    code, report = _inspect(steps["stateful"], "--config", str(config))
    assert (code, _blockers(report)) == (0, []), report
    topics = {f["topic"] for f in report["findings"]}
    assert {"format", "versions", "layout", "model", "optimizer", "data", "rng"} <= topics
    assert report["target_layout"]["data_parallel_size"] == 2
    text = json.dumps(report)
    assert "dataloader state for ranks 0-1 of 2" in text and "restored exactly" in text


HYBRID = "'gpt.' is a Megatron-Core HybridModel of 4 layers '*-*-' (saved one by one)"


def test_a_hybrid_step_is_named_and_loads_into_its_model_and_not_into_a_gpt(
    hybrid_step: Path, steps: dict[str, Path], tmp_path: Path
) -> None:
    hybrid = _config(tmp_path, "lightning_mcore_ckpt.tiny.TinyHybridModule", tp=2)
    code, report = _inspect(hybrid_step, "--config", str(hybrid))
    assert (code, _blockers(report)) == (0, []), report
    (named,) = [f["message"] for f in report["findings"] if "HybridModel" in f["message"]]
    assert named.startswith(HYBRID) and "no Hugging Face export" in named
    assert "HybridModel" not in json.dumps(_inspect(steps["stateful"])[1])  # a GPT's step
    # Another tensor-parallel size: its heads decide, as for a GPT; a PP change loads.
    code, report = _inspect(hybrid_step, "--config", str(hybrid), "--tp", "3")
    says = "num_attention_heads (4) must be a multiple of tensor_model_parallel_size (3)"
    assert code == 1 and any(says in b for b in _blockers(report)), report
    assert _inspect(hybrid_step, "--config", str(hybrid), "--tp", "1", "--pp", "2")[0] == 0
    # A GPT of the same width: its stacked layers are not in the hybrid step, and the hybrid
    # model's layers are not in the GPT.
    gpt = _config(tmp_path, "lightning_mcore_ckpt.tiny.TinyGPTModule", tp=2)
    code, report = _inspect(hybrid_step, "--config", str(gpt))
    assert code == 1
    blockers = _blockers(report)
    assert any(
        "'gpt.decoder.layers.self_attention.linear_qkv.weight' [2, 192, 64] is not in" in b
        for b in blockers
    ), blockers
    unloaded = "'gpt.decoder.layers.1.mlp.linear_fc1.weight' is in the checkpoint but not in"
    assert unloaded in json.dumps(report)
    # The same answers without a single tensor file: only metadata is read.
    bare = _without_tensor_files(hybrid_step, tmp_path)
    assert _inspect(bare, "--config", str(gpt)) == (code, {**report, "step": str(bare)})


def test_a_renamed_key_is_named_with_its_old_name(steps: dict[str, Path], tmp_path: Path) -> None:
    config = _config(tmp_path, "WithGain")
    code, report = _inspect(steps["stateful"], "--config", str(config))
    assert code == 1
    (blocker,) = _blockers(report)
    assert "'gain' [4] is not in the checkpoint" in blocker
    assert "renamed? the checkpoint has 'scale'" in blocker
    # The same answer without a single tensor file: only metadata is read.
    bare = _without_tensor_files(steps["stateful"], tmp_path)
    assert _inspect(bare, "--config", str(config)) == (code, {**report, "step": str(bare)})


def test_a_tensor_parallel_size_the_model_cannot_be_split_into_is_a_blocker(
    steps: dict[str, Path], tmp_path: Path
) -> None:
    config = _config(tmp_path, "WithScale")
    code, report = _inspect(steps["stateful"], "--config", str(config), "--tp", "3")
    says = "num_attention_heads (4) must be a multiple of tensor_model_parallel_size (3)"
    assert code == 1 and any(says in b for b in _blockers(report)), report
    assert _inspect(steps["stateful"], "--config", str(config), "--tp", "2")[0] == 0  # 4 heads
    bare = _without_tensor_files(steps["stateful"], tmp_path)
    assert _inspect(bare, "--config", str(config), "--tp", "3") == (
        code,
        {**report, "step": str(bare)},
    )


def _per_rank_positions(step: Path) -> None:
    # Loader state without ElasticSampler (a sampler of the user's own): positions per rank.
    import torch

    for file in (step / "extra").glob("rank_*.pt"):
        payload = torch.load(file, weights_only=True)
        fit = payload["lightning"]["loops"]["fit_loop"]["state_dict"]
        fit["combined_loader"] = [{"_sampler_iter_yielded": 4, "_num_yielded": 4}]
        torch.save(payload, file)


def test_a_data_parallel_change_follows_the_elastic_sampler_and_not_per_rank_positions(
    steps: dict[str, Path], tmp_path: Path
) -> None:
    code, report = _inspect(steps["stateful"], "--dp", "1")
    assert code == 0 and "ElasticSampler continues at the next global sample" in json.dumps(report)
    step = _without_tensor_files(steps["stateful"], tmp_path)
    _per_rank_positions(step)
    code, report = _inspect(step, "--dp", "1")
    assert code == 1
    (blocker,) = _blockers(report)
    assert "DP 2 -> 1: the dataloader positions are per rank and cannot be mapped" in blocker
    assert _inspect(step)[0] == 0  # the same data-parallel size: each rank takes its own


def test_a_dp_reshardable_optimizer_state_cannot_follow_a_model_parallel_change(
    steps: dict[str, Path], tmp_path: Path
) -> None:
    step = _without_tensor_files(steps["stateful"], tmp_path)
    meta = markers.read_metadata(step)
    assert meta is not None
    meta["optimizer_sharding"] = "dp_reshardable"  # as Megatron-Core's distributed optimizer saves
    meta.pop("metadata_hash")
    (step / markers.METADATA_FILE).write_text(json.dumps(meta))
    code, report = _inspect(step, "--tp", "2")
    assert code == 1
    assert any(
        "reshards across data-parallel sizes only (TP=1 saved, 2 wanted)" in b
        and "ckpt_optimizer_sharding='fully_reshardable'" in b
        for b in _blockers(report)
    ), report
    assert _inspect(step, "--dp", "1")[0] == 0  # a data-parallel change it follows


def test_a_missing_dataloader_state_inside_an_epoch_is_a_blocker(
    steps: dict[str, Path], tmp_path: Path
) -> None:
    code, report = _inspect(steps["plain"])
    assert code == 1
    (blocker,) = _blockers(report)
    assert "saved inside an epoch (after 4 batches)" in blocker
    assert "without the dataloader's position on ranks 0-1" in blocker
    assert "StatefulDataLoader" in blocker and "restore_dataloader=False" in blocker
    bare = _without_tensor_files(steps["plain"], tmp_path)
    assert _inspect(bare) == (code, {**report, "step": str(bare)})
    # The installed command: the same exit code and the blocker with its fix. It reads the
    # step's loop state without importing Lightning (seconds of a process's start).
    done = installed_cli("inspect", str(bare))
    assert done.returncode == 1, done.stderr[-2000:]
    assert (
        "BLOCKER [data] saved inside an epoch" in done.stdout and "FAILED: 1 blocker" in done.stdout
    )
    assert "torch" in done.imported and "lightning" not in done.imported, sorted(done.imported)


def test_the_hugging_face_copy_is_checked_against_its_config(
    steps: dict[str, Path], tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import save_file

    step = _without_tensor_files(steps["stateful"], tmp_path)
    hf = step / layout.HF_DIR
    hf.mkdir()
    config = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2}
    (hf / "config.json").write_text(json.dumps(config))
    tensors = {
        "model.embed_tokens.weight": torch.zeros(128, 64),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(64, 256),
        "model.layers.1.mlp.down_proj.weight": torch.zeros(64, 256),
    }
    save_file(tensors, str(hf / "model.safetensors"))
    code, report = _inspect(step)
    assert code == 0 and "2 layers" not in json.dumps(report)
    assert "huggingface/: 3 tensors, consistent with config.json" in json.dumps(report)
    (hf / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    code, report = _inspect(step)
    assert code == 1
    (blocker,) = _blockers(report)
    assert "model.embed_tokens.weight is [128, 64], config.json says [128, 32]" in blocker
