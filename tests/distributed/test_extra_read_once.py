"""A load unpickles each ``extra/`` file it reads once: the check that refuses an unsafe file
loads it, and the load's later reads (the optimizer's stateless record, Lightning's state and
the RNG) take what the check loaded. Nothing of it is kept after the load.

Axes: trust (checked, the default; ``weights_only=False``: trusted, loaded unchecked) by the
layout at load (the saving one, DP=2; TP=2, where the record and the RNG of a rank's own
file no longer apply: its Lightning state is still read from it), on 2 gloo ranks: a cell per
layout saves once and loads it checked, then trusted. Every rank asserts, for each load, which
``extra/`` files it unpickled and how many times, that the resumed run starts at the saved
step, and that the reader holds nothing afterwards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)


def _resume(rank: int, world_size: int, tmp: str, tp: int) -> dict[str, Any]:
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.safety import safe_load
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    step = str(Path(tmp, "step"))
    trainer = make_trainer(1, MegatronStrategy(), world_size)
    trainer.fit(TinyGPTModule(dropout=0.0), train_dataloaders=loader(16, 2, shuffle=True))
    trainer.save_checkpoint(step)
    trainer.strategy.teardown()

    loads: list[str] = []
    stock = safe_load.load_torch_file

    def counted(path: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(path).parent.name == "extra":
            loads.append(Path(path).name)
        return stock(path, *args, **kwargs)

    safe_load.load_torch_file = counted
    out: dict[str, Any] = {}
    for trust in ("checked", "trusted"):  # each a load of the same step, in a fresh run
        loads.clear()
        strategy = MegatronStrategy(tensor_model_parallel_size=tp)
        trainer = make_trainer(1, strategy, world_size)
        trainer.fit(
            TinyGPTModule(dropout=0.0),
            train_dataloaders=loader(16, 2, shuffle=True),
            ckpt_path=step,
            weights_only=False if trust == "trusted" else None,
        )
        out[trust] = {
            "loads": sorted(loads),
            "step": trainer.global_step,
            "held": len(strategy._reader._checked_extra),
        }
        strategy.teardown()
    return out


@pytest.mark.parametrize("tp", [1, 2], ids=["same-layout", "tp2"])
def test_each_extra_file_is_unpickled_once_per_load(tmp_path: Path, tp: int):
    results = run_distributed(_resume, 2, str(tmp_path), tp, timeout=240)
    for rank, loads in enumerate(results):
        for trust, out in loads.items():
            # Each rank's own file (the world is the saving one's), unpickled once.
            assert out["loads"] == [f"rank_{rank:05d}.pt"], (rank, trust, out)
            assert out["step"] == 1, (rank, trust, out)
            assert out["held"] == 0, (rank, trust, out)
