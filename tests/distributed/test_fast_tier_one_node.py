"""The fast tier on one node (every rank sees the same directory).

- With ``replicas=0`` it keeps the node's own copy: the CPU twin of the GPU test resumes the
  newest fast step exactly, with Megatron-Core's distributed optimizer (the multi-node tests
  use torch's AdamW).
- With ``replicas=1`` there is no other node to hold a copy: refused at setup on every rank,
  naming the argument, the value and the fix, before anything is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _fast_tier import resumes_exactly

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(600)


def test_the_node_own_copy_resumes_exactly(tmp_path: Path) -> None:
    resumes_exactly(tmp_path, "distributed", "32", "cpu")


def _refused(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import FastTier, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.errors import ConfigurationError
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    checkpoint = MegatronCheckpoint(
        f"{tmp}/ckpt", every_n_train_steps=2, fast_tier=FastTier(f"{tmp}/fast", replicas=1)
    )
    trainer = make_trainer(
        4, MegatronStrategy(), world_size, callbacks=[checkpoint], enable_checkpointing=True
    )
    try:
        trainer.fit(TinyGPTModule(), train_dataloaders=loader(32))
    except ConfigurationError as err:
        return {"error": str(err), "step": trainer.global_step}
    return {"error": None}


def test_copies_on_other_nodes_are_refused_on_one_node(tmp_path: Path) -> None:
    results = run_distributed(_refused, 2, str(tmp_path))
    assert len({r["error"] for r in results}) == 1  # every rank, the same error
    error = results[0]["error"]
    assert error is not None and "FastTier(replicas=1)" in error and "replicas <= 0" in error
    assert all(r["step"] == 0 for r in results)
    assert not list((tmp_path / "fast").glob("fast_step_*"))
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").glob("global_step_*"))
