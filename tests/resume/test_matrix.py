"""Exact resume across the axes users vary: every value of every axis, and every pair of values.

Each cell is one real resume check (``check_resume``): the job runs uninterrupted, then is
interrupted at ``stop_at`` and resumed from "last", on 2 gloo processes; losses, the samples every
rank received, every RNG stream, weights, optimizer and LR scheduler state and the loop counters
must be bit-identical at every batch. The cells were chosen so that every pair of axis values
meets at least once (``test_the_cells_cover_every_pair_of_axis_values``); ``docs/resume.md``
lists them with their results.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import _jobs
import pytest
from _pairwise import coverage_problems

from lightning_mcore_ckpt import check_resume
from lightning_mcore_ckpt.format import layout
from lightning_mcore_ckpt.hf._names import hybrid_layer_pattern
from lightning_mcore_ckpt.safety import safe_dcp as _safe_dcp
from lightning_mcore_ckpt.testing import DistributedFailure

AXES: dict[str, list[Any]] = {
    "layout": ["dp2", "tp2", "pp2"],
    "cadence": ["steps", "epochs", "epochs_train_end", "time", "topk"],
    "how": ["clean", "sigterm", "kill", "max_steps"],
    "accumulate": [1, 3],
    "frozen": ["none", "all_params", "trainable_only", "lora"],
    "async_save": [False, True],
    "data": ["stateful0", "stateful2", "datamodule", "plain"],
    "scheduler": ["step", "epoch"],
    # Lightning's precision plugins, and Megatron-Core's own mixed precision (bf16 weights in
    # Float16Module, fp32 main parameters in the Megatron optimizer).
    "precision": ["32", "bf16-mixed", "bf16-true", "megatron-bf16"],
    # torch AdamW; Megatron-Core's optimizer over Megatron DDP; its distributed optimizer,
    # saved dp_reshardable and fully_reshardable.
    "optimizer": ["adamw", "megatron", "distributed", "distributed_full"],
    # Megatron-Core's GPTModel; its HybridModel (attention and MLP layers, "*-*-", from a
    # Transformer-Engine-free layer spec), which 0.19 recommends in its place.
    "model": ["gpt", "hybrid"],
}

EXCLUDED = [
    # Megatron DDP holds the Megatron-Core model; the LoRA adapter sits outside it (a torch
    # optimizer's job), and the model itself is frozen: nothing for a Megatron optimizer.
    ("frozen", "lora", "optimizer", "megatron"),
    ("frozen", "lora", "optimizer", "distributed"),
    ("frozen", "lora", "optimizer", "distributed_full"),
    ("frozen", "lora", "precision", "megatron-bf16"),
    # Megatron's mixed precision keeps its fp32 main parameters in a Megatron optimizer.
    ("precision", "megatron-bf16", "optimizer", "adamw"),
    # bf16 weights under a Megatron optimizer are Megatron's mixed precision ("megatron-bf16").
    ("precision", "bf16-true", "optimizer", "megatron"),
    ("precision", "bf16-true", "optimizer", "distributed"),
    ("precision", "bf16-true", "optimizer", "distributed_full"),
]

# fmt: off
CELLS = [
    ("tp2", "time", "sigterm", 1, "all_params", True, "plain", "epoch", "megatron-bf16", "megatron", "hybrid"),
    ("pp2", "epochs_train_end", "max_steps", 3, "all_params", False, "datamodule", "step", "bf16-mixed", "adamw", "hybrid"),
    ("dp2", "steps", "clean", 3, "trainable_only", False, "stateful0", "epoch", "32", "distributed", "hybrid"),
    ("dp2", "topk", "kill", 1, "lora", True, "stateful2", "step", "bf16-true", "adamw", "hybrid"),
    ("pp2", "epochs", "clean", 1, "none", True, "plain", "step", "32", "distributed_full", "hybrid"),
    ("tp2", "time", "kill", 3, "none", False, "stateful2", "epoch", "bf16-mixed", "distributed_full", "gpt"),
    ("tp2", "epochs_train_end", "max_steps", 1, "trainable_only", True, "stateful0", "step", "megatron-bf16", "distributed", "gpt"),
    ("pp2", "epochs", "sigterm", 3, "lora", False, "stateful0", "epoch", "bf16-true", "adamw", "gpt"),
    ("dp2", "steps", "sigterm", 1, "none", True, "datamodule", "step", "bf16-mixed", "megatron", "gpt"),
    ("pp2", "topk", "kill", 3, "trainable_only", False, "plain", "epoch", "megatron-bf16", "megatron", "gpt"),
    ("tp2", "time", "clean", 1, "lora", False, "datamodule", "epoch", "32", "adamw", "gpt"),
    ("dp2", "epochs", "max_steps", 3, "all_params", True, "stateful2", "epoch", "32", "megatron", "gpt"),
    ("dp2", "epochs_train_end", "sigterm", 3, "trainable_only", True, "stateful2", "epoch", "megatron-bf16", "distributed_full", "gpt"),
    ("tp2", "steps", "max_steps", 1, "lora", True, "plain", "epoch", "bf16-true", "adamw", "gpt"),
    ("pp2", "epochs", "kill", 1, "trainable_only", False, "datamodule", "epoch", "bf16-mixed", "distributed", "gpt"),
    ("tp2", "topk", "clean", 1, "all_params", True, "stateful0", "step", "bf16-mixed", "distributed_full", "gpt"),
    ("dp2", "time", "max_steps", 3, "none", False, "stateful0", "step", "megatron-bf16", "distributed", "gpt"),
    ("pp2", "steps", "kill", 1, "all_params", True, "stateful2", "epoch", "32", "distributed", "gpt"),
    ("dp2", "topk", "sigterm", 3, "none", False, "plain", "step", "32", "distributed", "gpt"),
    ("tp2", "epochs_train_end", "clean", 3, "none", True, "datamodule", "epoch", "bf16-true", "adamw", "gpt"),
    ("pp2", "time", "kill", 3, "trainable_only", True, "stateful0", "epoch", "bf16-true", "adamw", "gpt"),
    ("tp2", "epochs", "max_steps", 1, "trainable_only", False, "datamodule", "epoch", "megatron-bf16", "distributed_full", "gpt"),
    ("pp2", "epochs_train_end", "kill", 1, "lora", False, "plain", "epoch", "bf16-mixed", "adamw", "gpt"),
    ("tp2", "epochs_train_end", "clean", 1, "none", True, "stateful0", "step", "32", "megatron", "gpt"),
    ("dp2", "steps", "clean", 3, "none", True, "stateful2", "step", "megatron-bf16", "distributed_full", "gpt"),
    ("pp2", "topk", "max_steps", 1, "all_params", True, "datamodule", "epoch", "bf16-true", "adamw", "gpt"),
]
# fmt: on

STEPS_PER_EPOCH = 3
MAX_STEPS = 5


def _cell(values: tuple[Any, ...]) -> dict[str, Any]:
    return dict(zip(AXES, values, strict=True))


def _stop_at(cell: dict[str, Any]) -> int:
    # Epoch cadences save at epoch ends, and a plain DataLoader can only resume there: those
    # cells stop exactly at the end of the first epoch; the others inside the second half of it.
    at_epoch_end = cell["cadence"] in ("epochs", "epochs_train_end", "topk")
    return STEPS_PER_EPOCH if at_epoch_end or cell["data"] == "plain" else 2


def _name(values: tuple[Any, ...]) -> str:
    return "-".join(str(v) for v in values)


def test_the_cells_cover_every_pair_of_axis_values() -> None:
    assert coverage_problems(AXES, CELLS, EXCLUDED) == []


@pytest.mark.matrix
@pytest.mark.timeout(400)
@pytest.mark.parametrize("values", CELLS, ids=[_name(c) for c in CELLS])
def test_resume_is_exact(tmp_path: Path, values: tuple[Any, ...]) -> None:
    cell = _cell(values)
    how = cell.pop("how")
    report = check_resume(
        functools.partial(_jobs.build, steps_per_epoch=STEPS_PER_EPOCH, **cell),
        stop_at=_stop_at({**cell, "how": how}),
        max_steps=MAX_STEPS,
        how=how,
        world_size=2,
        workdir=tmp_path / "work",
        check_determinism=False,
    )
    assert report.exact, str(report)
    (result,) = report.results
    assert result.resumed_from and result.resumed_from > 0
    # The model the steps hold: a hybrid model's layers are saved one by one, by kind.
    steps = (tmp_path / "work").glob("*/checkpoints/global_step_*")
    (step, *_) = [s for s in steps if layout.is_complete(s)]
    keys = _safe_dcp.read_dcp_metadata(step / layout.MODEL_DIR).state_dict_metadata
    pattern = hybrid_layer_pattern(k.removeprefix("gpt.") for k in keys)
    assert pattern == ("*-*-" if cell["model"] == "hybrid" else None), sorted(keys)


@pytest.mark.matrix
@pytest.mark.timeout(400)
@pytest.mark.parametrize("stop_at", [1, 2], ids=["after-first-batch", "mid-epoch"])
def test_a_plain_dataloader_resumed_inside_an_epoch_is_refused_before_training(
    tmp_path: Path, stop_at: int
) -> None:
    # A step saved at the last batch of an epoch resumes (the matrix's plain-loader cells).
    with pytest.raises(DistributedFailure, match=r"cannot restore its position") as failure:
        check_resume(
            functools.partial(_jobs.build, layout="dp2", data="plain", every=1),
            stop_at=stop_at,
            max_steps=MAX_STEPS,
            how="sigterm",
            world_size=2,
            workdir=tmp_path / "work",
            check_determinism=False,
        )
    assert "StatefulDataLoader" in str(failure.value)
    assert f"after {stop_at} of its 4 batches" in str(failure.value)
    # Refused before any batch: the resumed run recorded none.
    probe = tmp_path / "work" / "sigterm" / "resumed" / "probe"
    assert not any(p.read_text().count('"loop"') for p in probe.glob("rank_*.jsonl"))
