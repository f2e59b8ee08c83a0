"""``python -m benchmarks --only-loads``: cold loads side by side, in rounds that alternate the
order of the methods, with our load's phases timed apart.

One Trainer run (sync saves) trains the state; at its ``on_train_end`` (the state where it
trained) the same state is also saved once by each other method: Lightning's default
``torch.save`` (one file per rank), plain torch DCP and raw Megatron-Core ``dist_checkpointing``.
Then every round loads each of them cold (the page cache of every file dropped before each
method), in an order that changes from round to round (rotated, and reversed every other
round), and reads cold, in the same round:

- **our step's files** (this rank's shard files and ``extra/`` file) with as many threads as
  our reader uses, each file whole: the read limit of the bytes our load reads;
- **the ``torch.save`` file** with as many streams, each a contiguous share: the parallel read
  limit the main benchmark judges loads against.

A disk whose speed moves from one minute to the next moves every method of a round together:
the ratios are taken within each round and their median reported, next to each method's
median seconds. Our load's phases (the checks, the weights' and the optimizer's
``dist_checkpointing`` loads, the shard reads inside them, ``extra/``, garbage collections)
are timed in every round from the library's own functions, wrapped for the run.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from benchmarks.workloads import (
    drop_cache,
    hand_back_freed_memory,
    main_parameters,
    torch_optimizers_in,
)

MiB = 1 << 20
METHODS = (
    "ours",
    "torch.load",
    "plain DCP",
    "raw dist_checkpointing",
    "read: our files",
    "read: torch.save file",
)


def _faults() -> float:
    """The process's minor page faults so far, as MiB of 4 KiB pages."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt * 4096 / MiB


VARIANTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {}
"""Contexts a method named ``ours [<name>]`` runs our load in (a change measured against the
load without it, in the same rounds); registered by whoever runs the rounds."""


class _Phases:
    """Seconds spent in named functions during one load, the outermost call of each counted;
    and the time of the garbage collections that fell inside it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._depth: dict[str, int] = {}
        self._gc_start = 0.0
        self._lock = threading.Lock()

    def wrap(self, owner: Any, name: str, label: str) -> Callable[[], None]:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                depth = self._depth.get(label, 0)
                self._depth[label] = depth + 1
            start = time.perf_counter()
            faults = _faults()
            try:
                return original(*args, **kwargs)
            finally:
                with self._lock:
                    self._depth[label] -= 1
                    if depth == 0:
                        spent = time.perf_counter() - start
                        self.seconds[label] = self.seconds.get(label, 0.0) + spent
                        key = f"{label}: page faults, MiB"
                        self.seconds[key] = self.seconds.get(key, 0.0) + _faults() - faults

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            spent = time.perf_counter() - self._gc_start
            key = f"garbage collection (gen {info.get('generation')})"
            self.seconds[key] = self.seconds.get(key, 0.0) + spent


class _Rounds(pl.Callback):  # type: ignore[misc]
    def __init__(self, rank: int, world: int, cfg: dict[str, Any], out: dict[str, Any]) -> None:
        self.rank, self.world, self.cfg, self.out = rank, world, cfg, out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from benchmarks.baselines import _Methods

        strategy: Any = trainer.strategy
        strategy.finalize_pending_save(blocking=True)
        pl_module.zero_grad(set_to_none=True)
        methods = _Methods(trainer, self.rank, self.world, self.cfg, Path(self.cfg["ours"]))
        self.out.update(rounds(methods, self.cfg))


def _saved(methods: Any) -> dict[str, Path]:
    """Every other method's copy of the same state, saved once."""
    import torch.distributed.checkpoint as dcp
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from megatron.core import dist_checkpointing

    torch_dir = methods.fresh("torch-save")
    torch_file = torch_dir / f"rank_{methods.rank}.ckpt"
    TorchCheckpointIO().save_checkpoint(_torch_save_state(methods), torch_file)
    dcp_dir = methods.fresh("dcp")
    dcp.save(methods.plain(), checkpoint_id=str(dcp_dir), process_group=methods.group)
    raw = methods.fresh("raw")
    for part in ("model", "optim"):
        (raw / part).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(methods.model_ssd(), str(raw / "model"))
    dist_checkpointing.save(methods.optim_ssd(), str(raw / "optim"))
    os.sync()  # every copy on the disk: a dirty page is not dropped from the cache
    # Megatron-Core's save forks its writers: the state's pages are shared copy-on-write with
    # them, and the first load into them would pay a copy of every page (340 MiB of faults at
    # 1 GiB) that a resume never sees. Written once, as a training step writes them.
    with torch.no_grad():
        for tensor in methods.state():
            tensor.add_(0)
    dist.barrier()
    return {"torch": torch_file, "dcp": dcp_dir, "raw": raw}


def _torch_save_state(methods: Any) -> dict[str, Any]:
    """What Lightning's default ``torch.save`` holds of the rank's state: the module's state
    dict and the optimizer's. A Megatron-Core optimizer's own ``state_dict()`` leaves its Adam
    moments and its main parameters to its sharded state dict: the torch optimizers inside it
    hold the moments, and its main parameters are added where they are copies of the weights
    (bf16 weights' fp32 main parameters; ``workloads.main_parameters``), as our step holds
    them."""
    return {
        "state_dict": methods.module.state_dict(),
        "optimizer_states": [o.state_dict() for o in torch_optimizers_in(methods.optimizer)],
        "main_parameters": main_parameters(methods.module, [methods.optimizer]),
    }


def _class_name(optimizer: Any) -> str:
    """``optimizer``'s class, and those of the optimizers a ``ChainedOptimizer`` chains."""
    inner = getattr(optimizer, "chained_optimizers", None)
    name = type(optimizer).__name__
    return f"{name}({', '.join(type(o).__name__ for o in inner)})" if inner else name


def order_of(names: tuple[str, ...], i: int) -> list[str]:
    """Round ``i``'s order: led by ``names[i]`` (modulo their number), the others after it in
    their order in even rounds and in reverse in odd ones (each method leads a round, and
    follows each other one in both directions)."""
    if i % 2 == 0:
        k = i % len(names)
        return list(names[k:] + names[:k])
    k = (i + 1) % len(names)
    return list(names[k:] + names[:k])[::-1]


def _our_files(step: Path, rank: int) -> list[Path]:
    """The files this rank's load reads most of: its shard files and its ``extra/`` file."""
    mine = f"__{rank}_"
    shards = [p for part in ("model", "optim") for p in (step / part).glob(f"{mine}*.distcp")]
    extra = [p for p in (step / "extra").glob(f"rank_{rank}.*")]
    return sorted(shards + extra)


def _no_optimizer_state(methods: Any) -> None:
    """Empty the live optimizers' state before a load into them, outside its timing: a
    resumed run's fresh process has none when it loads (the load creates it), and freeing the
    state the round before loaded (a few hundred MiB of pages) is no part of a load."""
    for inner in torch_optimizers_in(methods.optimizer):
        inner.state.clear()


def read_files(paths: list[Path], threads: int) -> int:
    """Read ``paths`` whole, ``threads`` files at once (8 MiB reads); the bytes read."""

    def read(path: Path) -> int:
        done = 0
        with open(path, "rb", buffering=0) as f:
            buffer = bytearray(8 * MiB)
            while n := f.readinto(buffer):
                done += n
        return done

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(read, paths))


def _our_load(methods: Any, step: Path) -> Callable[[], dict[str, float]]:
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    from lightning_mcore_ckpt.engine import _parallel_reader, _rank_state, _reader
    from lightning_mcore_ckpt.safety import safe_dcp
    from lightning_mcore_ckpt.training import optim

    strategy, reader = methods.strategy, methods.strategy._reader
    # (owner, function, label): the outermost call of each is timed, where it is called from.
    timed = [
        (reader, "resolve", "resolve the step (rank 0) and its damage check"),
        (reader, "check_optimizer_layout", "check the optimizer's layout"),
        (reader, "check_extra", "check extra/"),
        (reader, "load_weights", "weights, in all"),
        (reader, "check_shapes", "weights: check the shapes"),
        (safe_dcp, "check_dist_checkpoint", "check the index and objects (both parts)"),
        (reader, "load_optimizers", "optimizer, in all"),
        (optim, "init_state", "optimizer: create its state"),
        (_reader, "optimizer_sharded_state_dict", "optimizer: its sharded state dict"),
        (_rank_state, "apply_optimizer_state", "optimizer: into the live optimizer"),
        (strategy, "model_sharded_state_dict", "the model's sharded state dicts (all)"),
        (serialization, "load_common_state_dict", "Megatron-Core: common state (both parts)"),
        (torch_strategy.TorchDistLoadShardedStrategy, "load", "Megatron-Core: sharded load"),
        (dcp, "load", "torch DCP load: planning and reads (both)"),
        (dcp, "load_state_dict", "torch DCP load: planning and reads (both)"),  # mcore 0.16
        (_parallel_reader.ParallelFileSystemReader, "read_data", "shard reads (in both)"),
        (reader, "load_extra", "extra/ and RNG"),
    ]

    def load() -> dict[str, float]:
        phases = _Phases()
        undo = [phases.wrap(owner, name, label) for owner, name, label in timed]
        gc.callbacks.append(phases.on_gc)
        faults = _faults()
        try:
            strategy.load_checkpoint(step)
        finally:
            gc.callbacks.remove(phases.on_gc)
            for restore in undo:
                restore()
        return {**phases.seconds, "load: page faults, MiB": _faults() - faults}

    return load


def rounds(methods: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Every method once per round, cold, in an order that alternates; rank 0's figures."""
    import torch.distributed.checkpoint as dcp
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from megatron.core import dist_checkpointing

    from benchmarks.__main__ import parallel_read
    from lightning_mcore_ckpt.format import layout

    step = layout.resolve_last(Path(cfg["ours"]), verify=False)
    assert step is not None, f"no committed step in {cfg['ours']}"
    saved = _saved(methods)
    time.sleep(cfg.get("settle_s", 10))  # the saves' writes behind the disk, not in round 1
    root = Path(cfg["dir"])
    threads = int(methods.strategy._reader.read_threads)
    mine = _our_files(step, methods.rank)
    plain = methods.plain()
    io = TorchCheckpointIO()
    ours = _our_load(methods, step)
    phases: list[dict[str, float]] = []
    bytes_read = {"read: our files": 0, "read: torch.save file": saved["torch"].stat().st_size}

    def run(name: str) -> None:
        name = name.removesuffix(" (again)")
        if name.startswith("ours ["):  # ours within a variant's context (an A/B of a change)
            with VARIANTS[name[len("ours [") : -1]]():
                phases.append(ours())
        elif name == "ours":
            phases.append(ours())
        elif name == "torch.load":
            loaded = io.load_checkpoint(saved["torch"])
            del loaded
        elif name == "plain DCP":
            dcp.load(plain, checkpoint_id=str(saved["dcp"]), process_group=methods.group)
        elif name == "raw dist_checkpointing":
            dist_checkpointing.load(methods.model_ssd(), str(saved["raw"] / "model"))
            methods.strategy._load_optimizers(saved["raw"] / "optim")
        elif name == "read: our files":
            bytes_read[name] = read_files(mine, threads)
        else:
            parallel_read(saved["torch"], threads)

    names = tuple(cfg.get("methods", METHODS))
    seconds: dict[str, list[float]] = {name: [] for name in names}
    orders = []
    held_before = []  # the live optimizers' state entries when our load started: none
    for i in range(cfg["rounds"]):
        order = order_of(names, i)
        orders.append(order)
        for name in order:
            if name.startswith("ours") or name == "raw dist_checkpointing":
                _no_optimizer_state(methods)  # into the live optimizer, as a resume loads
            if name.startswith("ours"):
                held_before.append(
                    sum(len(o.state) for o in torch_optimizers_in(methods.optimizer))
                )
            drop_cache(root)
            gc.collect()
            hand_back_freed_memory()  # what the method allocates is fresh
            dist.barrier()
            start = time.perf_counter()
            run(name)
            dist.barrier()
            seconds[name].append(time.perf_counter() - start)
    return {
        "rounds": cfg["rounds"],
        "orders": orders,
        "seconds": seconds,
        "phases": phases,
        "optimizer_state_before_ours": held_before,
        "threads": threads,
        "bytes": {
            "ours": sum(p.stat().st_size for p in mine),
            **bytes_read,
            "state": sum(t.numel() * t.element_size() for t in methods.state()),
        },
        "files": [str(p.relative_to(step)) for p in mine],
        "optimizer_class": _class_name(methods.optimizer),
    }


def job(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank: a Trainer run saving twice, then the rounds at its ``on_train_end``."""
    from benchmarks.workloads import _loader, _module, _trainer
    from lightning_mcore_ckpt import MegatronCheckpoint

    out: dict[str, Any] = {}
    every = 2
    callback = MegatronCheckpoint(cfg["ours"], every_n_train_steps=every, save_last=False)
    callbacks = [_Rounds(rank, world, cfg, out), callback]
    trainer = _trainer(2 * every, world, world, callbacks, False, cfg.get("device", "cpu"))
    module = _module(cfg["size"], optimizer=cfg.get("optimizer", "adamw"))
    trainer.fit(module, train_dataloaders=_loader())
    return out


# --- the figures ------------------------------------------------------------------------------

TARGET_OF_LIMIT = 0.8

OPTIMIZER_NAMES = {
    "adamw": "torch AdamW",
    "distributed": "Megatron-Core's distributed optimizer",
    "distributed-bf16": "Megatron-Core's distributed optimizer, bf16 weights",
}
"""``--optimizers``: the optimizer the state is trained with (``TinyGPTModule``'s names)."""


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """Medians per method; per-round ratios (their medians); our phases' medians; the targets.

    ``ours vs X``: X's seconds over ours in the same round (above 1: ours is faster). ``of the
    read limit``: the faster of the two reads of that round, scaled to the bytes our load reads,
    over our load's seconds; ``of reading our files whole``: that read alone, the same way."""
    seconds = result["seconds"]
    rounds = len(seconds["ours"])
    out: dict[str, Any] = {
        "median_s": {k: statistics.median(v) for k, v in seconds.items() if v},
        "range_s": {k: (min(v), max(v)) for k, v in seconds.items() if v},
    }
    ratios: dict[str, list[float]] = {}
    for baseline in ("torch.load", "plain DCP", "raw dist_checkpointing"):
        if seconds.get(baseline):
            ratios[f"ours vs {baseline}"] = [
                seconds[baseline][i] / seconds["ours"][i] for i in range(rounds)
            ]
    size = result["bytes"]
    limits = []
    for i in range(rounds):
        candidates = [
            seconds[name][i] * size["ours"] / size[name]
            for name in ("read: our files", "read: torch.save file")
            if seconds.get(name) and size.get(name)
        ]
        if candidates:
            limits.append(min(candidates) / seconds["ours"][i])
    if limits:
        ratios["ours of the read limit"] = limits
    if seconds.get("read: our files") and size.get("read: our files"):
        # The same files read whole: what separates our load from them is the load's own work,
        # not how the disk serves these files against one file per rank.
        ratios["ours of reading our files whole"] = [
            seconds["read: our files"][i]
            * size["ours"]
            / size["read: our files"]
            / seconds["ours"][i]
            for i in range(rounds)
        ]
    out["ratios"] = {k: statistics.median(v) for k, v in ratios.items()}
    out["ratio_rounds"] = ratios
    phases = result.get("phases") or []
    keys = sorted({k for p in phases for k in p})
    out["phases"] = {k: statistics.median([p.get(k, 0.0) for p in phases]) for k in keys}
    out["targets"] = targets(out["ratios"])
    return out


def targets(ratios: dict[str, float]) -> list[tuple[str, str, str]]:
    """(target, MET/MISSED, the figure) for the cold-load targets."""
    rows = []
    for baseline in ("torch.load", "plain DCP"):
        value = ratios.get(f"ours vs {baseline}")
        if value is not None:
            verdict = "MET" if value >= 1.0 else "MISSED"
            rows.append((f"cold load >= {baseline}", verdict, f"{value:.2f}x"))
    value = ratios.get("ours of the read limit")
    if value is not None:
        verdict = "MET" if value >= TARGET_OF_LIMIT else "MISSED"
        rows.append(
            (f"cold load >= {TARGET_OF_LIMIT} x parallel read limit", verdict, f"{value:.2f}")
        )
    return rows


def report(runs: list[dict[str, Any]], machine: str, command: str) -> str:
    """The Markdown tables of every run."""
    lines = [
        "### Cold loads side by side, in alternating rounds",
        "",
        machine,
        "",
        f"Command: `{command}`.",
        "",
    ]
    for run in runs:
        result, summary = run["result"], run["summary"]
        mib = result["bytes"]["ours"] / MiB
        lines += [
            f"#### State {run['size']}, {run['world']} process(es), "
            f"{OPTIMIZER_NAMES[run.get('optimizer', 'adamw')]}: {result['rounds']} rounds, "
            f"{mib:.0f} MiB read by our load per rank, {result['threads']} reader threads",
            "",
            "| method | median s | min-max s |",
            "| --- | --- | --- |",
        ]
        for name, median in summary["median_s"].items():
            low, high = summary["range_s"][name]
            lines.append(f"| {name} | {median:.3f} | {low:.3f}-{high:.3f} |")
        lines += ["", "| ratio, per round (median) | value |", "| --- | --- |"]
        lines += [f"| {k} | {v:.2f} |" for k, v in summary["ratios"].items()]
        lines += ["", "Our load's phases (medians of the rounds, s; MiB of page faults):", ""]
        lines += ["| phase | median |", "| --- | --- |"]
        lines += [f"| {k} | {v:.3f} |" for k, v in summary["phases"].items()]
        lines += ["", "```"]
        lines += [f"{verdict:6s} {name}  ({value})" for name, verdict, value in summary["targets"]]
        lines += ["```", ""]
    return "\n".join(lines) + "\n"


def run(args: Any) -> int:
    """``--only-loads``: every size and process count, written to ``--out``."""
    from benchmarks.report import machine_line
    from lightning_mcore_ckpt.testing import run_distributed

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sizes = ["quick"] if args.quick else (args.sizes or "1G").split(",")
    default_procs = "1" if args.device == "cuda" else "1,2"
    procs = [1] if args.quick else [int(p) for p in (args.procs or default_procs).split(",")]
    if args.device == "cuda":
        from benchmarks.__main__ import _cuda_problem

        problem = _cuda_problem(procs)
        if problem:
            print(f"python -m benchmarks --only-loads --device cuda: {problem}", file=sys.stderr)
            return 2
    optimizers = (args.optimizers or ",".join(OPTIMIZER_NAMES)).split(",")
    unknown = [o for o in optimizers if o not in OPTIMIZER_NAMES]
    if unknown:
        print(
            f"python -m benchmarks --only-loads --optimizers {args.optimizers}: "
            f"{', '.join(unknown)} unknown; use {','.join(OPTIMIZER_NAMES)}",
            file=sys.stderr,
        )
        return 2
    rounds = 2 if args.quick else 2 * args.repeats
    scratch = Path(args.dir).resolve() / "loads"
    runs = []
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{time.strftime('%Y-%m-%d', time.gmtime())}-{socket.gethostname()}-loads"
    command = (
        "python -m benchmarks --only-loads "
        + (
            "--quick"
            if args.quick
            else f"--sizes {','.join(sizes)} --procs "
            f"{','.join(map(str, procs))} --repeats {args.repeats}"
        )
        + f" --optimizers {','.join(optimizers)}"
    )
    try:
        for size, optimizer, world in itertools.product(sizes, optimizers, procs):
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir(parents=True)
            cfg = {
                "size": size,
                "optimizer": optimizer,
                "dir": str(scratch),
                "ours": str(scratch / "ours"),
                "rounds": rounds,
                "repeats": 1,
                "device": args.device,
                "settle_s": 1 if args.quick else 10,
            }
            print(
                f"== loads: state {size}, {world} process(es), {OPTIMIZER_NAMES[optimizer]}, "
                f"{rounds} rounds",
                flush=True,
            )
            result = run_distributed(job, world, cfg, timeout=3600)[0]
            summary = summarise(result)
            runs.append(
                {
                    "size": size,
                    "world": world,
                    "optimizer": optimizer,
                    "result": result,
                    "summary": summary,
                }
            )
            machine = machine_line(
                f"Python {platform.python_version()}; `{args.dir}`'s disk; "
                f"{time.perf_counter() - started:.0f} s so far."
            )
            table = report(runs, machine, command)
            (out / f"{stem}.md").write_text(table)
            raw = {"machine": machine, "command": command, "runs": runs}
            (out / f"{stem}.json").write_text(json.dumps(raw, indent=2, default=str) + "\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(table)
    print(f"results: {out / stem}.md / .json")
    return 0
