"""Pipeline parallelism: Megatron-Core's schedule inside Lightning's loop trains like PP=1."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(240)

STEPS = 3
# Adam normalises each gradient element, so a near-zero element whose float summation order
# differs can move by a fraction of one step (lr=1e-3): allow 5 % of a step.
ATOL = 5e-5
# Small enough that clipping acts on every step (the gradient norm of the tiny GPT is ~1).
CLIP = 0.05


def _same_init_for_every_layout() -> object:
    """A callback that sets every weight from its global checkpoint key and offset.

    Megatron initialises each pipeline stage from its own RNG stream, so two layouts start from
    different weights; this gives every layout the same global tensors.
    """
    import zlib

    import lightning.pytorch as pl
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    class SameInit(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            for sh in trainer.strategy.model_sharded_state_dict().values():
                if not isinstance(sh, ShardedTensor):
                    continue
                g = torch.Generator().manual_seed(zlib.crc32(sh.key.encode()))
                full = 0.02 * torch.randn(sh.global_shape, generator=g)
                if "norm" in sh.key and sh.key.endswith("weight"):
                    full += 1.0
                index = tuple(slice(o, o + 1) for o in sh.global_offset[: sh.prepend_axis_num])
                index += tuple(
                    slice(o, o + n)
                    for o, n in zip(
                        sh.global_offset[sh.prepend_axis_num :], sh.local_shape, strict=True
                    )
                )
                with torch.no_grad():
                    sh.data.copy_(full[index].reshape(sh.data.shape))
            from _trainer import gathered_weights

            self.start = gathered_weights(trainer)

    return SameInit()


def _train(rank: int, world_size: int, tp: int, pp: int) -> dict[str, object]:
    from _trainer import gathered_weights, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    module = TinyGPTModule(dropout=0.0)
    same_init: Any = _same_init_for_every_layout()
    trainer = make_trainer(
        STEPS,
        MegatronStrategy(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
        world_size,
        accumulate_grad_batches=2,
        gradient_clip_val=CLIP,
        callbacks=[same_init],
    )
    from torch.utils.data import DataLoader

    from lightning_mcore_ckpt import ElasticSampler
    from lightning_mcore_ckpt.tiny import TokenDataset

    # The same shuffled order in every layout.
    dataset = TokenDataset(32)
    sampler = ElasticSampler(dataset, micro_batch_size=4, seed=0)
    trainer.fit(module, train_dataloaders=DataLoader(dataset, batch_size=4, sampler=sampler))
    return {
        "losses": module.step_losses,
        "weights": gathered_weights(trainer),
        "start": same_init.start,
    }


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 1)], ids=["pp2", "tp2"])
def test_model_parallel_trains_like_one_rank_with_accumulation_and_clipping(
    tp: int, pp: int
) -> None:
    # Without dropout, a two-stage pipeline (4 micro-batches per batch) or two tensor-parallel
    # shards, with 2 batches accumulated per step and gradients clipped by the global norm,
    # compute the same losses and updates as one rank, up to float summation order.
    reference = run_distributed(_train, 1, 1, 1, timeout=200)[0]
    piped = run_distributed(_train, 2, tp, pp, timeout=200)

    assert len(reference["losses"]) == 2 * STEPS
    for r in piped:
        assert len(r["losses"]) == 2 * STEPS
        torch.testing.assert_close(
            torch.stack(r["losses"]), torch.stack(reference["losses"]), rtol=1e-5, atol=1e-6
        )
        assert r["weights"].keys() == reference["weights"].keys()
        for key, tensor in reference["weights"].items():
            torch.testing.assert_close(
                r["weights"][key], tensor, rtol=1e-4, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}"
            )
    # The weights really moved, by far more than the tolerance: the comparison above is not
    # between two untouched models.
    start = reference["start"]
    for key, tensor in reference["weights"].items():
        assert (tensor - start[key]).abs().max() > 20 * ATOL, f"{key} did not train"
