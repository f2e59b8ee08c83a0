"""``lightning-mcore-ckpt export``, ``import`` and ``verify``: between a step and a Hugging Face
model directory. ``export`` writes one (and with ``--upload-to`` pushes it to the Hub),
``import`` turns one into a step, ``verify`` compares one with its reference. The conversion
itself is :mod:`lightning_mcore_ckpt.hf`'s."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.cli.failure import fail, missing
from lightning_mcore_ckpt.cli.report import human_bytes

__all__ = ["add_parsers"]

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def add_parsers(commands: Any) -> None:
    """Add ``export``, ``import`` and ``verify`` to the command line's subparsers."""
    _add_export(commands)
    _add_import(commands)
    _add_verify(commands)


def _add_export(commands: Any) -> None:
    export = commands.add_parser(
        "export",
        help="convert a saved step (any TP/PP layout) to a Hugging Face model directory",
        description="Convert the weights of a complete step to a Hugging Face model directory "
        "(safetensors, config, generation config, tokenizer), on one CPU process, reading one "
        "layer at a time.",
    )
    export.add_argument("step_dir", help="a global_step_<N> directory")
    export.add_argument(
        "--hf-model",
        required=True,
        help="the Hugging Face model directory the run was trained from (config, tokenizer)",
    )
    export.add_argument("--out", required=True, help="the directory to write (new or empty)")
    export.add_argument("--dtype", choices=sorted(_DTYPES), help="default: the checkpoint's dtype")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    lora = "LoRA adapters: merged (default: into the weights) or peft (the adapters alone)"
    export.add_argument("--adapters", choices=["merged", "peft"], default="merged", help=lora)
    export.add_argument("--lora-alpha", type=float, help="for adapters saved without their alpha")
    up = "then check it, push it to this Hub model repository (HF_TOKEN); exit 1 if that fails"
    export.add_argument("--upload-to", metavar="ORG/NAME", help=up)
    private = "create the repository private (default; an existing public one is refused)"
    export.add_argument(
        "--private", action=argparse.BooleanOptionalAction, default=True, help=private
    )
    export.add_argument(
        "--head",
        choices=["auto", "lm", "value", "reward"],
        default="auto",
        help="auto (default): what the checkpoint's output layer is; value: a one-output head as "
        "*ForTokenClassification (verl's critic); reward: as *ForSequenceClassification",
    )
    export.set_defaults(handler=_export)


def _add_import(commands: Any) -> None:
    imp = commands.add_parser(
        "import",
        help="convert a Hugging Face model to a step directory that fit(ckpt_path=...) loads",
        description="Convert a Hugging Face model directory to Megatron-Core dist-checkpoint "
        "weights (a step directory with model/ and metadata.json). trainer.fit(ckpt_path=OUT) "
        "or MegatronStrategy(init_from=OUT) starts training from them.",
    )
    imp.add_argument("hf_dir", help="a local Hugging Face model directory")
    imp.add_argument("--out", required=True, help="the step directory to write (new or empty)")
    imp.add_argument(
        "--prefix",
        default="model.",
        help="attribute path of the GPT model in your LightningModule, with a trailing dot "
        "(default: 'model.' for self.model)",
    )
    imp.add_argument("--dtype", choices=sorted(_DTYPES), help="default: the config's torch_dtype")
    imp.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    imp.set_defaults(handler=_import)


def _add_verify(commands: Any) -> None:
    verify = commands.add_parser(
        "verify",
        help="compare an exported Hugging Face directory with a reference, tensor by tensor",
        description="Compare names, shapes, dtypes and values of an exported Hugging Face "
        "directory with a reference: another Hugging Face directory, or a step directory "
        "(converted on the fly). Exit code 0 only when they match within --atol.",
    )
    verify.add_argument("exported", help="the Hugging Face directory to check")
    verify.add_argument(
        "--reference",
        help="a Hugging Face directory or a step directory (default: the step whose "
        "huggingface/ EXPORTED is)",
    )
    verify.add_argument(
        "--atol",
        type=float,
        default=None,
        help="largest allowed |difference| (default 0: exact; with --logits 1e-3)",
    )
    verify.add_argument(
        "--logits",
        action="store_true",
        help="also run fixed token batches through EXPORTED (transformers) and the step's "
        "Megatron-Core model (one CPU process) and compare their logits (values, scores)",
    )
    verify.set_defaults(handler=_verify)


def _dtype(name: str | None) -> Any:
    import torch

    return None if name is None else getattr(torch, _DTYPES[name])


def _export(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lightning_mcore_ckpt.storage import object_store

    found = missing("export", ("STEP_DIR", args.step_dir), ("--hf-model", args.hf_model))
    if found is not None:
        return found
    if not object_store.is_url(args.out):
        return _export_to(args, None)
    # To a store: written in a scratch directory, uploaded, and the scratch directory removed.
    out_url = args.out
    with tempfile.TemporaryDirectory(prefix="lmc-export-") as scratch:
        args.out = str(Path(scratch) / "export")
        return _export_to(args, out_url)


def _export_to(args: argparse.Namespace, out_url: str | None) -> int:
    """Export to ``args.out``, then upload it to ``out_url`` (a store) and to the Hub when
    asked."""
    from lightning_mcore_ckpt import hf
    from lightning_mcore_ckpt.storage import publication

    try:
        if args.upload_to is not None:  # before any work
            hf.check_upload_options(args.upload_to, args.private, 3, 0, where="export --upload-to")
        summary = hf.export_checkpoint(
            args.step_dir,
            args.hf_model,
            args.out,
            dtype=_dtype(args.dtype),
            overwrite=args.overwrite,
            head=args.head,
            adapters=args.adapters,
            lora_alpha=args.lora_alpha,
        )
    except (FileNotFoundError, FileExistsError, ValueError, ImportError) as err:
        return fail(err)
    print(
        f"exported {summary['tensors']} tensors ({human_bytes(summary['bytes'])}) to "
        f"{summary['path']} in {summary['seconds']:.1f}s"
    )
    if out_url is not None:
        sent = publication.upload_tree(Path(args.out), out_url)
        print(f"uploaded {human_bytes(sent)} to {out_url}")
    if args.upload_to is not None:
        try:
            done = hf.upload_export(args.out, args.step_dir, args.upload_to, private=args.private)
        except hf.UploadError as err:
            return fail(err, code=1)
        print(f"uploaded to {done.repo_id} ({done.attempts} attempt(s)): {done.commit_url}")
    return 0


def _import(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if (found := missing("import", ("HF_DIR", args.hf_dir))) is not None:
        return found
    from lightning_mcore_ckpt import hf

    try:
        summary = hf.import_checkpoint(
            args.hf_dir,
            args.out,
            prefix=args.prefix,
            dtype=_dtype(args.dtype),
            overwrite=args.overwrite,
        )
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        return fail(err)
    print(f"imported {args.hf_dir} to {summary['path']} in {summary['seconds']:.1f}s")
    return 0


def _verify(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    found = missing("verify", ("EXPORTED", args.exported), ("--reference", args.reference))
    if found is not None:
        return found
    from lightning_mcore_ckpt import hf

    reference = args.reference
    if reference is None:
        parent = Path(args.exported).expanduser().resolve().parent
        if Path(args.exported).name != hf.HF_DIR or not (parent / "model").is_dir():
            return fail(
                f"verify: --reference is needed: {args.exported} is not the {hf.HF_DIR}/ copy of "
                "a step; pass --reference STEP_DIR (or another Hugging Face directory)"
            )
        reference = str(parent)
    try:
        result = hf.verify_export(args.exported, reference, atol=args.atol or 0.0)
        logits = None
        if args.logits:
            from lightning_mcore_ckpt import _cpu

            _cpu.install("cpu")  # the check runs on the CPU, in fp32, also on a GPU machine
            atol = hf.LOGITS_ATOL if args.atol is None else args.atol
            logits = hf.check_logits(args.exported, reference, atol=atol)
    except (FileNotFoundError, ValueError) as err:
        return fail(err)
    for problem in result.problems[:20]:
        print(f"MISMATCH {problem}")
    if len(result.problems) > 20:
        print(f"... and {len(result.problems) - 20} more")
    worst = f" ({result.worst})" if result.worst else ""
    print(
        f"compared {result.compared} tensors; largest |difference| {result.max_abs_diff:.3g}"
        f"{worst}; tolerance {result.atol:g}"
    )
    ok = result.ok
    if logits is not None:
        what = {"lm": "logits", "value": "values", "reward": "scores"}[logits.head]
        print(
            f"{what}: {logits.batches} batches of {logits.tokens} tokens; largest |difference| "
            f"{logits.max_abs_diff:.3g} (largest |{what[:-1]}| {logits.max_abs_value:.3g}); "
            f"tolerance {logits.atol:g}"
        )
        ok = ok and logits.ok
    print("OK: they match" if ok else "FAILED: they differ")
    return 0 if ok else 1
