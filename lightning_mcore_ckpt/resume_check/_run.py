"""Run a job uninterrupted and interrupted, resume it, and report the first divergence."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import textwrap
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
    misfit,
    record_failure,
)
from lightning_mcore_ckpt.resume_check._job import Placement, ResumeJob, read_config, run_job
from lightning_mcore_ckpt.resume_check._probe import KILLS

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
ALL_HOWS = (*HOWS, "max_steps", "wipe-node")
"""Also ``"max_steps"``: the run ends at ``stop_at`` as a finished run, then is extended; and
``"wipe-node"``: killed as ``"kill"``, then node 1's directory is emptied (a replaced node), so
that the resume must come from the fast tier's copies on the peer nodes."""
WIPED_NODE = 1
"""The node whose directory ``"wipe-node"`` empties."""
RECORDS = "fast_tier.jsonl"
"""The persistent directory's record of the fast tier's saves and recoveries (its callback's)."""


@dataclass
class InterruptionResult:
    """One way of interrupting the job: where it resumed, and what diverged first (if anything).

    Example::

        summary = [(r.how, r.resumed_from, r.exact) for r in report.results]
    """

    how: str
    resumed_from: int | None
    divergence: Divergence | None = None
    recovery: dict[str, Any] | None = None
    """With a fast tier, how the resume was served, as the job's checkpoint callback recorded it
    (``fast_tier.jsonl``): ``tier`` (``"fast"`` or ``"persistent"``), ``step``,
    ``ranks_from_peers`` (the ranks that read another node's copy), ``ranks``, ``skipped`` (why
    newer fast steps were not used). ``None``: the job has no fast tier."""
    unproven: str | None = None
    """Why this interruption does not prove what it was meant to (``"wipe-node"``: the resume
    did not come from the fast tier with a peer node's copies), else ``None``."""

    @property
    def exact(self) -> bool:
        return self.divergence is None

    @property
    def proven(self) -> bool:
        """Bit-identical, and resumed the way this interruption is meant to prove."""
        return self.exact and self.unproven is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "how": self.how,
            "resumed_from": self.resumed_from,
            "exact": self.exact,
            "proven": self.proven,
            "recovery": self.recovery,
            "unproven": self.unproven,
            "divergence": None if self.divergence is None else self.divergence.to_dict(),
        }

    def source(self) -> str:
        """Where the resume came from, in words."""
        if not self.resumed_from:
            return "no resume"
        found = self.recovery
        if found is None:
            return f"resumed from step {self.resumed_from}"
        if found.get("tier") != "fast":
            return f"resumed from step {self.resumed_from}, persistent tier"
        peers = int(found.get("ranks_from_peers") or 0)
        copies = (
            f"{peers} of {found.get('ranks')} ranks from a peer node's copy"
            if peers
            else "own copies"
        )
        return f"resumed from fast step {found.get('step')}, {copies}"


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
    is bit-identical to the uninterrupted one, and resumed as its interruption is meant to prove
    (``"wipe-node"``: from the fast tier, with a peer node's copies). ``str(report)`` is the human-readable report,
    ``to_dict()`` the JSON one.

    Example::

        report = check_resume(build, stop_at=5, max_steps=10, world_size=2)
        if not report.exact:
            raise SystemExit(str(report))
    """

    stop_at: int
    max_steps: int
    world_size: int
    nodes: int = 1
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
        return self.failure is None and self.deterministic and all(r.proven for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        return {
            "exact": self.exact,
            "deterministic": self.deterministic,
            "stop_at": self.stop_at,
            "max_steps": self.max_steps,
            "world_size": self.world_size,
            "nodes": self.nodes,
            "nondeterminism": (
                None if self.nondeterminism is None else self.nondeterminism.to_dict()
            ),
            "results": [r.to_dict() for r in self.results],
            "workdir": self.workdir,
            "failure": None if self.failure is None else self.failure.to_dict(),
        }

    def __str__(self) -> str:
        on = f" on {self.nodes} simulated nodes" if self.nodes > 1 else ""
        head = (
            f"resume check: {self.world_size} process(es){on}, interrupted at step "
            f"{self.stop_at}, compared to step {self.max_steps}"
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
            where = r.source()
            if r.unproven is not None:
                lines.append(f"{r.how:8s} NOT PROVEN ({where}):")
                if r.divergence is None:
                    said = f"{r.unproven}. The resumed run is bit-identical from there."
                else:
                    said = f"{r.unproven}. It also DIVERGED at {r.divergence.message}"
                lines.extend(
                    textwrap.wrap(said, 96, initial_indent=" " * 9, subsequent_indent=" " * 9)
                )
            elif r.divergence is None:
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
        if self.exact:
            lines.append("EXACT")
        elif self.deterministic and all(r.exact for r in self.results):
            lines.append("NOT PROVEN: bit-identical, but not resumed as the check asked")
        else:
            lines.append("NOT EXACT")
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
    place: Placement,
    max_steps: int,
    ckpt_path: str | None,
    how: str | None,
    stop_at: int,
    log_file: str | None,
) -> None:
    import torch

    from lightning_mcore_ckpt.notices import hide_known_notices, log_known_notices

    # A process of the check's own: what the libraries underneath say about themselves (and,
    # with a log file, Lightning's banners) stays out of the report's way; the job's own
    # warnings and errors are shown.
    cpu = not torch.cuda.is_available()
    if log_file is None:
        hide_known_notices(cpu=cpu)
    else:
        log_known_notices(log_file, cpu=cpu)
    try:
        run_job(source, Path(run_dir), place, max_steps, ckpt_path, how, stop_at)
    except BaseException as err:
        record_failure(Path(run_dir) / "probe", rank, err)
        raise


def _launch(
    source: Any,
    world_size: int,
    run_dir: Path,
    place: Placement,
    max_steps: int,
    ckpt_path: str | None,
    how: str | None,
    stop_at: int,
    timeout: float,
    log_file: str | None,
) -> DistributedFailure | None:
    """Run the job (on ``place.nodes`` simulated nodes when more than one, each with its own
    directory at ``place.fast_dir``'s parent); what stopped it when it failed to run (``None``:
    it ran)."""
    from lightning_mcore_ckpt.launch.local import run_distributed
    from lightning_mcore_ckpt.launch.nodes import run_nodes

    args = (source, str(run_dir), place, max_steps, ckpt_path, how, stop_at, log_file)
    try:
        if place.nodes > 1:
            node_dir = place.fast_dir.parent
            per_node = world_size // place.nodes
            run_nodes(_job_main, place.nodes, per_node, *args, node_dir=node_dir, timeout=timeout)
        else:
            run_distributed(_job_main, world_size, *args, timeout=timeout)
    except DistributedFailure as err:
        killed = sorted((run_dir / "probe").glob("killed_rank_*"))
        if how in KILLS and len(killed) == world_size:
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
    nodes: int | None = None,
    workdir: str | Path | None = None,
    check_determinism: bool = True,
    timeout: float = 600.0,
    log_file: str | Path | None = None,
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
    done and the saves so far are committed, the fast tier's too), ``"wipe-node"`` (the same
    kill, then node 1's directory is emptied, as a replaced node's: the resume must come from the
    fast tier, node 1's ranks reading their copies from a peer node; a resume from the persistent
    tier is reported as NOT PROVEN) — and resumed with ``fit(ckpt_path="last")`` to
    ``max_steps``. Per-step losses, the samples every rank received, every RNG stream, weights,
    optimizer and LR scheduler state and the loop counters are compared bit for bit, batch by
    batch; the report names the first divergence.

    A run of the job that fails to run (it raises, a rank dies, or it does not finish within
    ``timeout`` seconds) is not a divergence: :class:`JobFailed` is raised, naming the run, the
    ranks and the exception (``err.failure``), with what was judged before it (``err.report``).

    Runs on the processes of this machine (``world_size``: the Trainer's ``devices`` x
    ``num_nodes``, from the config, or 1), CPU or GPU as the job says. ``nodes`` (default: the
    config's ``num_nodes``, or 1) splits them into that many simulated nodes
    (:func:`~lightning_mcore_ckpt.testing.run_nodes`: Linux, as root), every run of the check
    alike; the job's Trainer must say ``num_nodes=nodes`` (a config's is set so).

    Every run gets checkpoint directories of its own: the job's ``MegatronCheckpoint`` is pointed
    at a persistent directory shared by the nodes, and its fast tier (if any) at
    ``<run>/node_local/fast``, which is each node's own directory. ``"wipe-node"`` needs a fast
    tier, ``nodes >= 2`` and a ``stop_at`` after a fast step newer than the persistent tier's
    last step.

    ``log_file``: every rank of every run writes Lightning's banners (``GPU available: ...``)
    and the known notices of the libraries underneath there (appended;
    :func:`~lightning_mcore_ckpt.notices.log_known_notices`) rather than on stderr. ``None``:
    Lightning's banners are shown, and the libraries' known notices hidden.

    Example::

        report = check_resume(build, stop_at=5, max_steps=10, world_size=2)
        assert report.exact, str(report)
    """
    hows = _checked_hows(how)
    source, world_size, max_steps, nodes = _job_source(build, world_size, max_steps, nodes)
    _check_steps(stop_at, max_steps, world_size)
    _check_nodes(nodes, world_size, hows, source)
    owned = workdir is None
    root = _workdir(workdir)
    report = ResumeReport(stop_at=stop_at, max_steps=max_steps, world_size=world_size)
    report.nodes = nodes
    report.workdir = None if owned else str(root)
    log = None if log_file is None else str(Path(log_file).absolute())
    runs = _Runs(source, report, timeout, needs_fast_tier="wipe-node" in hows, log_file=log)
    try:
        return _judge(runs, root, hows, check_determinism)
    finally:
        if owned:
            shutil.rmtree(root, ignore_errors=True)


def _checked_hows(how: str | Sequence[str]) -> tuple[str, ...]:
    hows = (how,) if isinstance(how, str) else tuple(how)
    bad = [h for h in hows if h not in ALL_HOWS]
    if bad or not hows:
        raise ValueError(f"check_resume(how={how!r}): choose from {ALL_HOWS}")
    return hows


def _judge(runs: _Runs, root: Path, hows: tuple[str, ...], check_determinism: bool) -> ResumeReport:
    """The uninterrupted run (twice with ``check_determinism``), then each interruption and its
    resume, judged against it: the report (``runs.report``), filled in."""
    report = runs.report
    ref = runs.launch(root / "reference" / "run", None, None, "the uninterrupted run")
    if check_determinism:
        report.nondeterminism = _differs_from_itself(runs, root, ref)
        if report.nondeterminism is not None:
            return report
    for way in hows:
        report.results.append(_interrupt_and_resume(runs, root / way, way, ref))
    return report


def _differs_from_itself(runs: _Runs, root: Path, ref: Any) -> Any:
    """The job run uninterrupted a second time: where it differs from ``ref`` (``None``: not)."""
    again = runs.launch(
        root / "reference_again" / "run",
        None,
        None,
        "the second uninterrupted run (the determinism check)",
    )
    return compare_timelines(ref[0], again[0]) or compare_finals(ref[1], again[1])


def _interrupt_and_resume(runs: _Runs, base: Path, way: str, ref: Any) -> InterruptionResult:
    """One ``how``: the job interrupted so (node 1 wiped after, for ``"wipe-node"``), resumed
    from ``"last"``, and compared with the uninterrupted run ``ref``; which tier served it."""
    runs.launch(base / "interrupted", None, way, f"the interrupted run ({way})")
    if way == "wipe-node":
        _wipe(runs.place(base), WIPED_NODE)
    seen = len(_recoveries(base))
    resumed = runs.launch(base / "resumed", "last", None, f"the resumed run ({way})")
    result = InterruptionResult(way, resumed[2], _divergence(ref, resumed))
    recoveries = _recoveries(base)[seen:]
    result.recovery = recoveries[-1] if recoveries else None
    if way == "wipe-node":
        result.unproven = _unproven(result)
    return result


def _job_source(
    build: Callable[[], ResumeJob] | str | Path,
    world_size: int | None,
    max_steps: int | None,
    nodes: int | None,
) -> tuple[Any, int, int, int]:
    """What every rank builds the job from (the function, or the config's path and text), with
    the world size, the last step and the number of nodes (the config's, where the caller gave
    none)."""
    source: Any
    if isinstance(build, str | Path):
        config = read_config(build)
        source = {
            "config": str(Path(build).resolve()),
            "text": config.text,
            "fast_tier": config.fast_tier,
        }
        world_size = world_size or config.world_size
        max_steps = max_steps if max_steps is not None else config.max_steps
        nodes = nodes if nodes is not None else config.nodes
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
    return source, world_size or 1, max_steps, 1 if nodes is None else nodes


def _check_nodes(nodes: int, world_size: int, hows: Sequence[str], source: Any) -> None:
    """Refuse a number of nodes the world size cannot be split into, and ``"wipe-node"``
    where it cannot prove anything (one node; a config without a fast tier)."""
    from lightning_mcore_ckpt.launch.nodes import nodes_unavailable

    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"check_resume(nodes={nodes!r}): must be a positive int (1: no nodes)")
    if world_size % nodes:
        raise ValueError(
            f"check_resume(nodes={nodes}, world_size={world_size}): every node runs the same "
            f"number of ranks; pass a world_size that is a multiple of {nodes} (e.g. "
            f"{nodes * max(1, world_size // nodes)}), or a number of nodes that divides "
            f"{world_size}"
        )
    if "wipe-node" in hows and nodes < 2:
        raise ValueError(
            f"check_resume(how='wipe-node', nodes={nodes}): wiping a node's directory proves "
            "a resume from the copies on its peer nodes, which needs at least 2 nodes; pass "
            "nodes=2 (--nodes 2) or more"
        )
    if "wipe-node" in hows and isinstance(source, dict) and not source["fast_tier"]:
        raise ValueError(
            f"check_resume(how='wipe-node'): the config {source['config']} has no "
            "MegatronCheckpoint with a fast_tier, so there is no fast step to resume from a "
            "peer's copy; give its MegatronCheckpoint init_args a fast_tier (class_path: "
            "lightning_mcore_ckpt.FastTier, init_args: {dir: ..., every_n_train_steps: ..., "
            "replicas: 1}), or drop 'wipe-node' from --how"
        )
    if nodes > 1:
        why = nodes_unavailable()
        if why is not None:
            raise ValueError(f"check_resume(nodes={nodes}): simulated nodes cannot run here: {why}")


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
    root = Path(workdir).absolute()
    if root.exists() and any(root.iterdir()):
        raise ValueError(
            f"check_resume(workdir={str(workdir)!r}): the directory is not empty; pass a new "
            "or empty directory"
        )
    root.mkdir(parents=True, exist_ok=True)
    return root


class _Runs:
    """Launches the job's runs of one check; a run that fails to run ends the check."""

    def __init__(
        self,
        source: Any,
        report: ResumeReport,
        timeout: float,
        needs_fast_tier: bool,
        log_file: str | None,
    ) -> None:
        self.source, self.report, self.timeout = source, report, timeout
        self.needs_fast_tier, self.log_file = needs_fast_tier, log_file

    def place(self, base: Path) -> Placement:
        """Where the runs under ``base`` (an interrupted run and its resume) keep checkpoints:
        ``<base>/checkpoints``, shared by the nodes, and ``<base>/node_local/fast``, on each
        node's own directory."""
        return Placement(
            ckpt_dir=base / "checkpoints",
            fast_dir=base / "node_local" / "fast",
            nodes=self.report.nodes,
            needs_fast_tier=self.needs_fast_tier,
        )

    def launch(self, run_dir: Path, ckpt: str | None, way: str | None, run: str) -> Any:
        """Run the job once (``way``: interrupted so; ``ckpt``: resumed from it) and read what
        its probe recorded: (timelines, finals, the step it resumed from)."""
        report = self.report
        steps = report.stop_at if way == "max_steps" else report.max_steps
        failed = _launch(
            self.source,
            report.world_size,
            run_dir,
            self.place(run_dir.parent),
            steps,
            ckpt,
            way,
            report.stop_at,
            self.timeout,
            self.log_file,
        )
        if failed is not None:
            wrong = misfit(run_dir / "probe")
            if wrong is not None:  # a bad argument for this job, not an error of the job
                raise ValueError(wrong) from None
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


def _wipe(place: Placement, node: int) -> None:
    """Empty node ``node``'s own directory, as a replaced node's disk."""
    from lightning_mcore_ckpt.launch.nodes import node_storage

    own = node_storage(place.fast_dir.parent, node)
    for path in own.iterdir() if own.is_dir() else ():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    log.info("resume check: node %d's directory %s emptied (a replaced node)", node, own)


def _recoveries(base: Path) -> list[dict[str, Any]]:
    """The fast tier's recovery records in the persistent directory of the runs under
    ``base``, oldest first (none: the job has no fast tier, or nothing resumed)."""
    path = base / "checkpoints" / RECORDS
    if not path.is_file():
        return []
    found = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("kind") == "recovery":
            found.append(record)
    return found


def _unproven(result: InterruptionResult) -> str | None:
    """Why a ``"wipe-node"`` resume does not prove a resume from the fast tier's peer copies."""
    found = result.recovery
    if found is None:
        return (
            "the resumed run recorded no recovery of the fast tier (no record in "
            f"{RECORDS}), so it proves nothing about the fast tier"
        )
    skipped = "; ".join(str(s) for s in found.get("skipped") or [])
    said = f" The fast tier said: {skipped}." if skipped else ""
    if found.get("tier") != "fast":
        return (
            "it resumed from the persistent tier, not the fast tier, so it proves nothing "
            f"about the fast tier.{said} Keep a copy of each rank's files on a peer node "
            "(FastTier(replicas=1) or more), and stop after a fast step newer than the "
            "persistent tier's last step (a step both tiers save is the persistent tier's)"
        )
    if not found.get("ranks_from_peers"):
        return (
            f"it resumed from fast step {found.get('step')} with no rank reading a peer node's "
            f"copy, although node {WIPED_NODE}'s directory was emptied, so it proves nothing "
            "about the peers' copies"
        )
    return None
