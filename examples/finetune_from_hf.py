"""Fine-tune a Hugging Face model with Megatron-Core parallelism; ship it back as Hugging Face.

    python examples/finetune_from_hf.py                       # a tiny Qwen2, created locally
    python examples/finetune_from_hf.py --hf-model path/to/Qwen2.5-0.5B --steps 100

1. ``lightning-mcore-ckpt import``: the Hugging Face weights become a Megatron-Core
   dist-checkpoint (``<out>/imported``), loadable into any parallel layout.
2. Fine-tune with tensor parallelism 2 on 2 processes, starting from it
   (``MegatronStrategy(init_from=...)``), checkpointing as it goes.
3. One Hugging Face export, when ``fit`` ends, into the final step's ``huggingface/``.
4. Load that copy with transformers and generate.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import lightning.pytorch as pl
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_mcore_ckpt import HFExport, MegatronCheckpoint, MegatronStrategy, ResumeJob, hf
from lightning_mcore_ckpt.tiny import HFGPTModule, TokenDataset, tiny_hf_model


def job(source: Path, imported: Path, out: Path, steps: int = 6) -> ResumeJob:
    """The fine-tuning job: what :func:`lightning_mcore_ckpt.check_resume` checks."""
    torch.manual_seed(0)
    trainer = pl.Trainer(
        strategy=MegatronStrategy(tensor_model_parallel_size=2, init_from=imported),
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=2,
        max_steps=steps,
        callbacks=[
            MegatronCheckpoint(
                out / "checkpoints",
                every_n_train_steps=max(1, steps // 2),
                max_to_keep=1,
                hf_export=HFExport(source, when="end"),
            )
        ],
        logger=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    module = HFGPTModule(source, lr=3e-3)
    data = StatefulDataLoader(TokenDataset(64), batch_size=4, shuffle=True)
    return ResumeJob(trainer, module, train_dataloaders=data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-model", help="a local Hugging Face model (default: a tiny Qwen2)")
    parser.add_argument("--steps", type=int, default=6, help="fine-tuning steps (default 6)")
    parser.add_argument("--out", default="finetune_output", help="output directory (replaced)")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    source = Path(args.hf_model).resolve() if args.hf_model else out / "hf_source"
    imported = out / "imported"

    if "LOCAL_RANK" not in os.environ:  # once, before Lightning starts the second process
        shutil.rmtree(out, ignore_errors=True)
        if args.hf_model is None:
            tiny_hf_model(source, "qwen2")
        hf.import_checkpoint(source, imported, prefix="model.")

    run = job(source, imported, out, args.steps)
    trainer, module = run.trainer, run.model
    trainer.fit(module, train_dataloaders=run.train_dataloaders, ckpt_path="last")

    if trainer.global_rank != 0:
        return
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    exported = out / "checkpoints" / f"global_step_{trainer.global_step}" / "huggingface"
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    # The tiny word-level tokenizer, loaded as what it is (transformers 5's AutoTokenizer would
    # build Qwen2's own byte-level BPE around its vocabulary).
    tokenizer = PreTrainedTokenizerFast.from_pretrained(exported, local_files_only=True)
    prompt = tokenizer("a b c", return_tensors="pt", return_token_type_ids=False)
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    losses = ", ".join(f"{float(x):.4f}" for x in module.step_losses)
    print(f"fine-tuned {trainer.global_step} steps from {source}; losses: {losses}")
    print(f"Hugging Face copy: {exported}")
    print(f"transformers generates: {tokenizer.decode(generated[0])!r}")


if __name__ == "__main__":
    main()
