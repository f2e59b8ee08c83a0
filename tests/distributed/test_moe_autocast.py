"""A mixture of experts under torch autocast is refused at setup, before a step.

Megatron-Core's MoE router computes its logits in an autograd function of its own whose
backward, without Transformer Engine, multiplies the half-precision gradient autocast gave its
output by the fp32 weight: ``Trainer(precision="bf16-mixed")`` failed at the first backward
with ``expected m1 and m2 to have the same dtype``, on any device. The strategy refuses it at
setup on every rank, naming the precision, the model and Megatron-Core's own mixed precision as
the fix; nothing is trained or written. The fix trains (``tests/resume/test_fast_tier_matrix.py``
and the MoE matrices resume MoE under Megatron's bf16 exactly).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

MOE = {"num_moe_experts": 4, "moe_router_topk": 2}


def _fit(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    steps: list[int] = []

    class Steps(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            steps.append(trainer.global_step)

    trainer = make_trainer(
        2,
        MegatronStrategy(expert_model_parallel_size=2),
        world_size,
        precision="bf16-mixed",
        callbacks=[Steps(), MegatronCheckpoint(f"{tmp}/ckpt", every_n_train_steps=1)],
        enable_checkpointing=True,
    )
    module = TinyGPTModule(optimizer="distributed", transformer_config=MOE)
    try:
        trainer.fit(module, train_dataloaders=loader(8, 2))
    except ValueError as err:
        return {"error": str(err), "steps": steps}
    return {"error": None, "steps": steps}


def test_a_mixture_of_experts_under_autocast_is_refused_at_setup(tmp_path: Path) -> None:
    results = run_distributed(_fit, 2, str(tmp_path), timeout=280)
    assert len({r["error"] for r in results}) == 1, results  # every rank, the same error
    error = results[0]["error"]
    assert error is not None, results
    assert "num_moe_experts=4" in error and "Trainer(precision='bf16-mixed')" in error, error
    assert "TransformerConfig(bf16=True, params_dtype=torch.bfloat16)" in error, error
    assert all(r["steps"] == [] for r in results), results
    assert not list(tmp_path.glob("ckpt/global_step_*"))
