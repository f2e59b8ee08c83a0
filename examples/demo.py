"""The whole story on CPU: train, get preempted, resume exactly, export to Hugging Face once.

    bash scripts/demo.sh            # or: python examples/demo.py --steps 8 --out demo_output

1. A tiny Hugging Face Qwen2 is created locally; a Megatron-Core GPT of that architecture is
   trained from its weights with tensor parallelism 2 on 2 processes.
2. Uninterrupted reference run: ``--steps`` steps.
3. The same run again, preempted with SIGTERM half way (as SLURM does): it finishes the step,
   saves it synchronously and exits cleanly.
4. ``fit(ckpt_path="last")`` resumes it; at the end one Hugging Face copy is exported.
5. Checks that the resumed run's losses equal the reference's, lists the run (``ls``), prints
   what each save cost (``report``), and generates with the exported model in transformers.

Lightning starts the second process itself (this script is re-run with LOCAL_RANK=1), so what
must happen once is guarded by the rank.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.notices import hide_known_notices

# What Megatron-Core, torch and torchdata say about themselves (deprecations, fallbacks where
# Apex or Transformer Engine is not installed) stays out of the story; every other warning and
# every error is shown. First thing, before the imports that print them, in each process of the
# demo (Lightning starts the second one by running this script again); not where job() is
# imported from.
if __name__ == "__main__":
    hide_known_notices(cpu=True)

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_mcore_ckpt import (
    HFExport,
    MegatronCheckpoint,
    MegatronStrategy,
    ResumeJob,
)
from lightning_mcore_ckpt.tiny import HFGPTModule, TokenDataset, tiny_hf_model


class Preempt(pl.Callback):
    """Sends this process SIGTERM after ``step``, as a scheduler would before a requeue."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def job(
    out: Path, name: str = "run", steps: int = 8, callbacks: tuple[pl.Callback, ...] = ()
) -> ResumeJob:
    """The demo's training job: what :func:`lightning_mcore_ckpt.check_resume` checks.

    ``out / "hf_source"`` must hold the Hugging Face model (``tiny_hf_model``).
    """
    source = out / "hf_source"
    torch.manual_seed(0)  # the shuffling loader's order: the same in every run
    data = StatefulDataLoader(TokenDataset(64), batch_size=4, shuffle=True)
    module = HFGPTModule(source, lr=3e-3, dropout=0.1)
    trainer = pl.Trainer(
        strategy=MegatronStrategy(tensor_model_parallel_size=2, init_from=source),
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        callbacks=[
            MegatronCheckpoint(
                out / name,
                every_n_train_steps=2,
                max_to_keep=2,
                hf_export=HFExport(source, when="end"),
            ),
            *callbacks,
        ],
        logger=CSVLogger(out / "logs", name=name),
        log_every_n_steps=1,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    return ResumeJob(trainer, module, train_dataloaders=data)


def fit(
    out: Path, name: str, steps: int, ckpt_path: str | None, callbacks: list[pl.Callback]
) -> tuple[pl.Trainer, HFGPTModule]:
    run = job(out, name, steps, tuple(callbacks))
    run.trainer.fit(run.model, train_dataloaders=run.train_dataloaders, ckpt_path=ckpt_path)
    return run.trainer, run.model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    parser.add_argument("--out", default="demo_output", help="output directory (replaced)")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    stop = max(1, args.steps // 2)

    if "LOCAL_RANK" not in os.environ:  # the process the user started, before any other
        shutil.rmtree(out, ignore_errors=True)
        tiny_hf_model(out / "hf_source", "qwen2", vocab_size=128)

    _, reference = fit(out, "reference", args.steps, None, [])
    preempted, first = fit(out, "run", args.steps, "last", [Preempt(stop)])
    resumed, second = fit(out, "run", args.steps, "last", [])

    if resumed.global_rank != 0:
        return
    from lightning_mcore_ckpt.cli.entry import main as cli

    losses = [float(x) for x in first.step_losses + second.step_losses]
    expected = [float(x) for x in reference.step_losses]
    same = torch.equal(
        torch.stack(first.step_losses + second.step_losses), torch.stack(reference.step_losses)
    )
    print()
    print(f"preempted after step {preempted.global_step} (SIGTERM), saved, exited cleanly")
    print(f"resumed at step {preempted.global_step}, trained to step {resumed.global_step}")
    print(f"losses: {', '.join(f'{x:.4f}' for x in losses)}")
    print(f"resumed run matches the uninterrupted one bit for bit: {same}")
    if not same:
        print(f"  uninterrupted: {', '.join(f'{x:.4f}' for x in expected)}")
    print()
    cli(["ls", str(out / "run")])
    print()
    cli(["report", str(out / "run"), "--plot", str(out / "saves.png")])
    print()
    exported = out / "run" / f"global_step_{resumed.global_step}" / "huggingface"
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    # The tiny word-level tokenizer, loaded as what it is (transformers 5's AutoTokenizer would
    # build Qwen2's own byte-level BPE around its vocabulary).
    tokenizer = PreTrainedTokenizerFast.from_pretrained(exported, local_files_only=True)
    prompt = tokenizer("a b c", return_tensors="pt", return_token_type_ids=False)
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    print(f"Hugging Face copy: {exported}")
    print(f"  transformers generates: {tokenizer.decode(generated[0])!r}")
    print(f"  training logs: {out / 'logs'}; save-time chart: {out / 'saves.png'}")
    if not same:
        raise SystemExit("the resumed run did not match the uninterrupted one")


if __name__ == "__main__":
    main()
