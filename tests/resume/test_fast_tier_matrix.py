"""Exact resume from the fast tier across the axes users vary: every value of every axis, and
every pair of values (all-pairs, as ``test_matrix.py`` builds the persistent tier's matrix).

Each cell is one real resume check (``check_resume``) on 2 gloo processes of one node: the job
saves a fast step after every step (``replicas=0``: the node's own copies) and its persistent
tier never within the run; it runs uninterrupted, then is killed (SIGKILL of every rank) once
step :data:`STOP_AT` and its fast step are done, and resumed with ``fit(ckpt_path="last")``.
Per-step losses, the samples every rank received, every RNG stream, weights, optimizer and LR
scheduler state and the loop counters must be bit-identical at every batch, and the resume
must have come from the fast tier's step :data:`STOP_AT` (its recovery record says so).

Axes:

- ``layout``: data, tensor or pipeline parallelism of 2;
- ``optimizer``: torch AdamW; Megatron-Core's distributed optimizer, its persistent tier saved
  ``dp_reshardable`` and ``fully_reshardable`` (a fast step holds it ``dp_reshardable``
  either way); a mixture of experts at EP=2 (4 experts, 2 routed per token, the auxiliary
  loss), whose distributed optimizer is a ``ChainedOptimizer`` of a dense and an expert one;
- ``precision``: fp32; Lightning's ``bf16-mixed``; Megatron's bf16 (bf16 weights in
  ``Float16Module``, fp32 main parameters);
- ``frozen``: none; the embedding and layer 0's attention frozen, left out of the optimizer;
  a LoRA-style adapter the only trainable weights;
- ``accumulate``: gradient accumulation over 1 or 3 batches;
- ``data``: a stateful loader resumed at its first or a later worker; a DataModule;
- ``scheduler``: the LR schedule stepped every step or every epoch.

How the job is interrupted is not an axis: a SIGTERM saves the persistent tier on the way out
and a clean stop saves at the end of fit, so only a kill leaves the fast tier the newest step.
The fast tier's other interruptions (a node wiped, copies damaged) are
``nodes/test_fast_tier.py``'s.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import _jobs
import pytest
from _pairwise import coverage_problems

from lightning_mcore_ckpt import check_resume

AXES: dict[str, list[Any]] = {
    "layout": ["dp2", "tp2", "pp2"],
    "optimizer": ["adamw", "distributed", "distributed_full", "moe"],
    "precision": ["32", "bf16-mixed", "megatron-bf16"],
    "frozen": ["none", "trainable_only", "lora"],
    "accumulate": [1, 3],
    "data": ["stateful0", "stateful2", "datamodule"],
    "scheduler": ["step", "epoch"],
}

EXCLUDED = [
    # Expert parallelism of 2 on 2 processes leaves no rank for tensor or pipeline parallelism.
    ("layout", "tp2", "optimizer", "moe"),
    ("layout", "pp2", "optimizer", "moe"),
    # Megatron DDP holds the Megatron-Core model; the LoRA adapter sits outside it (a torch
    # optimizer's job), and the model itself is frozen: nothing for a Megatron optimizer.
    ("frozen", "lora", "optimizer", "distributed"),
    ("frozen", "lora", "optimizer", "distributed_full"),
    ("frozen", "lora", "optimizer", "moe"),
    ("frozen", "lora", "precision", "megatron-bf16"),
    # Megatron's mixed precision keeps its fp32 main parameters in a Megatron optimizer.
    ("precision", "megatron-bf16", "optimizer", "adamw"),
    # Megatron-Core's MoE router does not train under torch autocast without Transformer
    # Engine: refused at setup (tests/distributed/test_moe_autocast.py).
    ("precision", "bf16-mixed", "optimizer", "moe"),
]

# fmt: off
CELLS = [
    ("dp2", "moe", "megatron-bf16", "none", 1, "datamodule", "step"),
    ("tp2", "adamw", "bf16-mixed", "trainable_only", 3, "stateful2", "epoch"),
    ("pp2", "distributed", "32", "trainable_only", 3, "stateful0", "step"),
    ("dp2", "adamw", "32", "lora", 1, "stateful0", "epoch"),
    ("pp2", "distributed_full", "bf16-mixed", "none", 3, "datamodule", "epoch"),
    ("tp2", "distributed_full", "megatron-bf16", "trainable_only", 1, "stateful2", "step"),
    ("dp2", "distributed", "bf16-mixed", "none", 1, "stateful2", "step"),
    ("tp2", "distributed", "megatron-bf16", "none", 3, "stateful0", "epoch"),
    ("tp2", "adamw", "32", "lora", 3, "datamodule", "step"),
    ("dp2", "moe", "32", "trainable_only", 3, "stateful2", "epoch"),
    ("pp2", "adamw", "bf16-mixed", "lora", 1, "stateful2", "epoch"),
    ("dp2", "distributed_full", "32", "none", 1, "stateful0", "step"),
    ("pp2", "distributed", "megatron-bf16", "trainable_only", 1, "datamodule", "epoch"),
    ("dp2", "adamw", "bf16-mixed", "none", 3, "stateful0", "step"),
    ("dp2", "moe", "megatron-bf16", "trainable_only", 1, "stateful0", "step"),
]
# fmt: on

STEPS_PER_EPOCH = 4  # the fast tier saves inside an epoch only: STOP_AT is not an epoch's end
STOP_AT = 2
MAX_STEPS = 5


def _build_args(values: tuple[Any, ...]) -> dict[str, Any]:
    cell = dict(zip(AXES, values, strict=True))
    if cell["optimizer"] == "moe":
        cell.update(optimizer="distributed", ep=2, router="aux_loss")
    return cell


def _name(values: tuple[Any, ...]) -> str:
    return "-".join(str(v) for v in values)


def test_the_cells_cover_every_pair_of_axis_values() -> None:
    assert coverage_problems(AXES, CELLS, EXCLUDED) == []


@pytest.mark.matrix
@pytest.mark.timeout(400)
@pytest.mark.parametrize("values", CELLS, ids=[_name(c) for c in CELLS])
def test_resume_from_the_fast_tier_is_exact(tmp_path: Path, values: tuple[Any, ...]) -> None:
    build = functools.partial(
        _jobs.build, steps_per_epoch=STEPS_PER_EPOCH, fast_tier=True, **_build_args(values)
    )
    report = check_resume(
        build,
        stop_at=STOP_AT,
        max_steps=MAX_STEPS,
        how="kill",
        world_size=2,
        workdir=tmp_path / "work",
        check_determinism=False,
    )
    assert report.exact, str(report)
    (result,) = report.results
    assert result.resumed_from == STOP_AT, str(report)
    assert result.recovery is not None and result.recovery["tier"] == "fast", result.recovery
    assert result.recovery["step"] == STOP_AT, result.recovery
