"""What each benchmark process runs (inside every rank of a ``run_distributed`` job).

Every method is measured on the state where the run trained it: ours through a Trainer's saves,
and every other method (``benchmarks/baselines.py``) from inside the same ``fit``, at its
``on_train_end``, before Lightning's teardown moves the module and the optimizer state to the
CPU. Each figure records the device of the state it timed (``device``) and whether it was
taken inside ``fit`` (``in_fit``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import json
import os
import shutil
import statistics
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

# hidden size, layers: model + AdamW state of about 256 MiB, 1 GiB, 4 GiB (fp32, 3 copies).
SIZES = {"quick": (128, 2), "256M": (512, 7), "1G": (1024, 7), "4G": (2048, 7)}

# The width of the model whose async save measures the fixed costs of a save (same layers, same
# tensors, almost no bytes).
FIXED_COST_HIDDEN = 64


def pinned_host_bytes() -> int:
    """Bytes of pinned host memory in use in torch's pinned allocator (0 before CUDA is used).

    Pinned memory is host memory that resident-set figures do not show (the driver maps it
    into the process): an async save on a GPU that pinned 1 GiB of staging buffers read 9 MiB
    more RSS. Host memory is RSS plus this. The blocks in use (``active_bytes``), not the
    blocks the allocator owns (``allocated_bytes``): the methods run one after the other in
    one process, and the allocator keeps an earlier method's freed blocks for the next, so
    owned bytes would count them in the level a later save is measured from (ours-async read
    10 MiB of extra host memory, on the H200, after DCP's async save had pinned its own
    buffers)."""
    if not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.host_memory_stats().get("active_bytes.current", 0))


def hand_back_freed_memory() -> None:
    """Hand the memory this process freed back to the kernel (glibc's ``malloc_trim``), so that
    what it allocates next is fresh, as in a process that just started (a resume allocates the
    optimizer's state in pages it never touched), and shows in its resident set."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if sys.platform.startswith("linux") and name:
        ctypes.CDLL(name).malloc_trim(0)


class PeakRSS:
    """Peak host memory of this process (resident set plus pinned memory, see
    :func:`pinned_host_bytes`) above its level when started (sampled). Memory the process
    freed before and reuses inside is resident already and does not show: on a GPU the staging
    is pinned and counted whole; on a CPU a small state's staging can land in freed pages."""

    def __init__(self, interval: float = 0.005) -> None:
        import psutil

        self._proc = psutil.Process()
        self._interval = interval
        self.base = self._now()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _now(self) -> int:
        return int(self._proc.memory_info().rss) + pinned_host_bytes()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self._now())

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._now())

    @property
    def extra(self) -> int:
        return self.peak - self.base


class DevicePeak:
    """Peak device memory allocated while inside (``torch.cuda.max_memory_allocated``, reset at
    the start), and what was allocated at the start; ``None`` for a CPU device.

    ``synchronize``: wait for the device at both ends (what :class:`Measure` times then starts
    and ends with the device idle). The allocator's figures are the host's bookkeeping and need
    no wait: a probe inside a save that is timed by its own code passes ``False``, so that the
    save's time does not include the training step's kernels still running."""

    def __init__(self, device: torch.device, *, synchronize: bool = True) -> None:
        self.cuda = device.type == "cuda"
        self.synchronize = synchronize and self.cuda
        self.base: int | None = None
        self.peak: int | None = None

    def __enter__(self) -> DevicePeak:
        if self.cuda:
            if self.synchronize:
                torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            if self.synchronize:
                torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()


class Measure:
    """Time, peak extra host RSS and peak device memory of what runs inside."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = DevicePeak(torch.device(device))
        self.seconds = 0.0
        self.rss_extra = 0

    def __enter__(self) -> Measure:
        gc.collect()
        self.device.__enter__()
        self._rss = PeakRSS().__enter__()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.device.__exit__()
        self.seconds = time.perf_counter() - self._start
        self._rss.__exit__()
        self.rss_extra = self._rss.extra


def drop_cache(path: Path) -> None:
    """Evict a checkpoint's files from the page cache, so that a load reads the disk."""
    files = [Path(path)] if Path(path).is_file() else Path(path).rglob("*")
    for file in files:
        if file.is_file() and hasattr(os, "posix_fadvise"):
            with open(file, "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _timed(fn: Callable[[], Any], device: torch.device | str = "cpu") -> tuple[float, int]:
    with Measure(device) as measure:
        fn()
    return measure.seconds, measure.rss_extra


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def torch_optimizers_in(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers that hold ``optimizer``'s parameter state: itself, or the one inside
    a Megatron-Core optimizer (each one inside a ``ChainedOptimizer``)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    from megatron.core.optimizer import ChainedOptimizer

    chained = (
        optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    )
    return [o.optimizer for o in chained]


def main_parameters(module: Any, optimizers: Iterable[Any]) -> list[torch.Tensor]:
    """The optimizers' own copies of the parameters (a Megatron-Core optimizer's fp32 main
    parameters of bf16 weights): the parameters its torch optimizers step that share no memory
    with ``module``'s state dict. A checkpoint holds them beside the weights; fp32 weights'
    main parameters are the weights themselves (views of them) and are not listed."""
    weights = {
        t.untyped_storage().data_ptr()
        for t in module.state_dict().values()
        if isinstance(t, torch.Tensor)
    }
    return [
        p
        for optimizer in optimizers
        for inner in torch_optimizers_in(optimizer)
        for group in inner.param_groups
        for p in group["params"]
        if p.untyped_storage().data_ptr() not in weights
    ]


def state_tensors(module: Any, optimizers: Iterable[Any]) -> list[torch.Tensor]:
    """The tensors of a rank's training state: the module's state dict, the optimizers' state
    and their main parameters where they are copies (what a checkpoint of the rank holds; see
    :func:`main_parameters`)."""
    optimizers = list(optimizers)
    tensors = [t for t in module.state_dict().values() if isinstance(t, torch.Tensor)]
    for optimizer in optimizers:
        for inner in torch_optimizers_in(optimizer):
            for state in inner.state.values():
                tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
    return tensors + main_parameters(module, optimizers)


def placement(tensors: Iterable[Any]) -> dict[str, int]:
    """Bytes of the state's tensors on each device (storages counted once)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
    out: dict[str, int] = {}
    for (device, _), size in seen.items():
        out[device] = out.get(device, 0) + size
    return out


def device_of(tensors: Iterable[Any]) -> str:
    """The device that holds the state: the one with 99 % of its bytes or more (AdamW keeps its
    step counts on the CPU wherever the parameters are); else every device it is on, with its
    share, e.g. ``"cpu 40%, cuda:0 60%"``."""
    where = placement(tensors)
    total = sum(where.values())
    if not total:
        return "none"
    device, most = max(where.items(), key=lambda item: item[1])
    if most >= 0.99 * total:
        return device
    return ", ".join(f"{d} {b / total:.0%}" for d, b in sorted(where.items()))


def nbytes(tensors: Iterable[Any]) -> int:
    """Bytes of the tensors' storages, each counted once."""
    return sum(placement(tensors).values())


_WATCHED: weakref.WeakSet[Any] = weakref.WeakSet()
_TORN_DOWN: weakref.WeakSet[Any] = weakref.WeakSet()


def watch_teardown(trainer: Any) -> Any:
    """Note when ``trainer``'s strategy is torn down (Lightning's teardown moves the module and
    the optimizer state to the CPU there), for :func:`in_fit`. Returns ``trainer``."""
    strategy = trainer.strategy
    teardown = strategy.teardown

    def noted() -> None:
        _TORN_DOWN.add(strategy)
        teardown()

    strategy.teardown = noted
    _WATCHED.add(strategy)
    return trainer


def in_fit(trainer: Any) -> bool:
    """Whether ``trainer`` is inside ``fit`` and its strategy not yet torn down (the state is
    where it trained). ``False`` for a Trainer not passed to :func:`watch_teardown`."""
    from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

    strategy = trainer.strategy
    return bool(
        trainer.state.fn == TrainerFn.FITTING
        and trainer.state.status == TrainerStatus.RUNNING
        and strategy in _WATCHED
        and strategy not in _TORN_DOWN
    )


def write_progress(path: str | None, figures: dict[str, Any]) -> None:
    """Rank 0's figures so far, for a run cut short (replaced atomically)."""
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_suffix(".tmp")
    temporary.write_text(json.dumps(figures, indent=2, default=str) + "\n")
    temporary.replace(target)


def failed() -> dict[str, Any]:
    """A method that raised: what it raised (the rest of the run goes on)."""
    return {"error": traceback.format_exc(limit=8)[-3000:]}


def _module(size: str, hidden: int | None = None, optimizer: str = "adamw") -> Any:
    """The benchmark's GPT of ``size`` (``hidden``: another width, same layers), trained with
    ``optimizer``: ``TinyGPTModule``'s (torch AdamW, or Megatron-Core's distributed optimizer
    over Megatron DDP with ``"distributed"``), or ``"distributed-bf16"``: the distributed
    optimizer over bf16 weights with fp32 main parameters, as Megatron-LM trains."""
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    width, layers = SIZES[size]
    width = hidden or width

    class Sized(TinyGPTModule):  # type: ignore[misc]
        def _language_model(self, **config: Any) -> Any:
            return super()._language_model(
                **{
                    **config,
                    "hidden_size": width,
                    "ffn_hidden_size": 4 * width,
                    "num_attention_heads": max(2, width // 64),  # divisible by TP=2
                    "num_layers": layers,
                }
            )

    bf16 = optimizer == "distributed-bf16"
    return Sized(dropout=0.0, optimizer="distributed" if bf16 else optimizer, megatron_bf16=bf16)


def _trainer(
    max_steps: int,
    tp: int,
    world: int,
    callbacks: list[Any],
    async_save: bool,
    device: str = "cpu",
    writer: str = "threads",
    **options: Any,
) -> Any:
    import lightning.pytorch as pl

    from lightning_mcore_ckpt import MegatronStrategy

    trainer = pl.Trainer(
        strategy=MegatronStrategy(
            tensor_model_parallel_size=tp, ckpt_async_save=async_save, ckpt_writer=writer, **options
        ),
        accelerator=device,
        devices=world,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=any(type(c).__name__ == "MegatronCheckpoint" for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    return watch_teardown(trainer)


def _loader(stateful: bool = False) -> Any:
    """The training data; ``stateful``: a loader whose position a resume restores."""
    from torch.utils.data import DataLoader
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_mcore_ckpt.tiny import TokenDataset

    return (StatefulDataLoader if stateful else DataLoader)(TokenDataset(256), batch_size=2)


def _probe_class() -> Any:
    import lightning.pytorch as pl

    class SaveProbe(pl.Callback):  # type: ignore[misc]
        """Around every save the Trainer makes into ``dirpath``: the device of the state it
        saves and the peak device memory of its blocking part; and the host memory from just
        before the run's first save is planned ahead (the staging memory that planning
        allocates for it is the saves' memory) or, where nothing is planned ahead, just before
        the first save, until every save is durable (the strategy's ``on_train_end`` waits for
        the last one), above the level at its start.

        A save's blocking time is timed by the library from before this probe is called: the
        probe looks at the state after the save returns (the same tensors) and does not wait
        for the device, so that none of its own work is counted in the save's time."""

        def __init__(self, dirpath: Path) -> None:
            self.dirpath = Path(dirpath).resolve()
            self.devices: set[str] = set()
            self.in_fit: set[bool] = set()
            self.device_peaks: list[int] = []
            self.state_bytes = 0
            self.rss: PeakRSS | None = None
            self.rss_from: str | None = None
            """Where the host-memory probe started: ``"plan ahead"`` (before the first save's
            staging is allocated) or ``"first save"`` (no save planned ahead)."""

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            strategy = trainer.strategy
            save, end = strategy.save_checkpoint, strategy.on_train_end
            plan = strategy.plan_saves_ahead

            def probed_plan(*args: Any, **kwargs: Any) -> bool:
                if self.rss is None:
                    self.rss, self.rss_from = PeakRSS().__enter__(), "plan ahead"
                return bool(plan(*args, **kwargs))

            def probed_save(checkpoint: Any, filepath: Any, storage_options: Any = None) -> None:
                if not Path(filepath).resolve().is_relative_to(self.dirpath):
                    save(checkpoint, filepath, storage_options)
                    return
                if self.rss is None:
                    self.rss, self.rss_from = PeakRSS().__enter__(), "first save"
                with DevicePeak(strategy.root_device, synchronize=False) as peak:
                    save(checkpoint, filepath, storage_options)
                if peak.peak is not None:
                    self.device_peaks.append(peak.peak)
                state = state_tensors(pl_module, strategy._torch_optimizers())
                self.devices.add(device_of(state))
                self.in_fit.add(in_fit(trainer))
                self.state_bytes = nbytes(state)

            def probed_end() -> None:
                end()
                self.stop()

            strategy.save_checkpoint = probed_save
            strategy.on_train_end = probed_end
            strategy.plan_saves_ahead = probed_plan

        def stop(self) -> None:
            if self.rss is not None:
                self.rss.__exit__()

        def figures(self) -> dict[str, Any]:
            return {
                "device": ",".join(sorted(self.devices)),
                "in_fit": self.in_fit == {True},
                "state_bytes": self.state_bytes,
                "peak_rss_extra": self.rss.extra if self.rss is not None else 0,
                "rss_from": self.rss_from,
                "device_peak_bytes": max(self.device_peaks) if self.device_peaks else None,
            }

    return SaveProbe


def _saves_apart_class() -> Any:
    import lightning.pytorch as pl

    class SavesApart(pl.Callback):  # type: ignore[misc]
        """Before each step that ends with a save (an async run's): waits until the previous
        save is durable and finalised (the strategy's ``finalize_pending_save``, collective:
        every rank at the same step), outside any save's timed blocking. So each
        save's blocking is its own, however short the steps between saves; the waits are
        reported apart (``wait_for_previous_s``)."""

        def __init__(self, every: int) -> None:
            self.every = every
            self.waits: list[float] = []
            self.end_wait = 0.0

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if (trainer.global_step + 1) % self.every:
                return
            self.waits.append(self._wait(trainer))

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            # The last save too (the strategy's own end would finalise it blocking, counted).
            self.end_wait = self._wait(trainer)

        @staticmethod
        def _wait(trainer: Any) -> float:
            start = time.perf_counter()
            # Not finalize_pending_save(blocking=True): the strategy counts a finalising call's
            # whole time (its wait included) in that save's blocking. Asked until the write is
            # done on every rank (collective, so every rank leaves at the same call), the
            # finalising call itself is all that is counted.
            while not trainer.strategy.finalize_pending_save(blocking=False):
                time.sleep(0.002)
            return time.perf_counter() - start

    return SavesApart


def _our_fit(
    rank: int,
    world: int,
    cfg: dict[str, Any],
    mode: str,
    writer: str,
    dirpath: Path,
    hidden: int | None = None,
    extra_callbacks: Callable[[Any], list[Any]] | None = None,
) -> dict[str, Any]:
    """A Trainer run of ours saving every ``cfg["every"]`` steps, ``cfg["saves"]`` times: rank
    0's figures from each committed step's metadata (steady state: every save but the first,
    which is reported on its own) and the probe's."""
    from lightning_mcore_ckpt import MegatronCheckpoint
    from lightning_mcore_ckpt.format import layout, markers

    every = cfg.get("every", 3)
    probe = _probe_class()(dirpath)
    callback = MegatronCheckpoint(dirpath, every_n_train_steps=every, save_last=False)
    apart = _saves_apart_class()(every) if mode == "async" else None
    callbacks = [
        probe,
        *([apart] if apart is not None else []),
        *(extra_callbacks(probe) if extra_callbacks else []),
        callback,
    ]
    module = _module(cfg["size"], hidden)
    trainer = _trainer(
        cfg["saves"] * every,
        world,
        world,
        callbacks,
        mode == "async",
        cfg.get("device", "cpu"),
        writer,
    )
    with _stacks_if_stalled(cfg.get("stacks_after_s")):
        trainer.fit(module, train_dataloaders=_loader())
    out: dict[str, Any] = {}
    if rank == 0:
        metas = [markers.read_metadata(s.path) or {} for s in layout.complete_steps(dirpath)]
        metas.sort(key=lambda m: m["global_step"])
        steady = metas[1:] or metas
        out = {
            "save_s": _summary([m["total_time_s"] for m in steady]),
            "blocking_s": _summary([m["blocking_time_s"] for m in steady]),
            "write_s": _summary([m["write_time_s"] for m in steady]),
            "first_save_s": metas[0]["total_time_s"],
            "first_blocking_s": metas[0]["blocking_time_s"],
            # The first save's plans, made after the first optimizer step (None: not made).
            "planned_ahead_s": trainer.strategy._writer.planned_ahead_s,
            "bytes": metas[-1]["size_bytes"],
            "writer": metas[-1].get("writer", writer),
            # The blocking time by part (medians of the steady saves; the first save apart).
            "blocking_parts_s": _parts_median(steady),
            "first_blocking_parts_s": metas[0].get("blocking_parts_s"),
            **probe.figures(),
        }
        if apart is not None:  # the wait before each save but the first (none before it)
            out["wait_for_previous_s"] = _summary(apart.waits[1:] or apart.waits)
    return out


@contextlib.contextmanager
def _stacks_if_stalled(seconds: float | None) -> Iterator[None]:
    """Meanwhile, every ``seconds`` (none: never), the stack of each of this rank's threads
    goes to its stderr: a row that does not return says where it waits (a GPU's device time is
    too short to come back and look)."""
    if not seconds:
        yield
        return
    faulthandler.dump_traceback_later(seconds, repeat=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _parts_median(metas: list[dict[str, Any]]) -> dict[str, float] | None:
    """The median of each part of the blocking time over ``metas`` (``None``: not recorded)."""
    parts = [m["blocking_parts_s"] for m in metas if m.get("blocking_parts_s")]
    if not parts:
        return None
    return {name: statistics.median(p.get(name, 0.0) for p in parts) for name in parts[0]}


def _clean(rank: int, path: Path) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


def save_load(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Every method's save and load of the same state; returns rank 0's figures.

    Ours through real Trainer runs (sync, async, async with Megatron-Core's writer), the others
    from inside the sync run's ``fit`` (``benchmarks/baselines.py``). An async run of the same
    layers at width 64 measures the fixed costs of an async save (the same tensors, almost no
    bytes). A method that fails is recorded with its error; the others go on. Rank 0 writes the
    figures so far to ``cfg["progress"]`` after each method. Megatron-Core's writer comes last.
    """
    root = Path(cfg["dir"])
    out: dict[str, Any] = {"size": cfg["size"], "world": world}
    progress = cfg.get("progress") if rank == 0 else None
    _our_rows(rank, world, cfg, out, progress, [("sync", "threads"), ("async", "threads")])
    dirpath = root / "fixed-costs"
    try:
        fixed = _our_fit(rank, world, cfg, "async", "threads", dirpath, FIXED_COST_HIDDEN)
        if rank == 0 and "ours-async" in out:
            out["ours-async"]["fixed_costs"] = {
                "hidden": FIXED_COST_HIDDEN,
                "blocking_s": fixed["blocking_s"],
                "blocking_parts_s": fixed["blocking_parts_s"],
                "bytes": fixed["bytes"],
            }
    except Exception:  # noqa: BLE001 - recorded; the other figures stand
        out.setdefault("ours-async", {})["fixed_costs"] = failed()
    _clean(rank, dirpath)
    write_progress(progress, out)
    # Last: on the H200 of 2026-11-30 22:57 this row did not return after its fit (both sizes),
    # so that a run bounded from outside still has every figure before it.
    _our_rows(rank, world, cfg, out, progress, [("async", "megatron")])
    return out


def _our_rows(
    rank: int,
    world: int,
    cfg: dict[str, Any],
    out: dict[str, Any],
    progress: str | None,
    modes: list[tuple[str, str]],
) -> None:
    """Our Trainer runs of each ``(mode, writer)`` into ``out`` (the baselines inside the sync
    one), the figures so far written to ``progress`` after each."""
    from benchmarks import baselines

    root = Path(cfg["dir"])
    for mode, writer in modes:
        name = f"ours-{mode}" if writer == "threads" else f"ours-{mode} (megatron writer)"
        dirpath = root / f"ours-{mode}-{writer}"

        def with_baselines(probe: Any, dirpath: Path = dirpath) -> list[Any]:
            return [baselines.Baselines(rank, world, cfg, out, dirpath, probe, progress)]

        try:
            figures = _our_fit(
                rank,
                world,
                cfg,
                mode,
                writer,
                dirpath,
                extra_callbacks=with_baselines if mode == "sync" else None,
            )
            out[name] = {**out.get(name, {}), **figures}
        except Exception:  # noqa: BLE001 - recorded; the other methods go on
            out[name] = {**out.get(name, {}), **failed()}
        _clean(rank, dirpath)
        write_progress(progress, out)


def d2h(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Device-to-host copy bandwidth (GB/s) into pinned and into pageable memory (1 GiB), and
    the GPU's name."""
    size = cfg.get("bytes", 2**30)
    device = torch.ones(size // 4, device="cuda")
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name()}
    for name, pinned in (("pinned_d2h_gbps", True), ("pageable_d2h_gbps", False)):
        host = torch.empty(size // 4, pin_memory=pinned)
        host.copy_(device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            host.copy_(device, non_blocking=pinned)
        torch.cuda.synchronize()
        out[name] = 3 * size / (time.perf_counter() - start) / 1e9
    return out


def step_overhead(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Time the callback's own per-step work on steps where nothing is saved, and the step.

    Measured directly (a timer around the callback's batch-end hook) rather than as the
    difference of two runs' step times, which machine noise swamps. Every rank returns its
    time per step: with several processes, the hook's collective makes a rank that finished its
    step early wait for the last one, which the step's next collective would make it wait for
    anyway; the step pays only what the last rank to arrive spends (see ``critical_path``).
    """
    import lightning.pytorch as pl

    from lightning_mcore_ckpt import MegatronCheckpoint

    steps: list[float] = []
    hook: list[float] = []

    class Clock(pl.Callback):
        last: float | None = None

        def on_train_batch_start(self, *args: Any) -> None:
            now = time.perf_counter()
            if self.last is not None:
                steps.append(now - self.last)
            self.last = now

    callback = MegatronCheckpoint(
        Path(cfg["dir"]) / "overhead", every_n_train_steps=10**9, save_last=False
    )
    original = callback.on_train_batch_end

    def timed(*args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        original(*args, **kwargs)
        hook.append(time.perf_counter() - start)

    callback.on_train_batch_end = timed  # type: ignore[method-assign]
    trainer = _trainer(
        cfg["steps"], world, world, [Clock(), callback], False, cfg.get("device", "cpu")
    )
    trainer.fit(_module(cfg["size"]), train_dataloaders=_loader())
    return {
        "step_s": statistics.median(steps),
        "callback_s": statistics.median(hook[1:]),
        "hook_s": hook[1:],
    }


def critical_path(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The callback's per-step cost from every rank's ``step_overhead`` figures.

    A synchronous data-parallel step ends when its slowest rank does. At each step the rank that
    reaches the callback last waits for nobody: its time is what the callback adds to the step
    (its own work and the collective's latency). The other ranks' extra time is the wait for
    that rank, a skew between ranks that exists with or without the callback.
    """
    steps = min(len(r["hook_s"]) for r in ranks)
    last = [min(r["hook_s"][i] for r in ranks) for i in range(steps)]
    first = [max(r["hook_s"][i] for r in ranks) for i in range(steps)]
    return {
        **ranks[0],
        "callback_s": statistics.median(last),
        "waiting_s": statistics.median(first),
        "ranks": len(ranks),
    }


def moe_save(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """A Qwen2-MoE started from its Hugging Face weights with its experts split over ``world``
    processes (expert parallelism), trained one step and saved as ``ckpt/global_step_1``."""
    import lightning.pytorch as pl
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import HFGPTModule, TokenDataset

    root = Path(cfg["dir"])
    trainer = pl.Trainer(
        strategy=MegatronStrategy(expert_model_parallel_size=world, init_from=root / "src"),
        accelerator="cpu",
        devices=world,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[MegatronCheckpoint(root / "ckpt", every_n_train_steps=1)],
    )
    loader = StatefulDataLoader(TokenDataset(2 * world), batch_size=2)
    trainer.fit(HFGPTModule(str(root / "src")), train_dataloaders=loader)


def hf_export(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Time and peak memory of an HF export of a saved step (one process, no group)."""
    from lightning_mcore_ckpt import hf

    root = Path(cfg["dir"])
    step = root / cfg.get("step", "imported")
    out = root / "exported"
    shutil.rmtree(out, ignore_errors=True)
    seconds, extra = _timed(lambda: hf.export_checkpoint(step, root / "src", out, progress=False))
    # The largest slice the export reads at once: one layer of the largest checkpoint tensor,
    # one expert of one layer for an MoE's routed experts; and a layer's experts stacked.
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(step / "model")).read_metadata()
    largest = stacked = 0
    for key, md in metadata.state_dict_metadata.items():
        if hasattr(md, "size"):
            shape = list(md.size)[1:] if ".layers." in key else list(md.size)
            nbytes = int(torch.tensor(shape).prod().item()) * 4
            if ".experts.experts." in key:
                stacked = max(stacked, nbytes)
                nbytes //= shape[0]
            largest = max(largest, nbytes)
    return {
        "seconds": seconds,
        "peak_rss_extra": extra,
        "bytes": tree_bytes(out),
        "largest_tensor_bytes": largest,
        "stacked_experts_bytes": stacked,
    }
