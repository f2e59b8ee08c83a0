"""GPU tier on one GPU: what the product runs, checked where it runs (CUDA, NCCL, world size 1).

Skipped without CUDA. Exact resume (losses, RNG with the CUDA streams, data, weights, optimizer
state at every step) through SIGTERM (a preemption) and a hard kill, across the optimizer
(torch AdamW; Megatron's distributed optimizer over Megatron DDP, both sharding types), the
precision (fp32; Lightning's ``bf16-mixed`` and ``bf16-true``; Megatron's own bf16 with fp32 main
parameters) and sync/async saves; a save's staging observed inside ``fit`` (from the GPU into
pinned host memory, a snapshot; unbounded and bounded by ``ckpt_max_staging_bytes``); the
Hugging Face export of a bf16 model, its logits computed inside ``fit`` on the GPU. The staging
and export checks are shared with their CPU twins (``tests/distributed/_staging.py``). Two ranks
cannot share one GPU under NCCL (it refuses two ranks on one device): the 2-process GPU tests
are in the 2-GPU files of this directory.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt import check_resume
from lightning_mcore_ckpt.format import markers
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# (optimizer, precision, async save, sharding of the distributed optimizer)
CELLS = [
    ("distributed", "megatron-bf16", True, "dp_reshardable"),
    ("distributed", "32", False, "fully_reshardable"),
    ("distributed", "bf16-mixed", True, "fully_reshardable"),
    ("megatron", "megatron-bf16", False, "dp_reshardable"),
    ("adamw", "bf16-mixed", True, "dp_reshardable"),
    ("adamw", "bf16-true", False, "dp_reshardable"),
    ("adamw", "32", True, "dp_reshardable"),
]


@pytest.mark.parametrize("cell", CELLS, ids=["-".join(map(str, c)) for c in CELLS])
def test_one_gpu_resumes_exactly(tmp_path: Path, cell: tuple[Any, ...]) -> None:
    import _jobs

    optimizer, precision, async_save, sharding = cell
    report = check_resume(
        functools.partial(
            _jobs.build,
            layout="1",
            accelerator="gpu",
            optimizer=optimizer,
            precision=precision,
            async_save=async_save,
            optimizer_sharding=sharding,
            steps_per_epoch=4,
        ),
        stop_at=3,
        max_steps=6,
        how=("sigterm", "kill"),
        world_size=1,
        workdir=tmp_path / "work",
        check_determinism=False,
    )
    assert report.exact, str(report)
    step = tmp_path / "work" / "sigterm" / "checkpoints" / "global_step_3"
    metadata = markers.read_metadata(step)
    assert metadata is not None
    assert metadata.get("optimizer_sharding") == (sharding if optimizer == "distributed" else None)
    assert "torch_cuda" not in str(metadata)  # RNG lives in extra/, per rank


@pytest.mark.parametrize("router", ["aux_loss", "expert_bias"])
def test_one_gpu_moe_resumes_exactly(tmp_path: Path, router: str) -> None:
    # A mixture of experts (EP=1: every expert on the one GPU) in Megatron-Core's bf16 with the
    # distributed optimizer (a chain of a dense and an expert optimizer), a warmup + cosine
    # schedule; the router's fp32 expert_bias stays fp32 and is restored (the probe digests
    # every persistent buffer with its dtype).
    import _jobs

    report = check_resume(
        functools.partial(
            _jobs.build,
            layout="1",
            accelerator="gpu",
            optimizer="distributed",
            optimizer_sharding="fully_reshardable",
            precision="megatron-bf16",
            async_save=True,
            router=router,
            scheduler="warmup_cosine",
            steps_per_epoch=4,
        ),
        stop_at=3,
        max_steps=6,
        how=("sigterm", "kill"),
        world_size=1,
        workdir=tmp_path / "work",
        check_determinism=False,
    )
    assert report.exact, str(report)


# (async save, ckpt_max_staging_bytes): unbounded; bounded below the tiny model's largest tensor
# (bucket after bucket through one pinned ring); a sync save, bounded (device tensors are copied
# to the host in a sync save too).
STAGING_CELLS = {
    "async-unbounded": (True, None),
    "async-bounded": (True, 16 * 2**10),
    "sync-bounded": (False, 16 * 2**10),
}


@pytest.mark.parametrize("cell", list(STAGING_CELLS))
def test_a_save_inside_fit_stages_from_the_gpu_into_pinned_memory_and_writes_the_snapshot(
    tmp_path: Path, cell: str
) -> None:
    # The same functions as the CPU twin (tests/distributed/test_staging_in_fit.py), observed
    # while the Trainer trains: before Lightning's teardown moves the state to the CPU.
    import _staging

    async_save, cap = STAGING_CELLS[cell]
    (out,) = run_distributed(
        _staging.observe_async_save, 1, str(tmp_path), "gpu", cap, async_save, timeout=500
    )
    _staging.check_staging(out, "gpu", async_save)
    _staging.saved_weights_are_the_snapshot(str(tmp_path), out["before"])


def test_a_bf16_model_exports_to_hugging_face_in_bf16(tmp_path: Path) -> None:
    # The logits are computed inside fit (on_train_end, before teardown), on the GPU.
    import _staging

    from lightning_mcore_ckpt.tiny import tiny_hf_model

    tiny_hf_model(tmp_path / "src", "qwen2")
    (out,) = run_distributed(_staging.export_bf16, 1, str(tmp_path), "gpu", timeout=500)
    _staging.check_bf16_export(tmp_path, out, "gpu")
