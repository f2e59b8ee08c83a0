"""The whole story on CPU: train, get preempted, resume exactly, export to Hugging Face once.

    bash scripts/demo.sh            # or: python examples/demo.py --steps 8 --out demo_output

1. A tiny Hugging Face Qwen2 is created locally; a Megatron-Core GPT of that architecture is
   trained from its weights with tensor parallelism 2 on 2 processes.
2. Uninterrupted reference run: ``--steps`` steps.
3. The same run again, preempted with SIGTERM half way (as SLURM does): it finishes the step,
   saves it synchronously and exits cleanly.
4. ``fit(ckpt_path="last")`` resumes it; at the end one Hugging Face copy is exported.
5. Checks that the resumed run's losses equal the reference's, lists the run (``ls``) and which
   saved steps retention removed and why (``max_to_keep=2``: the preemption save too, once newer
   steps completed), prints what each save cost (``report``), and generates with the exported
   model in transformers.

Lightning starts the second process itself (this script is re-run with LOCAL_RANK=1), so what
must happen once is guarded by the rank. Lightning's banners and what the libraries underneath
say about themselves go to ``<out>/run.log``, named at the end; stderr keeps this package's
notices, every other warning and every error.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import signal
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.notices import log_known_notices

# First thing in each process of the demo (Lightning starts the second one by running this
# script again), before the imports that print notices: a fresh output directory (in the process
# the user started, before any other) and its log. Lightning's banners and what Megatron-Core,
# torch and torchdata say about themselves (deprecations, fallbacks where Apex or Transformer
# Engine is not installed) go there; every other warning and every error is shown. Not where
# job() is imported from.
if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    parser.add_argument("--out", default="demo_output", help="output directory (replaced)")
    ARGS = parser.parse_args()
    OUT = Path(ARGS.out).resolve()
    if "LOCAL_RANK" not in os.environ:
        shutil.rmtree(OUT, ignore_errors=True)
    LOG = log_known_notices(OUT / "run.log", cpu=True)

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
from lightning_mcore_ckpt.format import layout
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


def saved_steps(logs: Path) -> list[int]:
    """The steps the checkpoint callback committed in every fit of a run: the rows of its
    ``checkpoint/size_bytes`` metric in the CSV logs."""
    steps = set()
    for metrics in logs.glob("version_*/metrics.csv"):
        with open(metrics, newline="") as f:
            steps |= {int(r["step"]) for r in csv.DictReader(f) if r.get("checkpoint/size_bytes")}
    return sorted(steps)


def retention_story(run: Path, saved: list[int], keep: int | None, preempted: int) -> list[str]:
    """Which of the ``saved`` steps are gone from ``run``, and why, from what is on disk."""
    kept = [s.step for s in layout.complete_steps(run)]
    gone = [s for s in saved if s not in kept]
    if not gone:
        return [f"the run saved steps {', '.join(map(str, saved))}: all kept"]
    lines = [f"the run saved steps {', '.join(map(str, saved))}; retention removed:"]
    for step in gone:
        newer = [s for s in kept if s > step]
        what = " (the preemption save)" if step == preempted else ""
        if keep is not None and len(newer) >= keep:
            why = f"max_to_keep={keep}, and newer steps {', '.join(map(str, newer))} completed"
        else:
            why = "Lightning's checkpoint bookkeeping let it go"
        lines.append(f"  {layout.step_name(step)}{what}: {why}")
    return lines


def main(out: Path, steps: int, log: Path) -> None:
    stop = max(1, steps // 2)

    if "LOCAL_RANK" not in os.environ:  # the process the user started, before any other
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # its bars while it writes and loads
        tiny_hf_model(out / "hf_source", "qwen2", vocab_size=128)

    _, reference = fit(out, "reference", steps, None, [])
    preempted, first = fit(out, "run", steps, "last", [Preempt(stop)])
    resumed, second = fit(out, "run", steps, "last", [])

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
    checkpoint = resumed.checkpoint_callback
    assert isinstance(checkpoint, MegatronCheckpoint)
    saved = saved_steps(out / "logs" / "run")
    story = retention_story(out / "run", saved, checkpoint.max_to_keep, preempted.global_step)
    print("\n".join(story))
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
    print(f"  Lightning's messages and the libraries' own notices: {log}")
    if not same:
        raise SystemExit("the resumed run did not match the uninterrupted one")


if __name__ == "__main__":
    main(OUT, ARGS.steps, LOG)
