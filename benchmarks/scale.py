"""``python -m benchmarks --scale``: the same total state saved and loaded by 2, 4 and 8 ranks.

Every rank runs real Trainer fits of ours (``MegatronStrategy`` + ``MegatronCheckpoint``, gloo,
CPU), one after the other in the same processes: synchronous saves with cached plans
(``ckpt_cache_plans=True``, the default), synchronous saves planned afresh every time
(``ckpt_cache_plans=False``), and asynchronous saves with cached plans (their blocking time).
The state is sharded so that each rank's share shrinks as ranks grow: tensor parallelism over
every rank (``--shard tp``, the default: weights and Adam moments split ``world`` ways, only
the layer norms replicated) or data parallelism (``--shard dp``: every rank holds the whole
state, AdamW, and Megatron-Core's ``FullyParallelSaveStrategyWrapper`` spreads the writes of the
replicas over the ranks: each rank writes about ``1/world`` of the bytes).

Nothing in the library is changed to time it: inside each rank process the benchmark wraps

- ``CheckpointWriter.save`` (a save's wall time on the rank, and the window the figures below
  are counted in);
- ``SavePlans.strategies`` (our check that the kept plans still fit: a fingerprint and one
  all-reduce), Megatron-Core's ``determine_global_metadata`` and ``validate_sharding_integrity``
  (its check that the shards cover every tensor once), ``FullyParallelSaveStrategyWrapper.
  apply_saving_parallelization`` (which rank writes each replicated tensor) and
  ``TorchDistSaveShardedStrategy.async_save`` (the translation to torch DCP and DCP's planning:
  every rank's local plan gathered, the global plan and metadata built, scattered back), and
  ``plan_requests`` around all of them: a save's planning;
- every collective of ``torch.distributed`` the saving thread calls during a save (the
  outermost call only): each call's duration. A collective's duration on a rank is the wait for
  the last rank to arrive plus the collective's own latency; at each collective the rank that
  arrives last waits for nobody. The per-save **coordination** figure is the sum, over the
  save's collectives, of the shortest duration among the ranks (the collectives' own cost on
  the critical path, the skew between ranks excluded), as ``workloads.critical_path`` does for
  the per-step cost.

The planning of one save of rank 0 per synchronous fit (the last) is profiled: a sampler reads
the saving thread's stack every half millisecond; each function's share of the samples with it
on the stack (inclusive) and at the top (self) shows where the planning goes (Megatron-Core's
and torch DCP's functions by name). Not ``cProfile``: on Python 3.12 it sees every thread of
the process on one call stack, and the checkpoint's own threads (commit, lock heartbeat) run
while a save plans, so its figures come out tangled. That save is left out of the medians.

Files per step and metadata bytes per step are counted in the last committed step: shard files
(``*.distcp``), the ranks' ``extra/`` files, and everything else (``.metadata``,
``metadata.json``, ``common.pt``, our markers and records).
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

GiB = 2**30
MiB = 2**20

# The figures are medians over these saves of a fit: the first two are left out (the first
# plans from scratch; with cached plans, Megatron-Core verifies at the second that the plans are
# the same, and reuses them from the third), and the last (profiled).
FIRST_STEADY = 2

# Collectives of torch.distributed a save may call.
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
)

# (figure, the fits it comes from): the modes a scale run measures, in order.
MODES = (("cached", True, False), ("uncached", False, False), ("async", True, True))

# The phases the profile covers: a save's planning.
PROFILED = ("plan_check_s", "planning_mcore_s")

# The targets of issue 37 (item 6).
COORDINATION_GROWTH = 1.2


# --- inside every rank ----------------------------------------------------------------------


class SaveProbe:
    """Per save of this rank: its wall time, its planning phases and its collectives (see the
    module docstring). Installed once per process (:meth:`install`); :meth:`take` hands over the
    saves recorded so far and starts a new list."""

    def __init__(self) -> None:
        self.saves: list[dict[str, Any]] = []
        self.current: dict[str, Any] | None = None
        self.profile_next = False
        self.profile: list[str] | None = None
        self._profiler: Sampler | None = None
        self._phase_code: Any = None
        self._depth = threading.local()
        self._main = threading.main_thread().ident

    # a window per save
    def _recording(self) -> bool:
        return self.current is not None and threading.get_ident() == self._main

    def timed_phase(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        probe = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not probe._recording():
                return fn(*args, **kwargs)
            profiler = probe._profiler if name in PROFILED else None
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                if profiler is not None:
                    profiler.start()
                return fn(*args, **kwargs)
            finally:
                if profiler is not None:
                    profiler.stop()
                current = probe.current
                if current is not None:
                    current[name] = current.get(name, 0.0) + time.perf_counter() - start
                    used = f"{name[:-2]}_cpu_s"
                    current[used] = current.get(used, 0.0) + time.thread_time() - cpu

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        self._phase_code = wrapper.__code__  # where a profile's stacks stop (every phase's)
        return wrapper

    def timed_collective(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        probe = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(probe._depth, "n", 0)
            if depth or not probe._recording():
                return fn(*args, **kwargs)
            probe._depth.n = depth + 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                probe._depth.n = depth
                current = probe.current
                if current is not None:
                    current["collectives"].append((name, time.perf_counter() - start))

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    def timed_save(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        probe = self

        def save(*args: Any, **kwargs: Any) -> Any:
            probe.current = {"collectives": []}
            profiler = probe._profiler = Sampler(probe._phase_code) if probe.profile_next else None
            start, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed, used = time.perf_counter() - start, time.process_time() - cpu
                if profiler is not None:
                    probe.profile = profiler.top()
                    probe.profile_next, probe._profiler = False, None
                record, probe.current = probe.current, None
                record["save_s"] = elapsed
                record["save_cpu_s"] = used
                record["profiled"] = profiler is not None
                probe.saves.append(record)

        save.__wrapped__ = fn  # type: ignore[attr-defined]
        return save

    def take(self) -> list[dict[str, Any]]:
        saves, self.saves = self.saves, []
        return saves

    def install(self) -> None:
        """Wrap the library's and Megatron-Core's functions named in the module docstring, in
        this process only."""
        import torch.distributed as dist
        from megatron.core.dist_checkpointing import state_dict_utils
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper,
        )
        from megatron.core.dist_checkpointing.strategies.torch import (
            TorchDistSaveShardedStrategy,
        )

        from lightning_mcore_ckpt.engine import _plans, _writer

        writer_cls = _writer.CheckpointWriter
        writer_cls.save = self.timed_save(writer_cls.save)  # type: ignore[method-assign]
        plans = _plans.SavePlans
        plans.strategies = self.timed_phase("plan_check_s", plans.strategies)  # type: ignore[method-assign]
        _writer.plan_requests = self.timed_phase("planning_mcore_s", _writer.plan_requests)  # type: ignore[attr-defined]
        for name in ("determine_global_metadata", "validate_sharding_integrity"):
            setattr(
                state_dict_utils,
                name,
                self.timed_phase("validate_s", getattr(state_dict_utils, name)),
            )
        wrapper_cls = FullyParallelSaveStrategyWrapper
        wrapper_cls.apply_saving_parallelization = self.timed_phase(  # type: ignore[method-assign]
            "distribute_s", wrapper_cls.apply_saving_parallelization
        )
        strategy_cls = TorchDistSaveShardedStrategy
        strategy_cls.async_save = self.timed_phase("dcp_plan_s", strategy_cls.async_save)  # type: ignore[method-assign]
        for name in COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, self.timed_collective(name, getattr(dist, name)))


class Sampler:
    """Samples one thread's stack (this one's) every ``interval`` seconds while started, below
    the frames of ``stop_code`` (the phase wrapper): how many samples each function was on the
    stack in (inclusive) and on top of (self)."""

    def __init__(self, stop_code: Any, interval: float = 0.0005) -> None:
        self.stop_code, self.interval = stop_code, interval
        self.ident = threading.get_ident()
        self.samples = 0
        self.seconds = 0.0
        self.inclusive: dict[str, int] = {}
        self.own: dict[str, int] = {}
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0

    def start(self) -> None:
        self._done.clear()
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="scale-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        self.seconds += time.perf_counter() - self._started

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            frame = sys._current_frames().get(self.ident)
            names: list[str] = []
            while frame is not None and frame.f_code is not self.stop_code:
                code = frame.f_code
                if code.co_filename != __file__:  # not the probe's own wrappers
                    names.append(
                        f"{_short(code.co_filename)}:{code.co_firstlineno}({code.co_name})"
                    )
                frame = frame.f_back
            if not names:
                continue
            self.samples += 1
            self.own[names[0]] = self.own.get(names[0], 0) + 1
            for name in set(names):
                self.inclusive[name] = self.inclusive.get(name, 0) + 1

    def top(self, count: int = 25) -> list[str]:
        """The ``count`` functions on the stack the most: inclusive and self share of the
        samples, and the seconds they stand for."""
        total = max(self.samples, 1)
        lines = [
            f"{self.samples} samples over {self.seconds:.3f} s of planning",
            f"{'incl %':>7} {'self %':>7} {'incl s':>8}  function",
        ]
        ranked = sorted(self.inclusive.items(), key=lambda item: -item[1])[:count]
        for name, hits in ranked:
            own = self.own.get(name, 0)
            lines.append(
                f"{100 * hits / total:7.1f} {100 * own / total:7.1f} "
                f"{self.seconds * hits / total:8.3f}  {name}"
            )
        return lines


def _short(filename: str) -> str:
    """A source path from its package on (site-packages and the checkout left out)."""
    checkout = str(Path(__file__).resolve().parents[1]) + "/"
    if "/site-packages/" in filename:
        return filename.rsplit("/site-packages/", 1)[1]
    return re.sub(r"^.*/lib/python3\.\d+/", "", filename).replace(checkout, "")


def _module(hidden: int, layers: int) -> Any:
    from lightning_mcore_ckpt.tiny import TinyGPTModule, tiny_gpt

    class Sized(TinyGPTModule):  # type: ignore[misc]
        def configure_model(self) -> None:
            if self.gpt is None:
                self.gpt = tiny_gpt(
                    hidden_size=hidden,
                    ffn_hidden_size=4 * hidden,
                    num_attention_heads=8,  # divisible by TP = 2, 4, 8
                    num_layers=layers,
                    hidden_dropout=0.0,
                    attention_dropout=0.0,
                )

    return Sized(dropout=0.0)


def _step_files(step: Path) -> dict[str, Any]:
    """Files and bytes of a committed step, by kind (see the module docstring)."""
    shards = extra = meta = 0
    shard_bytes = extra_bytes = meta_bytes = 0
    by_name: dict[str, int] = {}
    for path in sorted(step.rglob("*")):
        if not path.is_file():
            continue
        size = path.stat().st_size
        relative = path.relative_to(step)
        if path.suffix == ".distcp":
            shards, shard_bytes = shards + 1, shard_bytes + size
        elif relative.parts[0] == "extra":
            extra, extra_bytes = extra + 1, extra_bytes + size
        else:
            meta, meta_bytes = meta + 1, meta_bytes + size
            by_name[str(relative)] = size
    return {
        "files": shards + extra + meta,
        "shard_files": shards,
        "shard_bytes": shard_bytes,
        "extra_files": extra,
        "extra_bytes": extra_bytes,
        "metadata_files": meta,
        "metadata_bytes": meta_bytes,
        "metadata_by_name": by_name,
    }


def _loads(trainer: Any, last: Path, repeats: int) -> list[float]:
    """This rank's cold loads of ``last`` into the live model and optimizer (s), all ranks
    starting together."""
    import torch.distributed as dist

    from benchmarks.workloads import drop_cache

    seconds = []
    for _ in range(repeats):
        if dist.get_rank() == 0:
            drop_cache(last)
        dist.barrier()
        start = time.perf_counter()
        trainer.strategy.load_checkpoint(last)
        seconds.append(time.perf_counter() - start)
    return seconds


def collective_latency(repeats: int = 50) -> float:
    """Median seconds of an all-reduce of one number among every rank (gloo on loopback)."""
    import torch.distributed as dist

    one = torch.ones(1)
    times = []
    dist.barrier()
    for _ in range(repeats):
        start = time.perf_counter()
        dist.all_reduce(one)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _around_class() -> type:
    import lightning.pytorch as pl

    from benchmarks import workloads
    from lightning_mcore_ckpt.format import layout

    class Around(pl.Callback):  # type: ignore[misc]
        """Profiles rank 0's last save of a synchronous fit; at the end of the fit, the state's
        bytes on this rank and (``cached`` fit) the loads of the last step."""

        def __init__(
            self,
            probe: SaveProbe,
            rank: int,
            mode: str,
            async_save: bool,
            last_step: int,
            dirpath: Path,
            cfg: dict[str, Any],
        ) -> None:
            self.probe, self.rank, self.mode, self.async_save = probe, rank, mode, async_save
            self.last_step, self.dirpath, self.cfg = last_step, dirpath, cfg
            self.figures: dict[str, Any] = {}

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if self.rank == 0 and not self.async_save and trainer.global_step + 1 == self.last_step:
                self.probe.profile_next = True

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            trainer.strategy.finalize_pending_save(blocking=True)
            state = workloads.state_tensors(pl_module, trainer.strategy._torch_optimizers())
            self.figures["state_bytes"] = workloads.nbytes(state)
            if self.mode == "cached":
                last = layout.resolve_last(self.dirpath, verify=False)
                assert last is not None, f"no committed step in {self.dirpath}"
                self.figures["load_s"] = _loads(trainer, last, self.cfg["repeats"])

    return Around


def scale_saves(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of a scale run at ``world`` ranks: every mode of :data:`MODES`, in turn.

    ``cfg``: ``hidden``, ``layers``, ``shard`` (``"tp"`` or ``"dp"``), ``saves``, ``every``,
    ``repeats`` (loads), ``dir``. Returns this rank's figures; rank 0's also hold the steps'
    metadata records, files and the profiles."""
    import torch.distributed as dist

    from benchmarks import workloads
    from lightning_mcore_ckpt import MegatronCheckpoint
    from lightning_mcore_ckpt.format import layout, markers

    probe = SaveProbe()
    probe.install()
    tp = world if cfg["shard"] == "tp" else 1
    out: dict[str, Any] = {"rank": rank, "modes": {}}
    saves, every = cfg["saves"], cfg["every"]
    root = Path(cfg["dir"])
    for mode, cache_plans, async_save in MODES:
        dirpath = root / mode
        around = _around_class()(probe, rank, mode, async_save, saves * every, dirpath, cfg)
        callbacks: list[Any] = [around]
        if async_save:
            callbacks.append(workloads._saves_apart_class()(every))
        callbacks.append(MegatronCheckpoint(dirpath, every_n_train_steps=every, save_last=False))
        module = _module(cfg["hidden"], cfg["layers"])
        trainer = workloads._trainer(
            saves * every,
            tp,
            world,
            callbacks,
            async_save,
            "cpu",
            ckpt_cache_plans=cache_plans,
        )
        trainer.fit(module, train_dataloaders=workloads._loader())
        figures = {**around.figures, "saves": probe.take()}
        if rank == 0:
            steps = sorted(layout.complete_steps(dirpath), key=lambda s: s.step)
            records = [markers.read_metadata(s.path) or {} for s in steps]
            figures["records"] = [
                {k: m.get(k) for k in ("global_step", "total_time_s", "blocking_time_s")}
                | {"size_bytes": m.get("size_bytes")}
                for m in records
            ]
            figures["step_files"] = _step_files(steps[-1].path)
            if probe.profile is not None:
                figures["profile"] = probe.profile
                probe.profile = None
        out["modes"][mode] = figures
        workloads._clean(rank, dirpath)
        dist.barrier()
    out["collective_latency_s"] = collective_latency()
    return out


# --- in the process that starts the ranks ----------------------------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _steady(saves: list[dict[str, Any]]) -> list[int]:
    """Indices of the saves the medians are taken over (see :data:`FIRST_STEADY`)."""
    indices = [i for i, s in enumerate(saves) if not s.get("profiled")]
    return indices[FIRST_STEADY:] or indices[-1:]


def critical_path(per_rank: list[list[tuple[str, float]]]) -> tuple[float, bool]:
    """A save's coordination cost from every rank's collectives (name, seconds) in call order:
    the sum over the collectives of the shortest duration among the ranks, and ``True``; when
    the ranks' sequences differ (they should not: collectives are called by every rank in the
    same order), the smallest rank total, and ``False``."""
    names = [[name for name, _ in calls] for calls in per_rank]
    if all(n == names[0] for n in names):
        count = len(names[0])
        return sum(min(calls[i][1] for calls in per_rank) for i in range(count)), True
    return min(sum(s for _, s in calls) for calls in per_rank), False


def summarise(world: int, ranks: list[dict[str, Any]], shard: str) -> dict[str, Any]:
    """One row of the scale table from every rank's :func:`scale_saves` figures."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    zero = ranks[0]
    row: dict[str, Any] = {
        "world": world,
        "shard": shard,
        "collective_latency_s": max(r["collective_latency_s"] for r in ranks),
    }
    for mode, _, async_save in MODES:
        if mode not in zero["modes"]:
            continue
        first = zero["modes"][mode]
        steady = _steady(first["saves"])
        figure: dict[str, Any] = {"saves_measured": len(steady)}
        records = first.get("records", [])
        # The committed steps' own figures (slowest rank), the steady saves' ones.
        figure["save_s"] = _median([records[i]["total_time_s"] for i in steady if i < len(records)])
        figure["blocking_s"] = _median(
            [records[i]["blocking_time_s"] for i in steady if i < len(records)]
        )
        if not async_save:
            per_save = [[r["modes"][mode]["saves"][i] for r in ranks] for i in steady]
            paths = [critical_path([s["collectives"] for s in save]) for save in per_save]
            figure["coordination_s"] = _median([p[0] for p in paths])
            figure["coordination_aligned"] = all(p[1] for p in paths)
            figure["collective_s_slowest"] = _median(
                [max(sum(t for _, t in s["collectives"]) for s in save) for save in per_save]
            )
            figure["collective_calls"] = _median(
                [float(len(save[0]["collectives"])) for save in per_save]
            )
            for phase in (
                "plan_check_s",
                "planning_mcore_s",
                "validate_s",
                "distribute_s",
                "dcp_plan_s",
            ):
                figure[phase] = _median([max(s.get(phase, 0.0) for s in save) for save in per_save])
            for out, parts in (
                ("planning_s", ("plan_check_s", "planning_mcore_s")),
                ("planning_cpu_s", ("plan_check_cpu_s", "planning_mcore_cpu_s")),
                ("save_cpu_s", ("save_cpu_s",)),
            ):
                measured = all(parts[-1] in s for save in per_save for s in save)
                figure[out] = (
                    _median(
                        [max(sum(s.get(p, 0.0) for p in parts) for s in save) for save in per_save]
                    )
                    if measured
                    else None  # not measured (results of an earlier version)
                )
            latency = row["collective_latency_s"]
            if figure["coordination_s"] is not None and latency > 0:
                figure["coordination_in_latencies"] = figure["coordination_s"] / latency
            figure["first_save_s"] = records[0]["total_time_s"] if records else None
            figure["profile"] = first.get("profile")
        if "load_s" in first:
            loads = [r["modes"][mode]["load_s"] for r in ranks]
            figure["load_s"] = _median([max(times) for times in zip(*loads, strict=True)])
        figure["step_files"] = first.get("step_files")
        figure["state_bytes_per_rank"] = max(r["modes"][mode].get("state_bytes", 0) for r in ranks)
        figure["step_bytes"] = records[-1]["size_bytes"] if records else None
        row[mode] = figure
    cached = row.get("cached", {})
    step_bytes = cached.get("step_bytes")
    if step_bytes:
        # What each rank writes: the step's bytes over the ranks (TP: each its own shards;
        # DP: each its share of the replicas).
        row["bytes_per_rank"] = step_bytes / world
    return row


def _get(row: dict[str, Any], path: str) -> float | None:
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return None if value is None else float(value)


def _ratio(rows: list[dict[str, Any]], path: str) -> float | None:
    """The figure at the most ranks over the figure at the fewest (``None`` when missing)."""
    if len(rows) < 2:
        return None
    low, high = _get(rows[0], path), _get(rows[-1], path)
    if low is None or high is None or low <= 0:
        return None
    return high / low


def targets(rows: list[dict[str, Any]]) -> list[tuple[str, bool, str]]:
    """Issue 37's targets, judged from the fewest to the most ranks: (name, met, the figures).
    A target whose figures are missing is missed (not measured)."""
    rows = sorted(rows, key=lambda r: r["world"])
    if len(rows) < 2:
        return [("scale targets", False, "need two or more rank counts")]
    low, high = rows[0]["world"], rows[-1]["world"]
    checks = []
    name = f"coordination per save, cached plans: {high} ranks <= {COORDINATION_GROWTH} x {low}"
    growth = _ratio(rows, "cached.coordination_s")
    if growth is None:
        checks.append((name, False, "not measured"))
    else:
        first, last = (
            _get(rows[0], "cached.coordination_s"),
            _get(rows[-1], "cached.coordination_s"),
        )
        checks.append(
            (name, growth <= COORDINATION_GROWTH, f"{first:.4f} s -> {last:.4f} s: {growth:.2f} x")
        )
    shrink = _ratio(rows, "bytes_per_rank")
    for mode in ("cached", "uncached"):
        name = f"time per save ({mode} plans) grows no faster than bytes per rank shrink"
        grows = _ratio(rows, f"{mode}.save_s")
        if grows is None or shrink is None:
            checks.append((name, False, "not measured"))
            continue
        checks.append(
            (
                name,
                grows <= 1 / shrink,
                f"save time x {grows:.2f}, bytes per rank / {1 / shrink:.2f}",
            )
        )
    return checks


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(data: dict[str, Any]) -> str:
    """The scale run's Markdown: the rows side by side, their ratios to the fewest ranks, the
    targets and the profiles."""
    rows = sorted(data["rows"], key=lambda r: r["world"])
    lines = [
        f"## Scale: {', '.join(str(r['world']) for r in rows)} ranks "
        f"(state {data['size']}, {data['shard'].upper()} over every rank, gloo on CPU, "
        f"{data['machine']['cpus']} cores)",
        "",
    ]
    if data.get("oversubscribed"):
        lines += [
            f"{data['oversubscribed']} ranks share {data['machine']['cpus']} cores "
            "(oversubscribed): figures at more ranks than cores include waiting for a core.",
            "",
        ]
    columns = [
        (
            "bytes/rank MiB",
            lambda r: _fmt(_get(r, "bytes_per_rank") and r["bytes_per_rank"] / MiB, 0),
        ),
        ("save s (cached)", lambda r: _fmt(_get(r, "cached.save_s"))),
        ("save s (uncached)", lambda r: _fmt(_get(r, "uncached.save_s"))),
        ("async blocking s", lambda r: _fmt(_get(r, "async.blocking_s"))),
        ("async save s", lambda r: _fmt(_get(r, "async.save_s"))),
        ("load s", lambda r: _fmt(_get(r, "cached.load_s"))),
        ("planning s (cached)", lambda r: _fmt(_get(r, "cached.planning_s"))),
        ("planning s (uncached)", lambda r: _fmt(_get(r, "uncached.planning_s"))),
        ("planning CPU s (cached)", lambda r: _fmt(_get(r, "cached.planning_cpu_s"))),
        ("planning CPU s (uncached)", lambda r: _fmt(_get(r, "uncached.planning_cpu_s"))),
        ("save CPU s, all threads (cached)", lambda r: _fmt(_get(r, "cached.save_cpu_s"))),
        ("coordination s (cached)", lambda r: _fmt(_get(r, "cached.coordination_s"), 4)),
        ("coordination s (uncached)", lambda r: _fmt(_get(r, "uncached.coordination_s"), 4)),
        ("collectives/save (cached)", lambda r: _fmt(_get(r, "cached.collective_calls"), 0)),
        ("collectives/save (uncached)", lambda r: _fmt(_get(r, "uncached.collective_calls"), 0)),
        (
            "collective s, slowest rank (cached)",
            lambda r: _fmt(_get(r, "cached.collective_s_slowest")),
        ),
        ("all-reduce latency ms", lambda r: _fmt((_get(r, "collective_latency_s") or 0) * 1e3, 2)),
        (
            "coordination / all-reduce latency (cached)",
            lambda r: _fmt(_get(r, "cached.coordination_in_latencies"), 1),
        ),
        ("files/step", lambda r: _fmt(_get(r, "cached.step_files.files"), 0)),
        (
            "metadata KiB/step",
            lambda r: _fmt((_get(r, "cached.step_files.metadata_bytes") or 0) / 1024, 1),
        ),
        (
            "extra/ KiB/step",
            lambda r: _fmt((_get(r, "cached.step_files.extra_bytes") or 0) / 1024, 1),
        ),
    ]
    lines.append("| | " + " | ".join(f"{r['world']} ranks" for r in rows) + " | ratio |")
    lines.append("|---|" + "---:|" * (len(rows) + 1))
    ratio_paths = {
        "bytes/rank MiB": "bytes_per_rank",
        "save s (cached)": "cached.save_s",
        "save s (uncached)": "uncached.save_s",
        "async blocking s": "async.blocking_s",
        "async save s": "async.save_s",
        "load s": "cached.load_s",
        "planning s (cached)": "cached.planning_s",
        "planning s (uncached)": "uncached.planning_s",
        "planning CPU s (cached)": "cached.planning_cpu_s",
        "planning CPU s (uncached)": "uncached.planning_cpu_s",
        "save CPU s, all threads (cached)": "cached.save_cpu_s",
        "coordination s (cached)": "cached.coordination_s",
        "coordination s (uncached)": "uncached.coordination_s",
        "collectives/save (cached)": "cached.collective_calls",
        "collectives/save (uncached)": "uncached.collective_calls",
        "collective s, slowest rank (cached)": "cached.collective_s_slowest",
        "all-reduce latency ms": "collective_latency_s",
        "coordination / all-reduce latency (cached)": "cached.coordination_in_latencies",
        "files/step": "cached.step_files.files",
        "metadata KiB/step": "cached.step_files.metadata_bytes",
        "extra/ KiB/step": "cached.step_files.extra_bytes",
    }
    for name, cell in columns:
        ratio = _ratio(rows, ratio_paths[name])
        lines.append(
            f"| {name} | "
            + " | ".join(cell(r) for r in rows)
            + f" | {_fmt(ratio, 2)}{' x' if ratio else ''} |"
        )
    lines += [
        "",
        f"Ratio: the figure at {rows[-1]['world']} ranks over the figure at {rows[0]['world']}. "
        "Medians of the steady saves of each fit (the first two and the profiled last left out).",
        "Save, blocking and load: the slowest rank's. Planning: our plan check and "
        "`dist_checkpointing.save` up to its request, slowest rank; its CPU s: the saving "
        "thread's CPU time (no wait for a core in it). Save CPU s: the rank's process, every "
        "thread. Coordination: per save, the sum over its collectives of the shortest duration "
        "among the ranks (their latency on the critical path, the ranks' skew excluded); "
        "collective s, slowest rank: with the waits. All-reduce latency: one number, every rank, "
        "median of 50.",
        "",
        "Planning phases (s, slowest rank, cached / uncached):",
        "",
        "| phase | " + " | ".join(f"{r['world']} ranks" for r in rows) + " |",
        "|---|" + "---:|" * len(rows),
    ]
    for phase, label in (
        ("plan_check_s", "our plan check (fingerprint + all-reduce)"),
        ("validate_s", "Megatron-Core validation of the sharding"),
        ("distribute_s", "Megatron-Core distribution of replicas (DP)"),
        ("dcp_plan_s", "Megatron-Core -> torch DCP planning"),
        ("planning_mcore_s", "dist_checkpointing.save up to its request"),
    ):
        cells = [
            f"{_fmt(_get(r, f'cached.{phase}'))} / {_fmt(_get(r, f'uncached.{phase}'))}"
            for r in rows
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "### Targets", "", "```"]
    for name, ok, value in targets(rows):
        lines.append(f"{'MET ' if ok else 'MISSED'}  {name}  ({value})")
    lines += ["```", ""]
    for row in rows[-1:]:
        for mode in ("uncached", "cached"):
            profile = _get_profile(row, mode)
            if profile:
                lines += [
                    f"### Profile of the planning of rank 0's save, {row['world']} ranks, "
                    f"{mode} plans (sampled; functions most often on the stack)",
                    "",
                    "```",
                    *profile[:26],
                    "```",
                    "",
                ]
    for error in data.get("errors", []):
        lines += [f"- {error['what']} failed: {error['error'][-300:]}"]
    return "\n".join(lines) + "\n"


def _get_profile(row: dict[str, Any], mode: str) -> list[str] | None:
    figure = row.get(mode)
    return None if not isinstance(figure, dict) else figure.get("profile")


def run(args: Any, machine: dict[str, Any], stem: str) -> int:
    """The scale mode: every rank count of ``args.procs`` on the state ``args.sizes``; writes
    ``<out>/<stem>.json`` and ``.md`` after every rank count."""
    import datetime
    import json
    import shutil
    import sys

    from benchmarks import workloads
    from lightning_mcore_ckpt.testing import DistributedFailure, run_distributed

    size = "quick" if args.quick else args.sizes
    hidden, layers = workloads.SIZES[size]
    worlds = [int(p) for p in args.procs.split(",")]
    scratch = Path(args.dir).resolve()
    shutil.rmtree(scratch, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cpus = os.cpu_count() or 1
    data: dict[str, Any] = {
        "kind": "scale",
        "machine": machine,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "size": size,
        "shard": args.shard,
        "saves": args.saves,
        "oversubscribed": max(worlds) if max(worlds) > cpus else None,
        "rows": [],
        "raw": {},
    }
    for world in sorted(worlds):
        cfg = {
            "hidden": hidden,
            "layers": layers,
            "shard": args.shard,
            "saves": args.saves,
            "every": 1 if args.quick else 2,
            "repeats": 1 if args.quick else args.repeats,
            "dir": str(scratch / f"{world}"),
        }
        started = time.perf_counter()
        print(f"== scale: state {size}, {world} ranks ({args.shard})", flush=True)
        try:
            ranks = run_distributed(scale_saves, world, cfg, timeout=3600)
        except DistributedFailure as failure:
            print(f"!! scale {world} ranks failed:\n{str(failure)[-4000:]}", file=sys.stderr)
            data.setdefault("errors", []).append(
                {"what": f"scale {world} ranks", "error": str(failure)[-8000:]}
            )
            ranks = None
        if ranks is not None:
            row = summarise(world, ranks, args.shard)
            row["elapsed_s"] = time.perf_counter() - started
            data["rows"].append(row)
            data["raw"][str(world)] = ranks
        shutil.rmtree(scratch / f"{world}", ignore_errors=True)
        (out / f"{stem}.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
        (out / f"{stem}.md").write_text(table(data))
        print(f"== scale, {world} ranks: {time.perf_counter() - started:.0f} s", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    print(table(data))
    print(f"results: {out / stem}.json / .md")
    return 1 if data.get("errors") else 0
