"""A checkpoint saved in one parallel layout loads into another with identical tensors.

Axes: the model (Megatron-Core's GPTModel; its HybridModel of attention and MLP layers, whose
layers are saved one by one and split over pipeline stages by its layer pattern) and the layout
change (TP, DP, PP; both ways for TP).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(240)

SAVED_STEPS = 2
HYBRID_LAYER = "gpt.decoder.layers.1.mlp.linear_fc1.weight"
"""A hybrid model's second layer (``"*-*-"``: an MLP), saved under its own index."""


def _module(model: str) -> object:
    from lightning_mcore_ckpt.tiny import TinyGPTModule, TinyHybridModule

    return TinyHybridModule() if model == "hybrid" else TinyGPTModule()


def _train_and_save(
    rank: int, world_size: int, step_dir: str, tp: int, pp: int, model: str = "gpt"
) -> dict[str, object]:
    from _trainer import gathered_optimizer, gathered_weights, loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy

    strategy = MegatronStrategy(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    trainer = make_trainer(SAVED_STEPS, strategy, world_size)
    trainer.fit(_module(model), train_dataloaders=loader(16, 2, shuffle=True))
    trainer.save_checkpoint(step_dir)
    return {"weights": gathered_weights(trainer), "optim": gathered_optimizer(trainer)}


def _load_and_continue(
    rank: int, world_size: int, step_dir: str, tp: int, pp: int, model: str = "gpt"
) -> dict[str, object]:
    from _trainer import resume_and_continue

    from lightning_mcore_ckpt import MegatronStrategy

    strategy = MegatronStrategy(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return resume_and_continue(_module(model), strategy, world_size, step_dir, SAVED_STEPS + 2)


@pytest.mark.parametrize(
    ("model", "save_world", "save_tp", "save_pp", "load_world", "load_tp", "load_pp"),
    [
        ("gpt", 2, 2, 1, 1, 1, 1),
        ("gpt", 1, 1, 1, 2, 2, 1),
        ("gpt", 2, 1, 1, 1, 1, 1),
        ("gpt", 2, 1, 2, 1, 1, 1),
        ("hybrid", 2, 2, 1, 1, 1, 1),
        ("hybrid", 2, 1, 2, 1, 1, 1),
        ("hybrid", 2, 1, 2, 2, 2, 1),
    ],
    ids=[
        "tp2-to-tp1",
        "tp1-to-tp2",
        "dp2-to-dp1",
        "pp2-to-pp1",
        "hybrid-tp2-to-tp1",
        "hybrid-pp2-to-pp1",
        "hybrid-pp2-to-tp2",
    ],
)
def test_reshard_restores_identical_weights_and_optimizer_moments(
    tmp_path: Path,
    model: str,
    save_world: int,
    save_tp: int,
    save_pp: int,
    load_world: int,
    load_tp: int,
    load_pp: int,
) -> None:
    step_dir = str(tmp_path / "global_step_2")
    saved = run_distributed(
        _train_and_save, save_world, step_dir, save_tp, save_pp, model, timeout=200
    )[0]
    loaded = run_distributed(
        _load_and_continue, load_world, step_dir, load_tp, load_pp, model, timeout=200
    )

    assert any(".exp_avg_sq." in k for k in saved["optim"])
    assert (HYBRID_LAYER in saved["weights"]) == (model == "hybrid")
    for r in loaded:
        assert r["start_step"] == SAVED_STEPS
        assert r["weights"].keys() == saved["weights"].keys()
        for key, tensor in saved["weights"].items():
            assert torch.equal(tensor, r["weights"][key]), f"weight {key}"
        assert r["optim"].keys() == saved["optim"].keys()
        for key, tensor in saved["optim"].items():
            assert torch.equal(tensor, r["optim"][key]), f"optimizer state {key}"
        # ... and training continues from there.
        assert r["end_step"] == SAVED_STEPS + 2
        assert len(r["losses"]) == 2 and all(torch.isfinite(x) for x in r["losses"])


def _validate_from_weights_only(rank: int, world_size: int, step_dir: str) -> dict[str, object]:
    import shutil

    from _trainer import gathered_weights, loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    if rank == 0:  # evaluation must not need (or read) the optimizer's bytes
        shutil.rmtree(f"{step_dir}/optim")
    trainer = make_trainer(1, MegatronStrategy(tensor_model_parallel_size=2), world_size)
    metrics = trainer.validate(TinyGPTModule(), dataloaders=loader(8, 2), ckpt_path=step_dir)
    return {"weights": gathered_weights(trainer), "val_loss": metrics[0]["val_loss"]}


def test_validate_loads_weights_without_reading_the_optimizer(tmp_path: Path) -> None:
    step_dir = str(tmp_path / "global_step_2")
    saved = run_distributed(_train_and_save, 2, step_dir, 2, 1, timeout=200)[0]
    results = run_distributed(_validate_from_weights_only, 2, step_dir, timeout=200)
    assert not (tmp_path / "global_step_2" / "optim").exists()
    for r in results:
        for key, tensor in saved["weights"].items():
            assert torch.equal(tensor, r["weights"][key]), key
        assert r["val_loss"] > 0


def _save_twice(rank: int, world_size: int, step_dir: str) -> str:
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    trainer = make_trainer(1, MegatronStrategy(tensor_model_parallel_size=2), world_size)
    trainer.fit(TinyGPTModule(), train_dataloaders=loader(8, 2))
    trainer.save_checkpoint(step_dir)
    try:
        trainer.save_checkpoint(step_dir)
    except FileExistsError as err:
        return str(err)
    return "no error"


def test_saving_into_a_non_empty_step_directory_fails_on_every_rank(tmp_path: Path) -> None:
    step_dir = tmp_path / "global_step_1"
    messages = run_distributed(_save_twice, 2, str(step_dir), timeout=120)
    assert (
        messages
        == [
            f"checkpoint directory {step_dir} exists and is not empty; "
            "save each step to a new directory"
        ]
        * 2
    )
    assert (step_dir / "model" / ".metadata").is_file()  # the first save is intact
