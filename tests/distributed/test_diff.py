"""``lightning-mcore-ckpt diff``: two steps compared tensor by tensor, across layouts.

Axes: the model (Megatron-Core's GPTModel, whose layers are stacked in one tensor per weight;
its HybridModel, whose layers are saved one by one), the layouts of the two steps (TP=2 against
its TP=1 copy), the change (none, one element of one weight), what is compared (weights, with
the optimizer state), and the slice read at once (whole tensors, a few rows: the answers must
not change).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.cli import diff
from lightning_mcore_ckpt.cli import entry as cli
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

STEP = 2
DELTA = 0.5
CHANGED = {
    # model -> (the weight changed, as the checkpoint and the TP=1 module name it; the element)
    "gpt": ("gpt.output_layer.weight", (3, 5)),
    # A hybrid model's second layer ("*-*-": an MLP), saved under a key of its own.
    "hybrid": ("gpt.decoder.layers.1.mlp.linear_fc1.weight", (3, 5)),
}


def _module(model: str) -> Any:
    from lightning_mcore_ckpt.tiny import TinyGPTModule, TinyHybridModule

    return TinyHybridModule() if model == "hybrid" else TinyGPTModule()


def _save_tp2(rank: int, world_size: int, path: str, model: str) -> None:
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy

    trainer = make_trainer(STEP, MegatronStrategy(tensor_model_parallel_size=2), world_size)
    trainer.fit(_module(model), train_dataloaders=loader(16, 2, shuffle=True))
    trainer.save_checkpoint(path)


def _copy_tp1(rank: int, world_size: int, source: str, same: str, changed: str, model: str) -> None:
    import torch
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy

    module = _module(model)
    trainer = make_trainer(STEP, MegatronStrategy(), world_size)  # resumes at its last step
    trainer.fit(module, train_dataloaders=loader(16, 2, shuffle=True), ckpt_path=source)
    trainer.save_checkpoint(same)
    weight, (row, col) = CHANGED[model]
    with torch.no_grad():
        module.get_parameter(weight)[row, col] += DELTA
    trainer.save_checkpoint(changed)


@pytest.fixture(scope="module")
def steps(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, Any]:
    model = request.param
    root = tmp_path_factory.mktemp(f"diff-{model}")
    paths = {name: root / name for name in ("tp2", "tp1", "tp1-changed")}
    run_distributed(_save_tp2, 2, str(paths["tp2"]), model, timeout=250)
    run_distributed(
        _copy_tp1,
        1,
        str(paths["tp2"]),
        str(paths["tp1"]),
        str(paths["tp1-changed"]),
        model,
        timeout=250,
    )
    return {**paths, "model": model}


# The slices read at once do not depend on the model: the hybrid model is read whole only.
CELLS = pytest.mark.parametrize(
    ("steps", "chunk_bytes"),
    [("gpt", 64 << 20), ("gpt", 300), ("hybrid", 64 << 20)],
    ids=["gpt-whole-tensors", "gpt-a-few-rows", "hybrid-whole-tensors"],
    indirect=["steps"],
)


def _cli(*args: str) -> tuple[int, dict[str, Any]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["diff", *args, "--json"])
    return code, json.loads(out.getvalue())


@CELLS
def test_a_resharded_copy_is_identical_weights_and_optimizer_state(
    steps: dict[str, Any], chunk_bytes: int
) -> None:
    result = diff.diff_steps(steps["tp2"], steps["tp1"], optimizer=True, chunk_bytes=chunk_bytes)
    assert result.identical, result.to_json()
    assert {t.part for t in result.tensors} == {"model", "optim"}
    assert len(result.tensors) > 16  # every weight and its moments


@CELLS
def test_one_changed_element_between_a_tp2_and_a_tp1_copy_is_found(
    steps: dict[str, Any], chunk_bytes: int
) -> None:
    result = diff.diff_steps(steps["tp2"], steps["tp1-changed"], chunk_bytes=chunk_bytes)
    assert not result.only_a and not result.only_b and not result.changed
    (found,) = result.differing
    key, _ = CHANGED[steps["model"]]
    assert (found.key, found.differing, found.numel) == (key, 1, 128 * 64)
    assert found.max_abs == pytest.approx(DELTA, rel=1e-3)
    assert found.max_rel > 1  # 0.5 against init-scale weights (|w| < 0.1)


@pytest.mark.parametrize("steps", ["gpt", "hybrid"], indirect=True)
def test_the_command_exit_codes_and_json(steps: dict[str, Any], tmp_path: Path) -> None:
    assert _cli(str(steps["tp2"]), str(steps["tp1"]))[0] == 0
    code, report = _cli(str(steps["tp2"]), str(steps["tp1-changed"]))
    assert code == 1 and not report["identical"]
    assert [t["key"] for t in report["tensors"] if t["differing"]] == [CHANGED[steps["model"]][0]]
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert cli.main(["diff", str(steps["tp2"]), str(tmp_path / "nowhere")]) == 2
    assert "is not a step directory" in err.getvalue()
