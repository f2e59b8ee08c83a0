"""``lightning-mcore-ckpt check-resume``: does a LightningCLI job resume exactly? The command
line of :func:`lightning_mcore_ckpt.resume_check.check_resume`, which runs the job whole and
interrupted and compares the runs."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.cli.failure import fail, missing

__all__ = ["EXIT_JOB_FAILED", "add_parsers"]

EXIT_JOB_FAILED = 3
"""``check-resume``'s exit code when a run of the job fails to run (1 is a divergence)."""

LOG_NAME = "check-resume.log"
"""The log of the runs in ``--workdir``: what every rank's Lightning prints about itself
(``GPU available: ...``) and the known notices of the libraries underneath
(:func:`~lightning_mcore_ckpt.notices.log_known_notices`), kept out of the report's way."""


def add_parsers(commands: Any) -> None:
    """Add ``check-resume`` to the command line's subparsers."""
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
            "identical, 1 on a divergence (or a wipe-node resume that did not come from the fast "
            "tier's peer copies: NOT PROVEN), 2 on bad usage, 3 when a run of the job fails to run "
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
        choices=["clean", "sigterm", "kill", "max_steps", "wipe-node"],
        action="append",
        help="how to interrupt: a clean stop (trainer.should_stop) after the step, SIGTERM, a "
        "hard kill after the last committed step (the fast tier's too), max_steps (a finished "
        "run, extended), or wipe-node: the same kill, then node 1's directory emptied (a "
        "replaced node), so that the resume must come from the fast tier with a peer node's "
        "copies (needs --nodes 2 or more and a MegatronCheckpoint fast_tier; a resume from the "
        "persistent tier is reported NOT PROVEN); repeat to try several (default: clean, "
        "sigterm and kill)",
    )
    check.add_argument(
        "--nodes",
        type=int,
        metavar="N",
        help="run every run of the check on N simulated nodes of this machine (Linux, as root), "
        "trainer.devices x num_nodes / N processes each, each node with its own fast-tier "
        "directory (default: the config's trainer.num_nodes, or 1)",
    )
    check.add_argument(
        "--workdir",
        help="keep every run's checkpoints and records here (a new directory), and the log of "
        f"the runs ({LOG_NAME}: Lightning's banners, the libraries' known notices); without "
        "it the log is a new file in the system's temporary directory",
    )
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.set_defaults(handler=_check_resume)


def _check_resume(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if (found := missing("check-resume", ("--config", args.config))) is not None:
        return found
    try:
        import jsonargparse  # noqa: F401
    except ImportError:
        return fail(
            "check-resume reads a LightningCLI config and needs the cli extra: "
            "pip install 'lightning-mcore-ckpt[cli]'"
        )
    from lightning_mcore_ckpt.resume_check import JobFailed, check_resume
    from lightning_mcore_ckpt.resume_check._run import HOWS

    log, made = _log_file(args.workdir)

    # With --json, stdout carries the report only: what the runs print (progress, model
    # summaries) goes to stderr, also from the rank processes started meanwhile.
    sys.stdout.flush()
    stdout = os.dup(1)
    if args.json:
        os.dup2(2, 1)
    failed = False
    try:
        report = check_resume(
            args.config,
            stop_at=args.stop_at,
            max_steps=args.max_steps,
            how=tuple(args.how) if args.how else HOWS,
            nodes=args.nodes,
            workdir=args.workdir,
            log_file=log,
        )
    except JobFailed as err:  # the job's own error: its verdict, not a divergence
        report, failed = err.report, True
    except (FileNotFoundError, ValueError) as err:
        if made and log.is_file() and log.stat().st_size == 0:  # no run started
            log.unlink()
        return fail(err)
    finally:
        sys.stdout.flush()
        os.dup2(stdout, 1)
        os.close(stdout)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    # stdout is the report alone.
    print(f"the runs' Lightning banners and the libraries' own notices: {log}", file=sys.stderr)
    if failed:
        return EXIT_JOB_FAILED
    return 0 if report.exact else 1


def _log_file(workdir: str | None) -> tuple[Path, bool]:
    """Where the runs' log goes: ``--workdir``'s :data:`LOG_NAME` (written once the check has
    found the directory new or empty), else a new file in the system's temporary directory
    (the check's own directory is removed at its end); whether this made it."""
    if workdir is not None:
        return Path(workdir).expanduser().absolute() / LOG_NAME, False
    fd, name = tempfile.mkstemp(prefix="check-resume-", suffix=".log")
    os.close(fd)
    return Path(name), True
