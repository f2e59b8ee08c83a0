"""``lightning-mcore-ckpt diff`` of two mixture-of-experts steps saved at different EP sizes.

A tiny Qwen2-MoE (4 experts in each of 2 layers) trains on 2 processes with its experts split
over them (EP=2: each process holds and writes 2 of them), and is saved. One process (EP=1:
every expert) loads that step and saves it again, then once more with one element of one
expert's weight changed. The experts are compared as whole tensors, whichever process held them:
the copy is identical, and the change is found and named by that expert's weight.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from lightning_mcore_ckpt.cli import diff
from lightning_mcore_ckpt.cli import entry as cli
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

STEP = 2
DELTA = 0.5
EXPERTS_KEY = "model.decoder.layers.mlp.experts.experts.linear_fc1.weight"
"""The checkpoint's tensor of every layer's experts' gate/up weights, [layers, experts, ...]."""
CHANGED = "model.decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
"""Layer 1's expert 3 (held by the second process at EP=2), as the EP=1 module names it."""
ELEMENT = (5, 7)


def _save_ep2(rank: int, world_size: int, root: str) -> int:
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import HFGPTModule

    strategy = MegatronStrategy(expert_model_parallel_size=2, init_from=str(Path(root, "src")))
    module = HFGPTModule(str(Path(root, "src")))
    trainer = make_trainer(STEP, strategy, world_size)
    trainer.fit(module, train_dataloaders=loader(16, 2))
    trainer.save_checkpoint(Path(root, "ep2"))
    return len(module.model.decoder.layers[1].mlp.experts.local_experts)


def _resave_ep1(rank: int, world_size: int, root: str) -> int:
    import torch
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy, SaveOptions
    from lightning_mcore_ckpt.tiny import HFGPTModule

    module = HFGPTModule(str(Path(root, "src")))
    trainer = make_trainer(STEP, MegatronStrategy(), world_size)
    ckpt = str(Path(root, "ep2"))
    trainer.validate(module, dataloaders=loader(4, 2), ckpt_path=ckpt, verbose=False)
    model_only = SaveOptions(contents=["model"])
    trainer.save_checkpoint(Path(root, "ep1"), storage_options=model_only)
    with torch.no_grad():
        module.get_parameter(CHANGED)[ELEMENT] += DELTA
    trainer.save_checkpoint(Path(root, "ep1-changed"), storage_options=model_only)
    return len(module.model.decoder.layers[1].mlp.experts.local_experts)


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    root = tmp_path_factory.mktemp("diff-moe")
    tiny_hf_model(root / "src", "qwen2_moe", hidden_size=32, intermediate_size=64, num_experts=4)
    # EP=2 was real: each process held 2 of a layer's 4 experts; at EP=1 one held all 4.
    assert run_distributed(_save_ep2, 2, str(root), timeout=250) == [2, 2]
    assert run_distributed(_resave_ep1, 1, str(root), timeout=250) == [4]
    return {name: root / name for name in ("ep2", "ep1", "ep1-changed")}


def _cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["diff", *args])
    return code, out.getvalue()


# Whole experts at once, or a few rows of one expert at a time: the answers must not change.
CHUNKS = pytest.mark.parametrize("chunk_bytes", [64 << 20, 300], ids=["whole", "a-few-rows"])


@CHUNKS
def test_an_ep2_step_and_its_ep1_copy_are_identical(
    steps: dict[str, Path], chunk_bytes: int
) -> None:
    result = diff.diff_steps(steps["ep2"], steps["ep1"], chunk_bytes=chunk_bytes)
    assert result.identical, result.to_json()
    (experts,) = [t for t in result.tensors if t.key == EXPERTS_KEY]
    assert experts.shape == [2, 4, 2 * 64, 32]  # every layer's every expert, compared
    assert len(result.tensors) > 10


@CHUNKS
def test_one_changed_expert_is_found_and_named(steps: dict[str, Path], chunk_bytes: int) -> None:
    result = diff.diff_steps(steps["ep2"], steps["ep1-changed"], chunk_bytes=chunk_bytes)
    assert not result.only_a and not result.only_b and not result.changed
    (found,) = result.differing
    assert (found.key, found.differing, found.experts) == (EXPERTS_KEY, 1, [CHANGED])
    assert found.max_abs == pytest.approx(DELTA, rel=1e-3)


def test_the_command_reports_equal_steps_and_names_the_changed_expert(
    steps: dict[str, Path],
) -> None:
    code, out = _cli(str(steps["ep2"]), str(steps["ep1"]))
    assert code == 0 and out.rstrip().endswith("identical"), out
    code, out = _cli(str(steps["ep2"]), str(steps["ep1-changed"]))
    assert code == 1
    assert f"differs:   model/{EXPERTS_KEY}" in out and f"in expert {CHANGED}" in out, out
    code, out = _cli(str(steps["ep1-changed"]), str(steps["ep2"]), "--json")
    (differing,) = [t for t in json.loads(out)["tensors"] if t["differing"]]
    assert differing["experts"] == [CHANGED]
