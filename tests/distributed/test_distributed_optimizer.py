"""Megatron-Core's distributed optimizer (over Megatron DDP) saved, resumed and resharded.

The axes: the sharding type it is saved with (``dp_reshardable``, ``fully_reshardable``), the
layout it is saved from and loaded into (data-, tensor-, pipeline-parallel), and the weights'
precision (fp32; bf16 in ``Float16Module`` with fp32 main parameters). A load must restore the
same gathered state (weights, main parameters, moments) it saved, in any layout the sharding
type allows, and refuse the others before reading anything, naming the option that would allow
it. Exact resume of whole runs (losses, RNG, data, optimizer at every step, sync and async) is
in the resume matrix (``tests/resume/test_matrix.py``, its ``optimizer`` and ``precision`` axes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_mcore_ckpt.format import layout
from lightning_mcore_ckpt.testing import DistributedFailure, run_distributed

pytestmark = pytest.mark.timeout(300)

SAVED_STEPS = 2


def _module(bf16: bool) -> object:
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    return TinyGPTModule(optimizer="distributed", megatron_bf16=bf16)


def _strategy(tp: int, pp: int, sharding: str, async_save: bool = False) -> object:
    from lightning_mcore_ckpt import MegatronStrategy

    return MegatronStrategy(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        ckpt_optimizer_sharding=sharding,
        ckpt_async_save=async_save,
    )


def _train_and_save(
    rank: int,
    world_size: int,
    step_dir: str,
    layout: tuple[int, int],
    sharding: str,
    bf16: bool,
    async_save: bool,
) -> dict[str, object]:
    from _trainer import gathered_optimizer, gathered_weights, loader, make_trainer

    trainer = make_trainer(SAVED_STEPS, _strategy(*layout, sharding, async_save), world_size)
    trainer.fit(_module(bf16), train_dataloaders=loader(16, 2, shuffle=True))
    saved = {"weights": gathered_weights(trainer), "optim": gathered_optimizer(trainer)}
    trainer.save_checkpoint(step_dir)
    trainer.strategy.teardown()  # an async save is written and committed by then
    return saved


def _load_and_continue(
    rank: int, world_size: int, step_dir: str, layout: tuple[int, int], sharding: str, bf16: bool
) -> dict[str, object]:
    from _trainer import resume_and_continue

    strategy = _strategy(*layout, sharding)
    return resume_and_continue(_module(bf16), strategy, world_size, step_dir, SAVED_STEPS + 2)


# (sharding, bf16 weights, async save, (saving world, tp, pp), (loading world, tp, pp))
CASES = [
    ("dp_reshardable", False, False, (2, 1, 1), (1, 1, 1)),
    ("dp_reshardable", True, True, (1, 1, 1), (2, 1, 1)),
    ("fully_reshardable", True, False, (2, 2, 1), (2, 1, 1)),
    ("fully_reshardable", False, True, (2, 1, 1), (2, 2, 1)),
    ("fully_reshardable", False, False, (2, 1, 2), (1, 1, 1)),
    ("fully_reshardable", True, True, (1, 1, 1), (2, 1, 2)),
]


def _name(case: tuple[object, ...]) -> str:
    sharding, bf16, async_save, (sw, stp, spp), (lw, ltp, lpp) = case  # type: ignore[misc]
    dtype, saves = "bf16" if bf16 else "fp32", "async" if async_save else "sync"
    return f"{sharding}-{dtype}-{saves}-w{sw}tp{stp}pp{spp}-to-w{lw}tp{ltp}pp{lpp}"


@pytest.mark.parametrize("case", CASES, ids=[_name(c) for c in CASES])
def test_a_load_restores_the_gathered_state_it_saved(
    tmp_path: Path, case: tuple[object, ...]
) -> None:
    sharding, bf16, async_save, (save_world, *save_layout), (load_world, *load_layout) = case  # type: ignore[misc]
    step_dir = str(tmp_path / f"global_step_{SAVED_STEPS}")
    saved = run_distributed(
        _train_and_save,
        save_world,
        step_dir,
        tuple(save_layout),
        sharding,
        bf16,
        async_save,
        timeout=240,
    )[0]
    loaded = run_distributed(
        _load_and_continue, load_world, step_dir, tuple(load_layout), sharding, bf16, timeout=240
    )

    optim = saved["optim"]
    assert any(".exp_avg_sq." in k for k in optim), sorted(optim)[:5]
    # The fp32 main parameters of bf16 weights are part of what is saved and restored.
    main_params = [k for k in optim if k.startswith("optimizer.state.param.")]
    assert main_params, sorted({k.split(".gpt.")[0] for k in optim})
    assert all(optim[k].dtype == torch.float32 for k in main_params)
    if bf16:
        assert all(w.dtype == torch.bfloat16 for w in saved["weights"].values())
    for r in loaded:
        assert r["start_step"] == SAVED_STEPS
        assert r["weights"].keys() == saved["weights"].keys()
        for key, tensor in saved["weights"].items():
            assert torch.equal(tensor, r["weights"][key]), f"weight {key}"
        assert r["optim"].keys() == optim.keys()
        for key, tensor in optim.items():
            assert torch.equal(tensor, r["optim"][key]), f"optimizer state {key}"
        assert r["end_step"] == SAVED_STEPS + 2
        assert len(r["losses"]) == 2 and all(torch.isfinite(x) for x in r["losses"])
    metadata = json.loads((Path(step_dir) / "metadata.json").read_text())
    assert metadata["optimizer_sharding"] == sharding
    # Megatron-Core's own record of the format: the format only (a GPU gathers it its own way).
    from megatron.core import dist_checkpointing

    saved_format = dist_checkpointing.load_content_metadata(str(Path(step_dir) / "optim"))
    assert saved_format == {
        "distrib_optim_sharding_type": sharding,
        "chained_optim_avoid_prefix": True,
    }
    assert metadata["async"] == async_save
    assert layout.verify_step(Path(step_dir)) == []


def test_dp_reshardable_into_another_tensor_parallel_size_is_refused(tmp_path: Path) -> None:
    step_dir = str(tmp_path / f"global_step_{SAVED_STEPS}")
    run_distributed(
        _train_and_save, 2, step_dir, (1, 1), "dp_reshardable", False, False, timeout=240
    )
    before = sorted(p.name for p in Path(step_dir).rglob("*"))
    with pytest.raises(DistributedFailure) as info:
        # Loading asks for fully_reshardable: the step's own type is the one that counts.
        run_distributed(
            _load_and_continue, 2, step_dir, (2, 1), "fully_reshardable", False, timeout=240
        )
    message = str(info.value)
    for needed in (
        "ckpt_optimizer_sharding='dp_reshardable'",
        "tensor_model_parallel_size=1 saved, 2 now",
        "ckpt_optimizer_sharding='fully_reshardable'",
    ):
        assert needed in message, message
    assert "rank 0" in message or "rank 1" in message
    assert sorted(p.name for p in Path(step_dir).rglob("*")) == before


def _bf16_true_over_megatron_ddp(rank: int, world_size: int, tmp: str) -> None:
    from _trainer import loader, make_trainer

    trainer = make_trainer(2, _strategy(1, 1, "dp_reshardable"), world_size, precision="bf16-true")
    trainer.fit(_module(False), train_dataloaders=loader(8, 2))


def test_bf16_true_over_megatron_ddp_is_refused_before_training(tmp_path: Path) -> None:
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_bf16_true_over_megatron_ddp, 1, str(tmp_path), timeout=200)
    message = str(info.value)
    assert "Trainer(precision='bf16-true') converts every parameter" in message
    assert "TransformerConfig(bf16=True, params_dtype=torch.bfloat16)" in message
    assert "Float16Module" in message


def _fp16_megatron_optimizer(rank: int, world_size: int, tmp: str) -> None:
    from _trainer import loader, make_trainer
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from lightning_mcore_ckpt.tiny import TinyGPTModule

    class WithLossScale(TinyGPTModule):  # type: ignore[misc]
        def configure_optimizers(self) -> object:
            config = OptimizerConfig(optimizer="adam", lr=1e-3, fp16=True)
            return get_megatron_optimizer(config, [self.gpt])

    trainer = make_trainer(2, _strategy(1, 1, "dp_reshardable"), world_size)
    trainer.fit(WithLossScale(optimizer="megatron"), train_dataloaders=loader(8, 2))


def test_a_megatron_optimizer_expecting_a_scaled_loss_is_refused_before_training(
    tmp_path: Path,
) -> None:
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_fp16_megatron_optimizer, 1, str(tmp_path), timeout=200)
    message = str(info.value)
    assert "OptimizerConfig(fp16=True) expects the loss" in message, message
    assert "OptimizerConfig(bf16=True)" in message
