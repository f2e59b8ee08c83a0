"""``lightning-mcore-ckpt diff``: two steps compared tensor by tensor, across layouts.

Axes: the layouts of the two steps (TP=2 against its TP=1 copy), the change (none, one element
of one weight), what is compared (weights, with the optimizer state), and the slice read at once
(whole tensors, a few rows: the answers must not change).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt import cli, diff
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

STEP = 2
CHANGED = ("gpt.output_layer.weight", (3, 5), 0.5)


def _save_tp2(rank: int, world_size: int, path: str) -> None:
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    trainer = make_trainer(STEP, MegatronStrategy(tensor_model_parallel_size=2), world_size)
    trainer.fit(TinyGPTModule(), train_dataloaders=loader(16, 2, shuffle=True))
    trainer.save_checkpoint(path)


def _copy_tp1(rank: int, world_size: int, source: str, same: str, changed: str) -> None:
    import torch
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    module = TinyGPTModule()
    trainer = make_trainer(STEP, MegatronStrategy(), world_size)  # resumes at its last step
    trainer.fit(module, train_dataloaders=loader(16, 2, shuffle=True), ckpt_path=source)
    trainer.save_checkpoint(same)
    _, (row, col), delta = CHANGED
    with torch.no_grad():
        module.gpt.output_layer.weight[row, col] += delta
    trainer.save_checkpoint(changed)


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("diff")
    paths = {name: root / name for name in ("tp2", "tp1", "tp1-changed")}
    run_distributed(_save_tp2, 2, str(paths["tp2"]), timeout=250)
    run_distributed(
        _copy_tp1, 1, str(paths["tp2"]), str(paths["tp1"]), str(paths["tp1-changed"]), timeout=250
    )
    return paths


def _cli(*args: str) -> tuple[int, dict[str, Any]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["diff", *args, "--json"])
    return code, json.loads(out.getvalue())


@pytest.mark.parametrize("chunk_bytes", [64 << 20, 300], ids=["whole-tensors", "a-few-rows"])
def test_a_resharded_copy_is_identical_weights_and_optimizer_state(
    steps: dict[str, Path], chunk_bytes: int
) -> None:
    result = diff.diff_steps(steps["tp2"], steps["tp1"], optimizer=True, chunk_bytes=chunk_bytes)
    assert result.identical, result.to_json()
    assert {t.part for t in result.tensors} == {"model", "optim"}
    assert len(result.tensors) > 16  # every weight and its moments


@pytest.mark.parametrize("chunk_bytes", [64 << 20, 300], ids=["whole-tensors", "a-few-rows"])
def test_one_changed_element_between_a_tp2_and_a_tp1_copy_is_found(
    steps: dict[str, Path], chunk_bytes: int
) -> None:
    result = diff.diff_steps(steps["tp2"], steps["tp1-changed"], chunk_bytes=chunk_bytes)
    assert not result.only_a and not result.only_b and not result.changed
    (found,) = result.differing
    key, _, delta = CHANGED
    assert (found.key, found.differing, found.numel) == (key, 1, 128 * 64)
    assert found.max_abs == pytest.approx(delta, rel=1e-3)
    assert found.max_rel > 1  # 0.5 against init-scale weights (|w| < 0.1)


def test_the_command_exit_codes_and_json(steps: dict[str, Path], tmp_path: Path) -> None:
    assert _cli(str(steps["tp2"]), str(steps["tp1"]))[0] == 0
    code, report = _cli(str(steps["tp2"]), str(steps["tp1-changed"]))
    assert code == 1 and not report["identical"]
    assert [t["key"] for t in report["tensors"] if t["differing"]] == [CHANGED[0]]
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert cli.main(["diff", str(steps["tp2"]), str(tmp_path / "nowhere")]) == 2
    assert "is not a step directory" in err.getvalue()
