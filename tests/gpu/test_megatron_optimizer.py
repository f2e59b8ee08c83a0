"""GPU tier, 2 GPUs: Megatron's distributed optimizer over Megatron DDP at DP=2 and TP=2 (NCCL).

Exact resume (losses, RNG, data, weights, optimizer at every step) through SIGTERM and a hard
kill, with bf16 weights and fp32 main parameters, async saves, both sharding types.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from _marks import TWO_GPUS

from lightning_mcore_ckpt import check_resume

pytestmark = TWO_GPUS


@pytest.mark.parametrize(
    ("layout", "sharding"), [("dp2", "dp_reshardable"), ("tp2", "fully_reshardable")]
)
def test_distributed_optimizer_resumes_bit_identically(
    tmp_path: Path, layout: str, sharding: str
) -> None:
    import _jobs

    report = check_resume(
        functools.partial(
            _jobs.build,
            layout=layout,
            accelerator="gpu",
            optimizer="distributed",
            optimizer_sharding=sharding,
            precision="megatron-bf16",
            async_save=True,
            steps_per_epoch=4,
        ),
        stop_at=3,
        max_steps=6,
        how=("sigterm", "kill"),
        world_size=2,
        workdir=tmp_path / "work",
        check_determinism=False,
    )
    assert report.exact, str(report)
