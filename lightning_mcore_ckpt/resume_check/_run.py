"""Run a job uninterrupted and interrupted, resume it, and report the first divergence."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.launch.local import DistributedFailure
from lightning_mcore_ckpt.resume_check._compare import (
    Divergence,
    compare_finals,
    compare_timelines,
)
from lightning_mcore_ckpt.resume_check._failure import (
    JobFailure,
    describe_failure,
    job_failure,
    record_failure,
)
from lightning_mcore_ckpt.resume_check._job import ResumeJob, read_config, run_job

__all__ = [
    "InterruptionResult",
    "JobFailed",
    "ResumeJob",
    "ResumeReport",
    "check_resume",
]

log = logging.getLogger(__name__)

HOWS = ("clean", "sigterm", "kill")
"""The interruptions tried by default."""
ALL_HOWS = (*HOWS, "max_steps")
"""Also ``"max_steps"``: the run ends at ``stop_at`` as a finished run, then is extended."""


@dataclass
class InterruptionResult:
    """One way of interrupting the job: where it resumed, and what diverged first (if anything).

    Example::

        summary = [(r.how, r.resumed_from, r.exact) for r in report.results]
    """

    how: str
    resumed_from: int | None
    divergence: Divergence | None = None

    @property
    def exact(self) -> bool:
        return self.divergence is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "how": self.how,
            "resumed_from": self.resumed_from,
            "exact": self.exact,
            "divergence": None if self.divergence is None else self.divergence.to_dict(),
        }


class JobFailed(DistributedFailure):
    """:func:`check_resume` could not judge resume: a run of the job failed to run.

    Not a divergence: the job itself raised (or died, or hung) in one of the runs. ``failure``
    (a :class:`JobFailure`) names the run, the ranks and the exception; ``report`` holds what
    was judged before it (``report.failure`` is the same failure). ``str(err)`` is the report.

    Example::

        try:
            report = check_resume(build, stop_at=5, max_steps=10, world_size=2)
        except JobFailed as err:
            raise SystemExit(f"{err.failure.run} failed: {err.failure.exception}") from None
    """

    def __init__(self, report: ResumeReport) -> None:
        assert report.failure is not None
        self.report = report
        self.failure: JobFailure = report.failure
        super().__init__(str(report))


@dataclass
class ResumeReport:
    """The outcome of :func:`check_resume`.

    ``exact`` is true only when the job is deterministic and every interrupted-and-resumed run
    is bit-identical to the uninterrupted one. ``str(report)`` is the human-readable report,
    ``to_dict()`` the JSON one.

    Example::

        report = check_resume(build, stop_at=5, max_steps=10, world_size=2)
        if not report.exact:
            raise SystemExit(str(report))
    """

    stop_at: int
    max_steps: int
    world_size: int
    nondeterminism: Divergence | None = None
    results: list[InterruptionResult] = field(default_factory=list)
    workdir: str | None = None
    failure: JobFailure | None = None
    """A run of the job that failed to run (then :func:`check_resume` raises
    :class:`JobFailed`): resume was not judged from there on."""

    @property
    def deterministic(self) -> bool:
        return self.nondeterminism is None

    @property
    def exact(self) -> bool:
        return self.failure is None and self.deterministic and all(r.exact for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        return {
            "exact": self.exact,
            "deterministic": self.deterministic,
            "stop_at": self.stop_at,
            "max_steps": self.max_steps,
            "world_size": self.world_size,
            "nondeterminism": (
                None if self.nondeterminism is None else self.nondeterminism.to_dict()
            ),
            "results": [r.to_dict() for r in self.results],
            "workdir": self.workdir,
            "failure": None if self.failure is None else self.failure.to_dict(),
        }

    def __str__(self) -> str:
        head = (
            f"resume check: {self.world_size} process(es), interrupted at step {self.stop_at}, "
            f"compared to step {self.max_steps}"
        )
        lines = [head]
        if self.nondeterminism is not None:
            lines.append(
                "NOT DETERMINISTIC: two uninterrupted runs of the job differ, so resume cannot "
                f"be judged. First difference at {self.nondeterminism.message}"
            )
            lines.append(
                "  Seed everything (seed_everything, the data order, dropout) from the config, "
                "not from the clock."
            )
        for r in self.results:
            where = f"resumed from step {r.resumed_from}" if r.resumed_from else "no resume"
            if r.divergence is None:
                lines.append(f"{r.how:8s} exact ({where}): losses, data, RNG, weights, optimizer,")
                lines.append(" " * 9 + "scheduler and loop counters bit-identical")
            else:
                lines.append(f"{r.how:8s} DIVERGED ({where}) at {r.divergence.message}")
                if r.divergence.detail:
                    lines.append(" " * 9 + r.divergence.detail)
        if self.failure is not None:
            lines.extend(describe_failure(self.failure))
            lines.append("NOT CHECKED: the job failed to run")
            return "\n".join(lines)
        lines.append("EXACT" if self.exact else "NOT EXACT")
        return "\n".join(lines)


def _read_run(probe_dir: Path) -> tuple[dict[int, list[dict[str, Any]]], dict[int, Any], int]:
    timelines: dict[int, list[dict[str, Any]]] = {}
    finals: dict[int, Any] = {}
    resumed_from = 0
    for path in sorted(probe_dir.glob("rank_*.jsonl")):
        rank = int(path.stem.split("_")[1])
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        starts = [r for r in records if r.get("event") == "start"]
        if starts:
            resumed_from = int(starts[-1]["global_step"])
        timelines[rank] = [r for r in records if "event" not in r]
    for path in sorted(probe_dir.glob("final_rank_*.json")):
        finals[int(path.stem.split("_")[2])] = json.loads(path.read_text())
    return timelines, finals, resumed_from


def _job_main(
    rank: int,
    world_size: int,
    source: Any,
    run_dir: str,
    ckpt_dir: str,
    max_steps: int,
    ckpt_path: str | None,
    how: str | None,
    stop_at: int,
) -> None:
    import torch

    from lightning_mcore_ckpt.notices import hide_known_notices

    # A process of the check's own: what the libraries underneath say about themselves stays
    # out of the report's way (the job's own warnings and errors are shown).
    hide_known_notices(cpu=not torch.cuda.is_available())
    try:
        run_job(source, Path(run_dir), Path(ckpt_dir), max_steps, ckpt_path, how, stop_at)
    except BaseException as err:
        record_failure(Path(run_dir) / "probe", rank, err)
        raise


def _launch(
    source: Any,
    world_size: int,
    run_dir: Path,
    ckpt_dir: Path,
    max_steps: int,
    ckpt_path: str | None,
    how: str | None,
    stop_at: int,
    timeout: float,
) -> DistributedFailure | None:
    """Run the job; what stopped it when it failed to run (``None``: it ran)."""
    from lightning_mcore_ckpt.launch.local import run_distributed

    args = (source, str(run_dir), str(ckpt_dir), max_steps, ckpt_path, how, stop_at)
    try:
        run_distributed(_job_main, world_size, *args, timeout=timeout)
    except DistributedFailure as err:
        killed = sorted((run_dir / "probe").glob("killed_rank_*"))
        if how == "kill" and len(killed) == world_size:
            return None  # every rank reached the kill point: the job died as intended
        return err
    return None


def check_resume(
    build: Callable[[], ResumeJob] | str | Path,
    *,
    stop_at: int,
    max_steps: int | None = None,
    how: str | Sequence[str] = HOWS,
    world_size: int | None = None,
    workdir: str | Path | None = None,
    check_determinism: bool = True,
    timeout: float = 600.0,
) -> ResumeReport:
    """Prove that a job resumes exactly: run it whole, and interrupted and resumed, and compare.

    ``build`` is a function returning a :class:`ResumeJob` (defined at module level: every rank
    of every run is a fresh process that imports it), or the path of a LightningCLI config that
    names its model and data by ``class_path``. The job runs uninterrupted to ``max_steps`` (twice
    when ``check_determinism``: a job that differs from itself without any interruption is
    reported as not deterministic rather than blamed on resume), then, for each ``how``,
    interrupted at step ``stop_at`` — ``"max_steps"`` (the run ends there as a finished run and
    is then extended), ``"clean"`` (``trainer.should_stop`` after the step, then
    the end-of-fit save), ``"sigterm"`` (a real SIGTERM to the last rank at the first batch of
    the step, inside its accumulation window), ``"kill"`` (SIGKILL of every rank once the step is
    done and the saves so far are committed) — and resumed with ``fit(ckpt_path="last")`` to
    ``max_steps``. Per-step losses, the samples every rank received, every RNG stream, weights,
    optimizer and LR scheduler state and the loop counters are compared bit for bit, batch by
    batch; the report names the first divergence.

    A run of the job that fails to run (it raises, a rank dies, or it does not finish within
    ``timeout`` seconds) is not a divergence: :class:`JobFailed` is raised, naming the run, the
    ranks and the exception (``err.failure``), with what was judged before it (``err.report``).

    Runs on the processes of this machine (``world_size``: the Trainer's ``devices``, from the
    config, or 1), CPU or GPU as the job says.

    Example::

        report = check_resume(build, stop_at=5, max_steps=10, world_size=2)
        assert report.exact, str(report)
    """
    hows = (how,) if isinstance(how, str) else tuple(how)
    bad = [h for h in hows if h not in ALL_HOWS]
    if bad or not hows:
        raise ValueError(f"check_resume(how={how!r}): choose from {ALL_HOWS}")
    source, world_size, max_steps = _job_source(build, world_size, max_steps)
    _check_steps(stop_at, max_steps, world_size)
    owned = workdir is None
    root = _workdir(workdir)
    report = ResumeReport(stop_at=stop_at, max_steps=max_steps, world_size=world_size)
    report.workdir = None if owned else str(root)
    runs = _Runs(source, report, timeout)
    try:
        ref = runs.launch(root / "reference" / "run", None, None, "the uninterrupted run")
        if check_determinism:
            again = runs.launch(
                root / "reference_again" / "run",
                None,
                None,
                "the second uninterrupted run (the determinism check)",
            )
            report.nondeterminism = compare_timelines(ref[0], again[0]) or compare_finals(
                ref[1], again[1]
            )
            if report.nondeterminism is not None:
                return report
        for way in hows:
            base = root / way
            runs.launch(base / "interrupted", None, way, f"the interrupted run ({way})")
            resumed = runs.launch(base / "resumed", "last", None, f"the resumed run ({way})")
            report.results.append(InterruptionResult(way, resumed[2], _divergence(ref, resumed)))
        return report
    finally:
        if owned:
            shutil.rmtree(root, ignore_errors=True)


def _job_source(
    build: Callable[[], ResumeJob] | str | Path, world_size: int | None, max_steps: int | None
) -> tuple[Any, int, int]:
    """What every rank builds the job from (the function, or the config's path and text), with
    the world size and the last step (the config's, where the caller gave none)."""
    source: Any
    if isinstance(build, str | Path):
        config = read_config(build)
        source = {"config": str(Path(build).resolve()), "text": config.text}
        world_size = world_size or config.world_size
        max_steps = max_steps if max_steps is not None else config.max_steps
    elif callable(build):
        source = build
    else:
        raise ValueError(
            f"check_resume(build={build!r}): pass a function returning a ResumeJob, or the "
            "path of a LightningCLI config"
        )
    if max_steps is None:
        raise ValueError(
            "check_resume(max_steps=None): pass the step to compare up to (--max-steps), or "
            "set trainer.max_steps in the config"
        )
    return source, world_size or 1, max_steps


def _check_steps(stop_at: int, max_steps: int, world_size: int) -> None:
    for name, value in (("stop_at", stop_at), ("max_steps", max_steps), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"check_resume({name}={value!r}): must be a positive int")
    if stop_at >= max_steps:
        raise ValueError(
            f"check_resume(stop_at={stop_at}, max_steps={max_steps}): stop_at must be before "
            "max_steps, so that the resumed run has steps left to train"
        )


def _workdir(workdir: str | Path | None) -> Path:
    """The check's directory: a new temporary one, or ``workdir`` if it is new or empty."""
    if workdir is None:
        return Path(tempfile.mkdtemp(prefix="resume-check-"))
    root = Path(workdir)
    if root.exists() and any(root.iterdir()):
        raise ValueError(
            f"check_resume(workdir={str(workdir)!r}): the directory is not empty; pass a new "
            "or empty directory"
        )
    root.mkdir(parents=True, exist_ok=True)
    return root


class _Runs:
    """Launches the job's runs of one check; a run that fails to run ends the check."""

    def __init__(self, source: Any, report: ResumeReport, timeout: float) -> None:
        self.source, self.report, self.timeout = source, report, timeout

    def launch(self, run_dir: Path, ckpt: str | None, way: str | None, run: str) -> Any:
        """Run the job once (``way``: interrupted so; ``ckpt``: resumed from it) and read what
        its probe recorded: (timelines, finals, the step it resumed from)."""
        report = self.report
        steps = report.stop_at if way == "max_steps" else report.max_steps
        failed = _launch(
            self.source,
            report.world_size,
            run_dir,
            run_dir.parent / "checkpoints",
            steps,
            ckpt,
            way,
            report.stop_at,
            self.timeout,
        )
        if failed is not None:
            report.failure = job_failure(run, run_dir / "probe", failed)
            raise JobFailed(report) from failed
        return _read_run(run_dir / "probe")


def _divergence(ref: Any, resumed: Any) -> Divergence | None:
    """Where a resumed run first differs from the uninterrupted one (``None``: nowhere)."""
    run, final, resumed_from = resumed
    if resumed_from == 0:
        return Divergence(
            step=None,
            epoch=None,
            batch=None,
            differs={"length": sorted(run)},
            message=(
                "the resumed run started from step 0: nothing was resumed (no complete "
                "step in the checkpoint directory?)"
            ),
        )
    return compare_timelines(ref[0], run, resumed_from) or compare_finals(ref[1], final)
