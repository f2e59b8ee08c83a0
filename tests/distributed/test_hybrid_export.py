"""The Hugging Face conversion and Megatron-Core's HybridModel: mbridge maps no hybrid
architecture, so every way in is refused before any work, naming the model and what is supported.

Axes: the way in (``export_checkpoint`` and the ``export`` command on a saved step,
``verify_export`` against it, ``MegatronCheckpoint(hf_export=...)`` and
``MegatronStrategy(init_from=<Hugging Face model>)`` at setup).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from lightning_mcore_ckpt import _compat, hf
from lightning_mcore_ckpt.cli import entry as cli
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

REFUSED = "is a Megatron-Core HybridModel (layers '*-*-', saved one by one)"


def _train_hybrid(rank: int, world_size: int, root: str) -> None:
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyHybridModule

    callback = MegatronCheckpoint(root, every_n_train_steps=2, save_last=False)
    strategy = MegatronStrategy(tensor_model_parallel_size=2)
    trainer = make_trainer(2, strategy, world_size, callbacks=[callback], enable_checkpointing=True)
    trainer.fit(TinyHybridModule(), train_dataloaders=loader(8, 2))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from lightning_mcore_ckpt.tiny import tiny_hf_qwen2

    root = tmp_path_factory.mktemp("hybrid")
    run_distributed(_train_hybrid, 2, str(root / "run"), timeout=250)
    return {"step": root / "run" / "global_step_2", "qwen2": Path(tiny_hf_qwen2(root / "qwen2"))}


def test_exporting_a_hybrid_step_is_refused_before_anything_is_written(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"HybridModel") as refused:
        hf.export_checkpoint(saved["step"], saved["qwen2"], out)
    message = str(refused.value)
    assert f"{saved['step']}: its model ('gpt.') {REFUSED}" in message
    assert "mbridge, which maps no hybrid architecture" in message
    assert all(t in message for t in hf.supported_model_types())
    assert list(tmp_path.iterdir()) == []  # no output, no staging directory
    # The command: exit code 2, the same message.
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(
            ["export", str(saved["step"]), "--hf-model", str(saved["qwen2"]), "--out", str(out)]
        )
    assert code == 2 and REFUSED in err.getvalue()
    assert list(tmp_path.iterdir()) == []


def test_verifying_an_export_against_a_hybrid_step_is_refused(saved: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"HybridModel") as refused:
        hf.verify_export(saved["qwen2"], saved["step"])
    assert REFUSED in str(refused.value)


def _fit_refused(rank: int, world_size: int, root: str, qwen2: str, way: str) -> str:
    from _trainer import loader, make_trainer
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyHybridModule

    if way == "hf_export":
        callback = MegatronCheckpoint(root, every_n_train_steps=1, hf_export=hf.HFExport(qwen2))
        trainer = make_trainer(
            2, MegatronStrategy(), world_size, callbacks=[callback], enable_checkpointing=True
        )
    else:
        trainer = make_trainer(2, MegatronStrategy(init_from=qwen2), world_size)
    module = TinyHybridModule()
    try:
        trainer.fit(module, train_dataloaders=loader(8, 2))
    except MisconfigurationException as err:
        assert isinstance(err, ValueError)
        assert module.step_losses == []  # refused before training
        return str(err)
    return "not refused"


@pytest.mark.parametrize("way", ["hf_export", "init_from"])
def test_a_hugging_face_conversion_of_a_live_hybrid_model_is_refused_at_setup(
    saved: dict[str, Path], tmp_path: Path, way: str
) -> None:
    root = tmp_path / "run"
    messages = run_distributed(_fit_refused, 2, str(root), str(saved["qwen2"]), way, timeout=250)
    argument = {
        "hf_export": "MegatronCheckpoint(hf_export=HFExport(...))",
        "init_from": f"MegatronStrategy(init_from={str(saved['qwen2'])!r})",
    }[way]
    hybrid = _compat.hybrid_model_class().__name__  # MambaModel on megatron-core 0.16
    for message in messages:
        assert message.startswith(f"{argument}: the Hugging Face conversion maps"), message
        assert f"the LightningModule's 'gpt' is a {hybrid} " in message
        assert "mbridge maps no hybrid architecture" in message and "qwen2" in message
    assert not list(root.glob("global_step_*"))
