"""CPU demo: train a tiny Megatron-Core GPT with tensor parallelism 2 on 2 processes, checkpoint it.

    bash scripts/demo.sh            # or: python examples/demo.py --steps 8 --out demo_output

Lightning starts the second process itself (this script is re-run with LOCAL_RANK=1), so
everything that must happen once lives under ``if __name__ == "__main__"`` and checks the rank.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_mcore_ckpt import MegatronStrategy
from lightning_mcore_ckpt.tiny import TinyGPTModule, TokenDataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    parser.add_argument("--out", default="demo_output", help="output directory (replaced)")
    args = parser.parse_args()

    out = Path(args.out).resolve()
    launcher = "LOCAL_RANK" not in os.environ  # the process the user started
    if launcher and out.exists():
        shutil.rmtree(out)

    module = TinyGPTModule(dropout=0.1)
    trainer = pl.Trainer(
        strategy=MegatronStrategy(tensor_model_parallel_size=2),
        accelerator="cpu",
        devices=2,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(module, DataLoader(TokenDataset(64), batch_size=4, shuffle=True))
    step_dir = out / f"global_step_{trainer.global_step}"
    trainer.save_checkpoint(step_dir)

    if trainer.global_rank == 0:
        losses = ", ".join(f"{float(x):.3f}" for x in module.step_losses)
        files = sorted(p for p in step_dir.rglob("*") if p.is_file())
        size = sum(p.stat().st_size for p in files)
        print(f"trained {trainer.global_step} steps with TP=2 on 2 processes; losses: {losses}")
        print(f"checkpoint: {step_dir}  ({len(files)} files, {size / 1e6:.1f} MB)")
        for sub in ("model", "optim", "extra"):
            print(f"  {sub}/  {len(list((step_dir / sub).iterdir()))} files")


if __name__ == "__main__":
    main()
