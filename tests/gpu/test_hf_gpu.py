"""GPU tier: mbridge with Transformer Engine layers, initialised from and exported to HF."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _marks import TWO_GPUS

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = TWO_GPUS


def _has_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _train_te(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_mcore_ckpt import HFExport, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import HFGPTModule, TokenDataset

    src = str(Path(tmp, "src"))
    probe = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(7)).cuda()
    out: dict[str, Any] = {}

    class Probe(pl.Callback):
        def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            with torch.no_grad():
                out["start"] = module.logits(probe).float().cpu()

    trainer = pl.Trainer(
        strategy=MegatronStrategy(tensor_model_parallel_size=2, init_from=src),
        accelerator="gpu",
        devices=world_size,
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        callbacks=[MegatronCheckpoint(Path(tmp, "ckpt"), hf_export=HFExport(src)), Probe()],
    )
    module = HFGPTModule(src, lr=1e-2)
    trainer.fit(module, DataLoader(TokenDataset(8), batch_size=2))
    with torch.no_grad():
        out["end"] = module.logits(probe).float().cpu()
    out["probe"] = probe.cpu()
    return out


@pytest.mark.skipif(not _has_te(), reason="needs Transformer Engine")
def test_te_model_from_hf_exports_what_it_computes(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from lightning_mcore_ckpt.tiny import tiny_hf_model

    src = tiny_hf_model(tmp_path / "src", "qwen2")
    run = run_distributed(_train_te, 2, str(tmp_path), timeout=560)[0]

    def hf_logits(path: Path) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        with torch.no_grad():
            return model(run["probe"]).logits

    # TE kernels are not bit-identical to transformers' eager attention: a looser tolerance.
    torch.testing.assert_close(run["start"], hf_logits(src), rtol=0, atol=2e-3)
    exported = tmp_path / "ckpt" / "global_step_3" / "huggingface"
    torch.testing.assert_close(run["end"], hf_logits(exported), rtol=0, atol=2e-3)
