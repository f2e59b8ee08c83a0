"""``lightning-mcore-ckpt report`` and ``ls``: a run's steps, read from their ``metadata.json``
(no checkpoint data is loaded): what every save cost (``report``), what each step holds (``ls``).
With a fast tier, ``report`` also lists its saves and the recoveries, from the records rank 0
appends to ``<dirpath>/fast_tier.jsonl``."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.cli.failure import fail
from lightning_mcore_ckpt.format import layout, markers

__all__ = [
    "FastTierRecords",
    "Report",
    "add_parsers",
    "collect",
    "fast_tier_records",
    "format_fast_tier",
    "format_table",
    "human_bytes",
    "plot",
]

FAST_TIER_RECORDS = "fast_tier.jsonl"
"""The fast tier's record of its saves and recoveries in a run's directory (written by rank 0:
``callback/fast_tier.py``)."""

_LAYOUT_KEYS = (
    ("tp", "tensor_model_parallel_size"),
    ("pp", "pipeline_model_parallel_size"),
    ("cp", "context_parallel_size"),
    ("ep", "expert_model_parallel_size"),
    ("dp", "data_parallel_size"),
)


@dataclass
class Report:
    """The steps of one checkpoint directory."""

    dirpath: Path
    complete: list[dict[str, Any]]
    """``metadata.json`` of every complete step, oldest first."""
    incomplete: list[layout.StepDir]
    """Step directories that never committed (crashed, or still being written)."""
    last: int | None
    """The step ``ckpt_path="last"`` resumes from."""
    damaged: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    """Complete steps with missing or truncated files, and what is wrong with each."""
    fast: FastTierRecords | None = None
    """The fast tier's saves and recoveries (``None``: the run has no ``fast_tier.jsonl``)."""

    @property
    def holds_run(self) -> bool:
        """Whether ``dirpath`` holds a run: a step directory (committed or not), the tracker,
        or the fast tier's record. A step directory, an export or ``/tmp`` holds none."""
        tracker = (self.dirpath / layout.TRACKER_FILE).is_file()
        return bool(self.complete or self.incomplete or tracker or self.fast is not None)


@dataclass
class FastTierRecords:
    """The lines of a run's ``fast_tier.jsonl``, in the order they were written.

    Example::

        fast = collect("checkpoints/run").fast  # None without a fast tier
        served = [(r["tier"], r["step"], r["ranks_from_peers"]) for r in fast.recoveries]
    """

    saves: list[dict[str, Any]]
    """``{"kind": "fast_save", ...}``: each fast save, complete or not."""
    recoveries: list[dict[str, Any]]
    """``{"kind": "recovery", ...}``: each ``ckpt_path="last"`` resume, and what served it."""
    malformed: list[int] = dataclasses.field(default_factory=list)
    """The numbers (from 1) of the lines that are not such a record, and were skipped."""


def fast_tier_records(dirpath: str | os.PathLike[str]) -> FastTierRecords | None:
    """The fast tier's records in ``dirpath`` (``None``: it has none). A line that is not a
    record (torn by a crash, edited) is skipped and its number kept in ``malformed``.

    Example::

        fast = fast_tier_records("checkpoints/run")
        failed = [s["step"] for s in fast.saves if not s["complete"]] if fast else []
    """
    try:
        text = (Path(dirpath) / FAST_TIER_RECORDS).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None
    out = FastTierRecords(saves=[], recoveries=[])
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            out.malformed.append(number)
        elif record.get("kind") == "fast_save" and _is_step(record.get("step")):
            out.saves.append(record)
        elif record.get("kind") == "recovery":
            out.recoveries.append(record)
        else:
            out.malformed.append(number)
    return out


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def collect(dirpath: str | os.PathLike[str]) -> Report:
    """Read the steps of ``dirpath`` (no checkpoint data is loaded).

    Example::

        result = collect("checkpoints/run")
        steps = [m["global_step"] for m in result.complete]  # and result.last, .damaged
    """
    root = Path(dirpath)
    if not root.is_dir():
        raise FileNotFoundError(
            f"{str(dirpath)!r} is not a directory; pass the dirpath of a "
            "MegatronCheckpoint (the directory holding the global_step_<N> directories)"
        )
    complete = []
    damaged = {}
    for step in layout.complete_steps(root):
        metadata = markers.read_metadata(step.path) or {}
        metadata.setdefault("global_step", step.step)
        complete.append(metadata)
        problems = layout.verify_step(step.path)
        if problems:
            damaged[step.step] = problems
    last = layout.resolve_last(root)
    return Report(
        dirpath=root,
        complete=complete,
        incomplete=layout.incomplete_steps(root),
        last=None if last is None else layout.step_number(last),
        damaged=damaged,
        fast=fast_tier_records(root),
    )


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def _binary_unit(num: float) -> tuple[float, str]:
    """The largest unit of :data:`_UNITS` that ``num`` bytes fill at least once, and its size."""
    power = 0
    while power < len(_UNITS) - 1 and num >= 1024 ** (power + 1):
        power += 1
    return float(1024**power), _UNITS[power]


def human_bytes(num: Any) -> str:
    """``num`` bytes for people, in the unit that fits: "512 B", "356.9 KiB", "1.3 MiB".

    Example::

        human_bytes(1_368_453)  # "1.3 MiB"
    """
    if not isinstance(num, int | float) or isinstance(num, bool):
        return "-"
    scale, unit = _binary_unit(float(num))
    return f"{num / scale:.0f} {unit}" if unit == "B" else f"{num / scale:.1f} {unit}"


def _seconds(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, int | float) else "-"


def _gbps(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, int | float) else "-"


def _saved_at(value: Any) -> str:
    try:
        when = datetime.datetime.fromisoformat(str(value))
    except ValueError:
        return "-"
    return when.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _layout(value: Any) -> str:
    if not isinstance(value, Mapping):
        return "-"
    return " ".join(f"{short}{value[key]}" for short, key in _LAYOUT_KEYS if key in value)


_VERSION_NAMES = (
    ("megatron_core", "megatron-core"),
    ("torch", "torch"),
    ("transformers", "transformers"),
    ("mbridge", "mbridge"),
    ("lightning", "lightning"),
    ("lightning_mcore_ckpt", "lightning-mcore-ckpt"),
)


def written_by(meta: Mapping[str, Any]) -> str:
    """The versions (and checkpoint writer) that wrote a step, from its metadata; ``""`` if unknown.

    Example::

        written_by({"versions": {"megatron_core": "0.19.2", "torch": "2.13.0"}})
        # -> "megatron-core 0.19.2, torch 2.13.0"
    """
    versions = meta.get("versions")
    if not isinstance(versions, Mapping):
        return ""
    text = ", ".join(f"{name} {versions[key]}" for key, name in _VERSION_NAMES if key in versions)
    writer = meta.get("writer")
    return f"{text} (writer: {writer})" if writer else text


def format_table(report: Report) -> str:
    """The report as a plain-text table, then the incomplete steps.

    Example::

        table = format_table(collect("checkpoints/run"))
    """
    header = (
        "step",
        "saved at (UTC)",
        "contents",
        "size",
        "blocking s",
        "total s",
        "GB/s",
        "mode",
        "parallel layout",
    )
    rows: list[Sequence[str]] = []
    for meta in report.complete:
        step = meta.get("global_step")
        mark = "*" if step == report.last else ""
        rows.append(
            (
                f"{step}{mark}",
                _saved_at(meta.get("saved_at")),
                ",".join(meta.get("contents") or []) or "-",
                human_bytes(meta.get("size_bytes")),
                _seconds(meta.get("blocking_time_s")),
                _seconds(meta.get("total_time_s")),
                _gbps(meta.get("throughput_gbps")),
                "async" if meta.get("async") else "sync",
                _layout(meta.get("parallel_layout")),
            )
        )
    lines = [f"{report.dirpath}: {len(report.complete)} complete step(s)"]
    if rows:
        lines.extend(_table(header, rows, numeric={0, 3, 4, 5, 6}))
        if report.last is not None:
            lines.append('* "last": what trainer.fit(ckpt_path="last") resumes from')
        by: dict[str, list[str]] = {}
        for meta in report.complete:
            text = written_by(meta)
            if text:
                by.setdefault(text, []).append(str(meta.get("global_step")))
        for text, steps in by.items():
            which = "every step" if len(by) == 1 else f"step(s) {', '.join(steps)}"
            lines.append(f"{which} written by {text}")
    for step, problems in sorted(report.damaged.items()):
        lines.append(
            f'DAMAGED {layout.step_name(step)} (skipped by "last"): {"; ".join(problems[:3])}'
        )
    if report.incomplete:
        names = ", ".join(s.path.name for s in report.incomplete)
        lines.append(f"incomplete (never committed, not resumable): {names}")
    if report.fast is not None:
        lines.append("")
        lines.extend(format_fast_tier(report.fast))
    return "\n".join(lines)


def _table(header: Sequence[str], rows: list[Sequence[str]], numeric: set[int]) -> list[str]:
    """A header, a rule and the rows, in columns (``numeric`` ones right-aligned)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        cells = [
            cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        return "  ".join(cells).rstrip()

    return [fmt(header), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)]


def _median(saves: list[dict[str, Any]], key: str) -> str:
    values = [s[key] for s in saves if isinstance(s.get(key), int | float)]
    return _seconds(statistics.median(values)) if values else "-"


def format_fast_tier(fast: FastTierRecords) -> list[str]:
    """The fast tier's section of the report: a summary, its saves, its recoveries.

    Example::

        print("\n".join(format_fast_tier(fast_tier_records("checkpoints/run"))))
    """
    complete = [s for s in fast.saves if s.get("complete") is True]
    failed = len(fast.saves) - len(complete)
    lines = [
        f"fast tier ({FAST_TIER_RECORDS}): {len(fast.saves)} fast save(s), {failed} failed; "
        f"median of the complete ones: blocking {_median(complete, 'fast_blocking_time_s')} s, "
        f"total {_median(complete, 'fast_total_time_s')} s, "
        f"replication {_median(complete, 'fast_replication_time_s')} s"
    ]
    if fast.saves:
        lines.extend(_fast_saves(fast.saves))
    lines.append(f'{len(fast.recoveries)} recovery(ies) with ckpt_path="last"')
    if fast.recoveries:
        lines.extend(_recoveries(fast.recoveries))
    if fast.malformed:
        numbers = ", ".join(str(n) for n in fast.malformed)
        lines.append(
            f"skipped {len(fast.malformed)} malformed line(s) of {FAST_TIER_RECORDS}: {numbers}"
        )
    return lines


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _fast_saves(saves: list[dict[str, Any]]) -> list[str]:
    # The outcome is last on the line: an error's text is long.
    header = ("step", "blocking s", "total s", "write s", "replication s", "size", "outcome")
    rows: list[Sequence[str]] = []
    for save in saves:
        errors = _list(save.get("errors"))
        if save.get("complete") is True:
            outcome = "complete"
        else:
            outcome = f"FAILED: {errors[0]}" if errors else "FAILED"
        rows.append(
            (
                str(save["step"]),
                _seconds(save.get("fast_blocking_time_s")),
                _seconds(save.get("fast_total_time_s")),
                _seconds(save.get("fast_write_time_s")),
                _seconds(save.get("fast_replication_time_s")),
                human_bytes(save.get("fast_size_bytes")),
                outcome,
            )
        )
    return _table(header, rows, numeric={0, 1, 2, 3, 4, 5})


def _recoveries(recoveries: list[dict[str, Any]]) -> list[str]:
    header = ("tier", "step", "ranks from peers", "time s", "skipped")
    rows: list[Sequence[str]] = []
    for found in recoveries:
        tier = str(found.get("tier") or "-")
        if tier == "fast":
            step = found.get("step")
            peers = f"{found.get('ranks_from_peers', '-')} of {found.get('ranks', '-')}"
        else:  # the persistent tier's step, or none: from scratch
            step = found.get("persistent_step")
            peers = "-"
        rows.append(
            (
                tier,
                "-" if step is None else str(step),
                peers,
                _seconds(found.get("time_s")),
                "; ".join(str(s) for s in _list(found.get("skipped"))) or "-",
            )
        )
    return _table(header, rows, numeric={1, 2, 3})


def plot(report: Report, out: str | os.PathLike[str]) -> None:
    """Draw save time (blocking, total) and size against step into ``out`` (e.g. a PNG).

    Example::

        plot(collect("checkpoints/run"), "saves.png")
    """
    try:
        import matplotlib
    except ImportError as err:
        raise RuntimeError(
            "report --plot needs matplotlib: pip install 'lightning-mcore-ckpt[plot]'"
        ) from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not report.complete:
        raise ValueError(f"report --plot: no complete step in {report.dirpath} to plot")
    steps = [m["global_step"] for m in report.complete]

    def series(key: str) -> list[float]:
        return [float(m.get(key) or float("nan")) for m in report.complete]

    sizes = series("size_bytes")
    biggest = max((x for x in sizes if x == x), default=0.0)
    scale, unit = _binary_unit(biggest)  # as the table's sizes (human_bytes)
    fig, (time_ax, size_ax) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    try:
        time_ax.plot(steps, series("total_time_s"), marker="o", label="total (until committed)")
        time_ax.plot(steps, series("blocking_time_s"), marker="o", label="training blocked")
        time_ax.set_ylabel("save time (s)")
        time_ax.set_ylim(bottom=0)
        time_ax.legend()
        time_ax.grid(alpha=0.3)
        size_ax.plot(steps, [x / scale for x in sizes], marker="o", color="C2")
        size_ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        size_ax.set_ylim(0, (biggest / scale) * 1.15 or 1.0)
        size_ax.set_ylabel(f"size ({unit})")
        size_ax.set_xlabel("global step")
        size_ax.xaxis.get_major_locator().set_params(integer=True)
        size_ax.grid(alpha=0.3)
        fig.suptitle(f"checkpoints in {report.dirpath.name or report.dirpath}")
        fig.tight_layout()
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)


def add_parsers(commands: Any) -> None:
    """Add ``report`` and ``ls`` to the command line's subparsers."""
    report = commands.add_parser(
        "report",
        help="list a run's checkpoints: size, save times, throughput, parallel layout",
        description=(
            "Print a table of the complete steps of a MegatronCheckpoint directory (step, time "
            "of save, contents, size, training-blocked and total save time, throughput, "
            "parallel layout), then the steps that never committed. With a fast tier "
            "(fast_tier.jsonl in the directory): its saves (times, size, failures) and every "
            "recovery (the tier and step resumed, the ranks read from a peer, what was skipped)."
        ),
    )
    report.add_argument("dirpath", help="the MegatronCheckpoint dirpath (holds global_step_<N>/)")
    report.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw save time and size against step into this image (needs matplotlib)",
    )
    report.set_defaults(handler=_report)

    ls = commands.add_parser(
        "ls",
        help="list a run's complete steps and what each contains",
        description="List the complete steps of a MegatronCheckpoint directory, what each "
        "contains (model, optimizer, extra, huggingface) and its size, then incomplete steps.",
    )
    ls.add_argument("dirpath", help="the MegatronCheckpoint dirpath (holds global_step_<N>/)")
    ls.set_defaults(handler=_ls)


def _report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.plot is not None and not Path(args.plot).expanduser().parent.is_dir():
        parser.error(f"--plot {args.plot}: the directory {Path(args.plot).parent} does not exist")
    result = _collect_run("report", args, parser)
    if isinstance(result, int):
        return result
    print(format_table(result))
    if args.plot is not None:
        try:
            plot(result, Path(args.plot).expanduser())
        except (RuntimeError, ValueError) as err:
            return fail(err, code=1)
        print(f"plot written to {args.plot}")
    return 0


def _ls(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    result = _collect_run("ls", args, parser)
    if isinstance(result, int):
        return result
    print(f"{result.dirpath}: {len(result.complete)} complete step(s)")
    for meta in result.complete:
        step = meta["global_step"]
        path = layout.step_dir(result.dirpath, step)
        contents = [c for c in meta.get("contents") or [] if c != "hf_model"]
        if layout.is_exported(path):
            contents.append("huggingface")
        mark = "  (last)" if step == result.last else ""
        size = human_bytes(meta.get("size_bytes"))
        print(f"  {layout.step_name(step)}  {size:>10}  {', '.join(contents)}{mark}")
        if written_by(meta):
            print(f"      written by {written_by(meta)}")
    for step, problems in sorted(result.damaged.items()):
        print(f"  {layout.step_name(step)}  DAMAGED: {'; '.join(problems[:3])}")
    for stale in result.incomplete:
        print(f"  {stale.path.name}  incomplete (never committed)")
    return 0


def _collect_run(
    command: str, args: argparse.Namespace, parser: argparse.ArgumentParser
) -> Report | int:
    """The run at ``args.dirpath``, or the exit code of ``command``'s error (named for it): a
    path that is not a directory, or a directory that holds no run."""
    given = getattr(args, "given", {}).get("dirpath") or args.dirpath  # a URL, not its view
    try:
        result = collect(args.dirpath)
    except FileNotFoundError as err:
        parser.error(f"{command}: {err}")
    if result.holds_run:
        return result
    return fail(
        f"{command}: {given} holds no run: no global_step_<N> directory (committed or not), no "
        f"{layout.TRACKER_FILE} and no {FAST_TIER_RECORDS}. Pass the dirpath of a "
        f"MegatronCheckpoint{_what_it_is(result.dirpath)}"
    )


def _what_it_is(path: Path) -> str:
    """A hint for a directory that holds no run, from what it does hold."""
    step = layout.step_number(path) is not None or (path / "metadata.json").is_file()
    if step or any((path / d).is_dir() for d in (layout.MODEL_DIR, layout.OPTIM_DIR)):
        return (
            f"; this looks like one step: its run is the directory above it ({path.parent}); "
            "for one step use `lightning-mcore-ckpt inspect STEP` (will it load) or "
            "`lightning-mcore-ckpt fsck STEP` (is it whole)"
        )
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return (
            "; this looks like a Hugging Face model directory: `lightning-mcore-ckpt import` "
            "makes a step of it, `lightning-mcore-ckpt verify` compares it with a step"
        )
    return " (the directory holding its global_step_<N> directories)"
