"""A run of the resume check that failed to run: what its ranks raised, and the verdict."""

from __future__ import annotations

import json
import re
import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "JobFailure",
    "JobMisfit",
    "describe_failure",
    "job_failure",
    "misfit",
    "record_failure",
]


@dataclass
class JobFailure:
    """A run of the job that failed to run (it raised, died or hung), so nothing was compared.

    ``run`` says which (``"the uninterrupted run"``, ``"the resumed run (sigterm)"``, ...),
    ``ranks`` the ranks that failed with ``exception`` (``"AttributeError: ..."``, its type and
    message; for a rank that died or hung, what was seen), ``where`` the innermost frame of it
    outside the installed libraries (``"my_job.py:42, in configure_model"``), ``traceback`` the
    whole traceback of the first rank.

    Example::

        try:
            check_resume(build, stop_at=5, max_steps=10)
        except JobFailed as err:
            print(err.failure.run, err.failure.ranks, err.failure.exception)
    """

    run: str
    ranks: list[int]
    exception: str
    where: str | None = None
    traceback: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "ranks": self.ranks,
            "exception": self.exception,
            "where": self.where,
            "traceback": self.traceback,
        }


def describe_failure(failure: JobFailure) -> list[str]:
    """The report's lines for ``failure``: the run, the ranks, the exception and where."""
    ranks = ", ".join(map(str, failure.ranks))
    on = f" on rank{'s' if len(failure.ranks) > 1 else ''} {ranks}" if ranks else ""
    lines = [f"FAILED TO RUN: {failure.run} failed{on}, so resume could not be judged:"]
    lines.extend("  " + line for line in failure.exception.splitlines() or [""])
    if failure.where:
        lines.append(f"  at {failure.where}")
    lines.append(
        "  This is an error of the job itself, not a divergence: fix it, then run the check "
        "again (the JSON report, --json, has its whole traceback)."
    )
    return lines


class JobMisfit(ValueError):
    """The job does not fit the check's arguments (found as a rank builds it, before it trains):
    :func:`~._run.check_resume` raises it as the ``ValueError`` of a bad argument, not as a
    failure of the job."""


_LIBRARIES = tuple(
    {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)
_FAILED_FILE = "failed_rank_{rank:05d}.json"


def _user_frame(tb: Any) -> str | None:
    """The innermost frame of a traceback outside the standard library and installed packages
    (the job's own code, or this package in a source checkout), else the innermost one."""
    frames = traceback.extract_tb(tb)
    if not frames:
        return None
    ours = [f for f in frames if not f.filename.startswith(_LIBRARIES) and "<" not in f.filename]
    frame = (ours or frames)[-1]
    return f"{frame.filename}:{frame.lineno}, in {frame.name}"


def record_failure(probe_dir: Path, rank: int, err: BaseException) -> None:
    """What a rank raised, for the parent to name the run, the rank and the exception."""
    message = str(err)
    record = {
        "exception": f"{type(err).__name__}: {message}" if message else type(err).__name__,
        "where": _user_frame(err.__traceback__),
        "traceback": "".join(traceback.format_exception(err)),
        "misfit": isinstance(err, JobMisfit),
    }
    try:
        probe_dir.mkdir(parents=True, exist_ok=True)
        (probe_dir / _FAILED_FILE.format(rank=rank)).write_text(json.dumps(record))
    except OSError:  # the failure is still reported, from what the launcher saw
        pass


def misfit(probe_dir: Path) -> str | None:
    """The message of a :class:`JobMisfit` a rank of the run raised, else ``None``."""
    for path in sorted(probe_dir.glob("failed_rank_*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if record.get("misfit"):
            return str(record["exception"]).split(": ", 1)[-1]
    return None


def job_failure(run: str, probe_dir: Path, err: BaseException) -> JobFailure:
    """The failure of a run: what its ranks recorded, else what the launcher saw."""
    recorded = {}
    for path in sorted(probe_dir.glob("failed_rank_*.json")):
        try:
            recorded[int(path.stem.split("_")[2])] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    seen = str(err)
    named = re.match(r"rank (\d+) of \d+", seen)
    first = int(named.group(1)) if named else None
    if recorded:
        rank = first if first in recorded else min(recorded)
        mine = recorded[rank]
        ranks = sorted(r for r, v in recorded.items() if v["exception"] == mine["exception"])
        return JobFailure(run, ranks, mine["exception"], mine.get("where"), mine["traceback"])
    many = re.match(r"ranks \[([\d, ]*)\] of \d+", seen)
    if many:
        ranks = [int(r) for r in many.group(1).split(",") if r.strip()]
    else:
        ranks = [] if first is None else [first]
    return JobFailure(run, ranks, seen.splitlines()[0] if seen else type(err).__name__)
