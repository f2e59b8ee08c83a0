"""The ``fsck``, ``inspect``, ``diff`` and ``check-resume`` commands of
``lightning-mcore-ckpt``: is a step whole and unchanged, will it load where it is going, what
differs between two steps, and does a job resume exactly."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

__all__ = ["add_parsers", "run"]


def _fail(message: object) -> int:
    print(f"lightning-mcore-ckpt: error: {message}", file=sys.stderr)
    return 2


EXIT_JOB_FAILED = 3
"""``check-resume``'s exit code when a run of the job fails to run (1 is a divergence)."""


def add_parsers(commands: Any) -> None:
    """Add ``fsck``, ``inspect``, ``diff`` and ``check-resume`` to the command line's
    subparsers."""
    compare = commands.add_parser(
        "diff",
        help="compare two steps tensor by tensor (any layouts), in bounded memory",
        description="Compare the weights of two steps (and with --optimizer, the optimizer "
        "state), whatever layouts saved them: keys only in A or only in B, shape and dtype "
        "changes, and per tensor the elements that differ, the largest |a-b| and its size "
        "relative to the largest |a|. Read slice by slice (--chunk-mib per step at a time). "
        "Exit code 0 when identical, 1 when they differ.",
    )
    compare.add_argument("a", help="a step directory")
    compare.add_argument("b", help="another step directory")
    compare.add_argument("--optimizer", action="store_true", help="also compare optim/")
    compare.add_argument(
        "--chunk-mib", type=float, default=64, help="MiB of a tensor read at once (default 64)"
    )
    compare.add_argument("--json", action="store_true", help="print the comparison as JSON")
    fsck = commands.add_parser(
        "fsck",
        help="check every step of a run (or one step) for missing, short or changed files",
        description="Check the complete steps of a MegatronCheckpoint directory, or one step "
        "directory, without loading tensors: the commit marker, every file's presence and "
        "size at the commit, the dist-checkpoint indexes and shard files, one extra/ file per "
        "rank. --deep also reads every file and compares its hash with the one recorded at the "
        "commit. Exit code 1 when any step is damaged (each step and file named), 0 otherwise.",
    )
    fsck.add_argument("path", help="a MegatronCheckpoint dirpath or one global_step_<N>/")
    fsck.add_argument(
        "--deep", action="store_true", help="also re-hash every file (reads the whole step)"
    )

    inspect = commands.add_parser(
        "inspect",
        help="will a step load into a layout and a model? From metadata only, in seconds",
        description="Answer, from a step's metadata (no tensor data), on one CPU process: "
        "whether it loads into the target layout and the model a config builds (missing, "
        "unexpected, renamed and reshaped keys, sizes the model cannot be split into), its "
        "optimizer state and whether it reshards there, which ranks have dataloader and RNG "
        "state and what a data-parallel change does to them, the versions that wrote it, and "
        "the Hugging Face copy against its config. Exit code 1 on any blocker, each with its "
        "fix; 0 when it loads.",
    )
    inspect.add_argument("step", help="a step directory (global_step_<N>/)")
    inspect.add_argument(
        "--config",
        metavar="run.yaml",
        help="a LightningCLI config: the model to compare with (built on the meta device) and "
        "its layout (MegatronStrategy sizes, trainer.devices x num_nodes)",
    )
    for flag, size in (
        ("--tp", "tensor_model_parallel_size"),
        ("--pp", "pipeline_model_parallel_size"),
        ("--cp", "context_parallel_size"),
        ("--ep", "expert_model_parallel_size"),
        ("--dp", "data_parallel_size"),
    ):
        inspect.add_argument(
            flag, dest=size, type=int, metavar="N", help=f"target {size} (default: as saved)"
        )
    inspect.add_argument("--json", action="store_true", help="print the findings as JSON")

    check = commands.add_parser(
        "check-resume",
        help="prove that a LightningCLI job resumes exactly: run it whole and interrupted, compare",
        description=(
            "Run the job of a LightningCLI config (model and data named by class_path) "
            "uninterrupted to --max-steps (twice: a job that differs from itself is reported as "
            "not deterministic), then interrupted at --stop-at and resumed with "
            'fit(ckpt_path="last"), and compare per-step losses, the samples every rank '
            "received, every RNG stream, weights, optimizer and LR scheduler state and the loop "
            "counters bit for bit. Prints the first divergence. Exit code 0 when everything is "
            "identical, 1 on a divergence, 2 on bad usage, 3 when a run of the job fails to run "
            "(the report names the run, the rank and the exception: an error of the job, not "
            "a divergence)."
        ),
    )
    check.add_argument("--config", required=True, help="a LightningCLI YAML config")
    check.add_argument(
        "--stop-at", type=int, required=True, metavar="K", help="the step to interrupt at"
    )
    check.add_argument(
        "--max-steps",
        type=int,
        metavar="N",
        help="the step to compare up to (default: the config's trainer.max_steps)",
    )
    check.add_argument(
        "--how",
        choices=["clean", "sigterm", "kill", "max_steps"],
        action="append",
        help="how to interrupt: a clean stop (trainer.should_stop) after the step, SIGTERM, a "
        "hard kill after the last committed step, or max_steps (a finished run, extended); "
        "repeat to try several (default: clean, sigterm and kill)",
    )
    check.add_argument(
        "--workdir", help="keep every run's checkpoints and records here (a new directory)"
    )
    check.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    """Run ``fsck``, ``inspect``, ``diff`` or ``check-resume``; the exit code."""
    commands = {"fsck": _fsck, "inspect": _inspect, "diff": _diff, "check-resume": _check_resume}
    return commands[args.command](args)


def _diff(args: argparse.Namespace) -> int:
    import json

    from lightning_mcore_ckpt.cli import diff

    if args.chunk_mib <= 0:
        return _fail(f"--chunk-mib: {args.chunk_mib} is not a positive size")
    try:
        result = diff.diff_steps(
            args.a, args.b, optimizer=args.optimizer, chunk_bytes=int(args.chunk_mib * 2**20)
        )
    except (FileNotFoundError, ValueError) as err:
        return _fail(err)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0 if result.identical else 1
    for key in result.only_a:
        print(f"only in A: {key}")
    for key in result.only_b:
        print(f"only in B: {key}")
    for change in result.changed:
        print(f"changed:   {change}")
    for t in result.differing:
        print(
            f"differs:   {t.part}/{t.key} {t.shape} {t.dtype}: {t.differing} of {t.numel} "
            f"elements, max |a-b| {t.max_abs:.6g} ({t.max_rel:.3g} of max |a|)"
        )
    print(
        f"compared {len(result.tensors)} tensors: {len(result.differing)} differ"
        + ("; identical" if result.identical else "")
    )
    return 0 if result.identical else 1


def _fsck(args: argparse.Namespace) -> int:
    from lightning_mcore_ckpt.cli import fsck

    try:
        result = fsck.check(args.path, deep=args.deep)
    except FileNotFoundError as err:
        return _fail(err)
    for step in result.steps:
        if step.problems:
            print(f"{step.path.name}  DAMAGED")
            for problem in step.problems:
                print(f"    {problem}")
            continue
        if args.deep and step.hashed:
            how = f"{step.hashed} of {step.files} files re-hashed"
        elif args.deep:
            how = "no hashes recorded (committed before they were kept): sizes checked"
        else:
            how = f"{step.files} files: sizes and structure"
        print(f"{step.path.name}  OK ({how})")
    for stale in result.incomplete:
        print(f"{stale.name}  incomplete (never committed; ignored by 'last')")
    for note in result.notes:
        print(f"note: {note}")
    damaged = [s.path.name for s in result.damaged]
    if damaged:
        print(f"FAILED: {len(damaged)} damaged step(s): {', '.join(damaged)}")
        return 1
    if not result.steps:
        return 1
    print(f"OK: {len(result.steps)} step(s) checked{' (deep)' if args.deep else ''}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    import json

    from lightning_mcore_ckpt.cli import inspect as preflight

    target: dict[str, int] = {}
    spec = None
    for size in preflight.SIZES:
        value = getattr(args, size)
        if value is not None and value < 1:
            return _fail(f"--{size}: {value} is not a positive size")
    try:
        if args.config is not None:
            from lightning_mcore_ckpt.cli.inspect_config import spec_from_config

            spec, target = spec_from_config(args.config)
        target.update({s: getattr(args, s) for s in preflight.SIZES if getattr(args, s)})
        report = preflight.inspect_step(args.step, target, spec)
    except (FileNotFoundError, ValueError) as err:
        return _fail(err)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        for finding in report.findings:
            mark = "BLOCKER" if finding.blocker else "ok     "
            print(f"{mark} [{finding.topic}] {finding.message}")
        blockers = len(report.blockers)
        print(f"FAILED: {blockers} blocker(s)" if blockers else "OK: it loads")
    return 1 if report.blockers else 0


def _check_resume(args: argparse.Namespace) -> int:
    import json

    try:
        import jsonargparse  # noqa: F401
    except ImportError:
        return _fail(
            "check-resume reads a LightningCLI config and needs the cli extra: "
            "pip install 'lightning-mcore-ckpt[cli]'"
        )
    from lightning_mcore_ckpt import notices
    from lightning_mcore_ckpt.resume_check import JobFailed, check_resume
    from lightning_mcore_ckpt.resume_check._run import HOWS

    # With --json, stdout carries the report only: what the runs print (progress, model
    # summaries) goes to stderr, also from the rank processes started meanwhile.
    sys.stdout.flush()
    stdout = os.dup(1)
    if args.json:
        os.dup2(2, 1)
    # The processes that run the job warn as they import what they preload: the known notices
    # of the libraries underneath are kept out of the report's way there too.
    warning_options = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = ",".join(
        o for o in (warning_options, notices.python_warnings(cpu=True)) if o
    )
    failed = False
    try:
        report = check_resume(
            args.config,
            stop_at=args.stop_at,
            max_steps=args.max_steps,
            how=tuple(args.how) if args.how else HOWS,
            workdir=args.workdir,
        )
    except JobFailed as err:  # the job's own error: its verdict, not a divergence
        report, failed = err.report, True
    except (FileNotFoundError, ValueError) as err:
        return _fail(err)
    finally:
        sys.stdout.flush()
        os.dup2(stdout, 1)
        os.close(stdout)
        if warning_options is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = warning_options
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    if failed:
        return EXIT_JOB_FAILED
    return 0 if report.exact else 1
