"""The ``lightning-mcore-ckpt`` command line."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt._version import __version__
from lightning_mcore_ckpt.cli import checks as _checks
from lightning_mcore_ckpt.notices import known_notices_hidden

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``lightning-mcore-ckpt``."""
    parser = argparse.ArgumentParser(
        prog="lightning-mcore-ckpt",
        description=(
            "Inspect and convert Megatron-Core distributed checkpoints written by "
            "lightning-mcore-ckpt."
        ),
    )
    parser.add_argument(
        "--version", action="version", version=f"lightning-mcore-ckpt {__version__}"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    report = commands.add_parser(
        "report",
        help="list a run's checkpoints: size, save times, throughput, parallel layout",
        description=(
            "Print a table of the complete steps of a MegatronCheckpoint directory (step, time "
            "of save, contents, size, training-blocked and total save time, throughput, "
            "parallel layout), then the steps that never committed."
        ),
    )
    report.add_argument("dirpath", help="the MegatronCheckpoint dirpath (holds global_step_<N>/)")
    report.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw save time and size against step into this image (needs matplotlib)",
    )

    ls = commands.add_parser(
        "ls",
        help="list a run's complete steps and what each contains",
        description="List the complete steps of a MegatronCheckpoint directory, what each "
        "contains (model, optimizer, extra, huggingface) and its size, then incomplete steps.",
    )
    ls.add_argument("dirpath", help="the MegatronCheckpoint dirpath (holds global_step_<N>/)")

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

    _checks.add_parsers(commands)

    return parser


_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _dtype(name: str | None) -> Any:
    import torch

    return None if name is None else getattr(torch, _DTYPES[name])


def _fail(message: object) -> int:
    print(f"lightning-mcore-ckpt: error: {message}", file=sys.stderr)
    return 2


def _ls(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lightning_mcore_ckpt import hf
    from lightning_mcore_ckpt.cli import report
    from lightning_mcore_ckpt.format import layout

    try:
        result = report.collect(args.dirpath)
    except FileNotFoundError as err:
        parser.error(str(err))
    print(f"{result.dirpath}: {len(result.complete)} complete step(s)")
    for meta in result.complete:
        step = meta["global_step"]
        path = layout.step_dir(result.dirpath, step)
        contents = [c for c in meta.get("contents") or [] if c != "hf_model"]
        if hf.is_exported(path):
            contents.append("huggingface")
        mark = "  (last)" if step == result.last else ""
        size = report.human_bytes(meta.get("size_bytes"))
        print(f"  global_step_{step}  {size:>10}  {', '.join(contents)}{mark}")
        if report.written_by(meta):
            print(f"      written by {report.written_by(meta)}")
    for step, problems in sorted(result.damaged.items()):
        print(f"  global_step_{step}  DAMAGED: {'; '.join(problems[:3])}")
    for stale in result.incomplete:
        print(f"  {stale.path.name}  incomplete (never committed)")
    return 0


def _export(args: argparse.Namespace) -> int:
    from lightning_mcore_ckpt import hf
    from lightning_mcore_ckpt.storage import object_store
    from lightning_mcore_ckpt.storage import publication as replica

    out_url = args.out if object_store.is_url(args.out) else None
    if out_url is not None:  # written here, then uploaded
        args.out = str(Path(tempfile.mkdtemp(prefix="lmc-export-")) / "export")
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
        return _fail(err)
    print(
        f"exported {summary['tensors']} tensors ({summary['bytes'] / 1e9:.3f} GB) to "
        f"{summary['path']} in {summary['seconds']:.1f}s"
    )
    if out_url is not None:
        print(f"uploaded {replica.upload_tree(Path(args.out), out_url) / 1e9:.3f} GB to {out_url}")
    if args.upload_to is not None:
        try:
            done = hf.upload_export(args.out, args.step_dir, args.upload_to, private=args.private)
        except hf.UploadError as err:
            print(f"lightning-mcore-ckpt: error: {err}", file=sys.stderr)
            return 1
        print(f"uploaded to {done.repo_id} ({done.attempts} attempt(s)): {done.commit_url}")
    return 0


def _import(args: argparse.Namespace) -> int:
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
        return _fail(err)
    print(f"imported {args.hf_dir} to {summary['path']} in {summary['seconds']:.1f}s")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from lightning_mcore_ckpt import hf

    reference = args.reference
    if reference is None:
        parent = Path(args.exported).expanduser().resolve().parent
        if Path(args.exported).name != hf.HF_DIR or not (parent / "model").is_dir():
            return _fail(
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
        return _fail(err)
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


def _report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lightning_mcore_ckpt.cli import report

    if args.plot is not None and not Path(args.plot).expanduser().parent.is_dir():
        parser.error(f"--plot {args.plot}: the directory {Path(args.plot).parent} does not exist")
    try:
        result = report.collect(args.dirpath)
    except FileNotFoundError as err:
        parser.error(str(err))
    print(report.format_table(result))
    if args.plot is not None:
        try:
            report.plot(result, Path(args.plot).expanduser())
        except (RuntimeError, ValueError) as err:
            print(f"lightning-mcore-ckpt: error: {err}", file=sys.stderr)
            return 1
        print(f"plot written to {args.plot}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    # What the libraries underneath say about themselves stays out of the way while the
    # command runs (the filters are restored after: main also runs inside other programs).
    with known_notices_hidden():
        return _run(args, parser)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lightning_mcore_ckpt.storage import publication as replica

    try:  # a step or a dirpath in an object store: read through a local view of it
        replica.open_url_arguments(args, ("dirpath", "path", "step", "step_dir", "reference"))
    except (ImportError, ValueError, OSError) as err:
        return _fail(err)
    if args.command == "report":
        return _report(args, parser)
    if args.command == "ls":
        return _ls(args, parser)
    if args.command == "export":
        return _export(args)
    if args.command == "import":
        return _import(args)
    if args.command == "verify":
        return _verify(args)
    if args.command in ("inspect", "fsck", "diff", "check-resume"):
        return _checks.run(args)
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
