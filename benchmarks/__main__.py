"""``python -m benchmarks``: save/load speed against the disk's limit and the alternatives.

Everything is measured in one run, on one machine, side by side: report medians and ratios, not
single absolute times (these machines are shared and noisy). Writes
``<out>/<date>-<host>[-cuda].json`` and a Markdown table next to it after every configuration
(a run cut short keeps what it measured; the rank measuring a configuration also writes its
figures so far, method after method, to ``<stem>.progress-<size>-<procs>p.json``), and a PNG
chart at the end.

``--device cuda`` trains on one GPU per process. The process that starts the ranks never
initialises CUDA (``lightning_mcore_ckpt.launch.forkserver``); every method is timed on the state
while it is on the GPU it trained on.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.report import _row, chart, hf_table, tables, targets

__all__ = ["_row", "chart", "disk_limit", "hf_table", "main", "run", "tables", "targets"]

HERE = Path(__file__).resolve().parent
MiB = 2**20

# Repetitions per measurement when --repeats is not given. On a GPU, one: the lead's GPU run
# (sizes 1G and 4G) must fit a few minutes of device time.
REPEATS = {"cpu": 3, "cuda": 1}


def _read_streams() -> int:
    """The files our reader reads at once on one rank (``ckpt_read_threads``' default)."""
    from lightning_mcore_ckpt.engine._shards import default_write_threads

    return int(default_write_threads())


def _drop(path: Path) -> None:
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def parallel_read(path: Path, streams: int) -> float:
    """Seconds to read ``path`` cold with ``streams`` threads, each its contiguous share."""
    size = path.stat().st_size
    share = -(-size // streams)
    fd = os.open(path, os.O_RDONLY)

    def read(offset: int) -> None:
        end = min(size, offset + share)
        while offset < end:
            data = os.pread(fd, min(8 * MiB, end - offset), offset)
            if not data:
                return
            offset += len(data)

    try:
        threads = [threading.Thread(target=read, args=(i * share,)) for i in range(streams)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.perf_counter() - start
    finally:
        os.close(fd)


def disk_limit(directory: Path, size: int, repeats: int) -> dict[str, Any]:
    """Sequential writes with fsync, and reads (cold: the kernel drops the file's pages), on one
    stream and on as many streams as our reader uses.

    The writes come one after the other, as a run's saves do. Cloud disks give a burst and then
    a lower sustained speed (here: 1.6 GB/s for the first GB, 0.3 GB/s after four): the first
    write is reported as the burst, the median of the others as ``write_gbps``, the speed a
    run's later saves can reach. ``parallel_read_gbps``: the same bytes read cold by
    ``read_streams`` threads at once, each a contiguous share (the read limit a load is judged
    against).
    """
    directory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(8 * MiB)
    writes, reads, parallel, cold = [], [], [], hasattr(os, "posix_fadvise")
    streams = _read_streams()
    paths = [directory / f"disk-limit-{i}.bin" for i in range(repeats + 1)]
    for path in paths:
        start = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(max(1, size // len(block))):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        writes.append(time.perf_counter() - start)
    written = paths[0].stat().st_size
    for path in paths[1:]:
        with open(path, "rb") as f:
            if cold:
                _drop(path)
            start = time.perf_counter()
            while f.read(8 * MiB):
                pass
        reads.append(time.perf_counter() - start)
        if cold:
            _drop(path)
        parallel.append(parallel_read(path, streams))
    for path in paths:
        path.unlink()
    later = sorted(writes[1:])
    w, r = later[len(later) // 2], sorted(reads)[len(reads) // 2]
    p = sorted(parallel)[len(parallel) // 2]
    return {
        "bytes": written,
        "write_gbps": written / w / 1e9,
        "burst_write_gbps": written / writes[0] / 1e9,
        "read_gbps": written / r / 1e9,
        "parallel_read_gbps": written / p / 1e9,
        "read_streams": streams,
        "copy_gbps": copy_bandwidth(min(size, 2**30), repeats),
        "hash_gbps": hash_bandwidth(min(size, 2**30), repeats),
        "read_cache": "cold (posix_fadvise DONTNEED)" if cold else "warm",
    }


def copy_bandwidth(size: int, repeats: int) -> float:
    """Host memory copy into an allocated buffer (GB/s): an async save's snapshot on CPU."""
    import torch

    source = torch.ones(size // 4)
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return size / sorted(times)[len(times) // 2] / 1e9


def hash_bandwidth(size: int, repeats: int) -> float:
    """XXH3-128 of a buffer on one thread (GB/s): what hashing every file costs a writer."""
    import torch

    from lightning_mcore_ckpt.format import integrity

    data = memoryview(torch.ones(size // 4).view(torch.uint8).numpy())
    times = []
    for _ in range(repeats + 1):
        hasher = integrity._new()
        start = time.perf_counter()
        hasher.update(data)
        times.append(time.perf_counter() - start)
    return size / sorted(times[1:])[len(times[1:]) // 2] / 1e9


def _mean_limit(limits: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(limits[-1])
    for key in (
        "write_gbps",
        "burst_write_gbps",
        "read_gbps",
        "parallel_read_gbps",
        "copy_gbps",
        "hash_gbps",
    ):
        out[key] = sum(limit[key] for limit in limits) / len(limits)
    return out


def _hf_shape(hidden: int, layers: int) -> dict[str, int]:
    """The exported models' shapes: 4x MLP, 64-wide heads, 2 query heads per KV head."""
    return dict(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_layers=layers,
        num_heads=max(2, hidden // 64),
        num_kv_heads=max(1, hidden // 128),
        vocab_size=4096,
    )


def _hf_sizes(quick: bool) -> list[tuple[int, int]]:
    """(hidden, layers): depth grows at a fixed width, then width grows."""
    return [(128, 2)] if quick else [(512, 2), (512, 8), (512, 32), (1024, 8)]


def _moe_sizes(quick: bool) -> list[tuple[int, int, int]]:
    """(hidden, layers, experts) of the MoE exports: experts of 4 x hidden, as the dense MLP."""
    return [(128, 2, 4)] if quick else [(512, 2, 8), (512, 4, 8)]


def _since(start: float) -> str:
    return f"{time.perf_counter() - start:.0f} s"


class Results:
    """The run's results so far, written (JSON, then the Markdown tables) after every
    configuration, so that a run cut short keeps what it measured."""

    def __init__(self, out: Path, stem: str, data: dict[str, Any]) -> None:
        self.out, self.stem, self.data = out, stem, data

    def progress(self, size: str, world: int) -> Path:
        """Where the ranks measuring a configuration write their figures so far."""
        return self.out / f"{self.stem}.progress-{size}-{world}p.json"

    def write(self) -> str:
        from benchmarks import report

        self.out.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.data, indent=2, default=str) + "\n"
        (self.out / f"{self.stem}.json").write_text(text)
        table, _ = report.tables(self.data)
        (self.out / f"{self.stem}.md").write_text(table)
        return table


def _attempt(results: Results, what: str, fn: Any) -> Any:
    """``fn()``; when a configuration fails, its error is recorded and the run goes on."""
    from lightning_mcore_ckpt.testing import DistributedFailure

    try:
        return fn()
    except DistributedFailure as failure:
        print(f"!! {what} failed:\n{str(failure)[-4000:]}", file=sys.stderr, flush=True)
        results.data.setdefault("errors", []).append({"what": what, "error": str(failure)[-8000:]})
        results.write()
        return None


def run(args: argparse.Namespace, results: Results) -> None:
    sys.path.insert(0, str(HERE.parent))
    from benchmarks import dedup, restart, workloads
    from lightning_mcore_ckpt.testing import run_distributed

    data = results.data
    scratch = Path(args.dir).resolve()
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    sizes = ["quick"] if args.quick else args.sizes.split(",") + (["4G"] if args.big else [])
    procs = [1] if args.quick else [int(p) for p in args.procs.split(",")]
    device = args.device
    repeats = 1 if args.quick else args.repeats
    d2h = None
    if device == "cuda":
        d2h = _attempt(
            results, "d2h", lambda: run_distributed(workloads.d2h, 1, {}, timeout=600)[0]
        )
        data["d2h"] = d2h
        results.write()
    for size in sizes:
        hidden, layers = workloads.SIZES[size]
        state_bytes = 3 * 4 * (12 * layers * hidden * hidden)  # weights + 2 Adam moments
        limits = [disk_limit(scratch, max(state_bytes, 64 * MiB), repeats)]
        for world in procs:
            started = time.perf_counter()
            print(f"== state {size}, {world} process(es), {device}", flush=True)
            cfg = {
                "size": size,
                "repeats": repeats,
                "saves": repeats + 1,
                "every": 1 if args.quick else 3,
                "dir": str(scratch / f"{size}-{world}"),
                "device": device,
                "verify": device == "cpu",
                "progress": str(results.progress(size, world)),
                "stacks_after_s": args.stacks_after,
            }
            figures = _attempt(
                results,
                f"save_load {size}/{world}p",
                lambda cfg=cfg, world=world: run_distributed(
                    workloads.save_load, world, cfg, timeout=3600
                )[0],
            )
            overhead_cfg = {
                "size": size,
                "steps": 6 if args.quick else 12,
                "dir": cfg["dir"],
                "device": device,
            }
            ranks = _attempt(
                results,
                f"step_overhead {size}/{world}p",
                lambda c=overhead_cfg, world=world: run_distributed(
                    workloads.step_overhead, world, c, timeout=3600
                ),
            )
            # The disk's speed drifts on shared machines: measured before and after each run.
            limits.append(disk_limit(scratch, max(state_bytes, 64 * MiB), repeats))
            shutil.rmtree(cfg["dir"], ignore_errors=True)
            if figures is not None:
                run_: dict[str, Any] = {
                    "size": size,
                    "world": world,
                    "device": device,
                    "limit": _mean_limit(limits[-2:]),
                    "methods": figures,
                }
                if ranks is not None:
                    run_["step_overhead"] = workloads.critical_path(ranks)
                if d2h is not None:
                    run_["d2h"] = d2h
                run_["elapsed_s"] = time.perf_counter() - started
                data["runs"].append(run_)
            results.write()
            print(f"== state {size}, {world} process(es): {_since(started)}", flush=True)
            if world == 1 and not args.skip_restart:
                print(f"== restart, state {size}, {device}", flush=True)
                root = scratch / f"{size}-restart"
                row = _attempt(
                    results,
                    f"restart {size}",
                    lambda root=root, size=size: restart.restart_times(root, size, device, repeats),
                )
                shutil.rmtree(root, ignore_errors=True)
                if row is not None:
                    data.setdefault("restart", []).append(row)
                results.write()
                print(f"== restart, state {size}: {_since(started)} since the state's start")
        if not args.skip_dedup:
            # A frozen base saved with and without dedup (one process).
            root = scratch / f"{size}-dedup"
            config = {"size": size, "dir": str(root), "device": device}
            figures = _attempt(
                results,
                f"dedup {size}",
                lambda c=config: run_distributed(dedup.frozen_saves, 1, c, timeout=3600)[0],
            )
            if figures is not None:
                data.setdefault("dedup", []).append({"size": size, **figures})
            shutil.rmtree(root, ignore_errors=True)
            results.write()
    data["hf_export"] = [] if args.skip_hf_export else hf_export_scaling(scratch, args.quick)
    results.write()
    shutil.rmtree(scratch, ignore_errors=True)


def hf_export_scaling(scratch: Path, quick: bool) -> list[dict[str, Any]]:
    from benchmarks import workloads
    from lightning_mcore_ckpt import hf
    from lightning_mcore_ckpt.testing import run_distributed
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    rows = []
    for hidden, layers in _hf_sizes(quick):
        root = scratch / f"hf-{hidden}-{layers}"
        tiny_hf_model(root / "src", "qwen2", **_hf_shape(hidden, layers))
        hf.import_checkpoint(root / "src", root / "imported")
        figures = run_distributed(workloads.hf_export, 1, {"dir": str(root)}, timeout=3600)[0]
        figures["hidden"] = hidden
        figures["layers"] = layers
        rows.append(figures)
        shutil.rmtree(root, ignore_errors=True)
    for hidden, layers, experts in _moe_sizes(quick):
        # Saved with its experts split over 2 processes (EP=2), exported on one.
        root = scratch / f"moe-{hidden}-{layers}-{experts}"
        tiny_hf_model(root / "src", "qwen2_moe", num_experts=experts, **_hf_shape(hidden, layers))
        run_distributed(workloads.moe_save, 2, {"dir": str(root)}, timeout=3600)
        cfg = {"dir": str(root), "step": "ckpt/global_step_1"}
        figures = run_distributed(workloads.hf_export, 1, cfg, timeout=3600)[0]
        figures.update(hidden=hidden, layers=layers, experts=experts)
        rows.append(figures)
        shutil.rmtree(root, ignore_errors=True)
    return rows


def _only_dedup(args: argparse.Namespace) -> int:
    from benchmarks import dedup
    from lightning_mcore_ckpt.testing import run_distributed

    scratch = Path(args.dir).resolve()
    shutil.rmtree(scratch, ignore_errors=True)
    rows, lines, verdicts = [], [], []
    for size in ["quick"] if args.quick else args.sizes.split(","):
        root = scratch / f"{size}-dedup"
        config = {"size": size, "dir": str(root), "device": args.device}
        figures = run_distributed(dedup.frozen_saves, 1, config, timeout=3600)[0]
        rows.append({"size": size, **figures})
        more, verdict = dedup.report(size, figures)
        lines += more
        verdicts.append(f"{'MET ' if verdict[1] else 'MISSED'}  {verdict[0]}  ({verdict[2]})")
    shutil.rmtree(scratch, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.date.today()}-{socket.gethostname()}-dedup"
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=2) + "\n")
    table = "\n".join([*lines, "```", *verdicts, "```", ""])
    (out / f"{stem}.md").write_text(table)
    print(table)
    return 0


def _scale(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--scale``: checks its arguments, then ``benchmarks.scale.run``."""
    from benchmarks import scale

    args.sizes = args.sizes or "256M"
    args.procs = args.procs or "2,4,8"
    if args.device != "cpu":
        parser.error(f"--scale --device {args.device}: the scale mode runs on the CPU (gloo)")
    if args.sizes not in ("256M", "1G", "4G"):
        parser.error(f"--scale --sizes {args.sizes}: pass one state, 256M, 1G or 4G")
    try:
        worlds = [int(p) for p in args.procs.split(",")]
    except ValueError:
        parser.error(f"--scale --procs {args.procs}: pass rank counts, e.g. 2,4,8")
    if len(worlds) < 2 or min(worlds) < 1 or (args.shard == "tp" and any(8 % w for w in worlds)):
        parser.error(
            f"--scale --procs {args.procs}: pass two or more rank counts of at least 1"
            + (" that divide 8 (the heads split by --shard tp)" if args.shard == "tp" else "")
        )
    if args.saves < 3:
        parser.error(f"--scale --saves {args.saves}: pass 3 or more (steady saves are measured)")
    sys.path.insert(0, str(HERE.parent))
    size = "quick" if args.quick else args.sizes
    stem = _free_stem(args.out, f"scale-{size}-{args.shard}")
    machine = {**_machine(), "checkpoint_dir": str(Path(args.dir).resolve())}

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    # A time limit's SIGTERM: the ranks are killed (run_distributed's cleanup); the rank
    # counts measured so far are already written.
    signal.signal(signal.SIGTERM, stop)
    return scale.run(args, machine, stem)


def _scale_sim(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--scale-sim``: checks its arguments, then ``benchmarks.scale_sim.run``."""
    from benchmarks import scale_sim

    args.procs = args.procs if args.procs is not None else "64,256,1024"
    try:
        worlds = [int(p) for p in args.procs.split(",") if p]
    except ValueError:
        parser.error(f"--scale-sim --procs {args.procs}: pass rank counts, e.g. 64,256,1024")
    if any(w < 32 or w % 32 for w in worlds):
        parser.error(
            f"--scale-sim --procs {args.procs}: pass multiples of 32 (TP 8 x PP 4 x DP), "
            "e.g. 64,256,1024"
        )
    if args.check:
        try:
            world, tp, pp = (int(x) for x in args.check.split(","))
        except ValueError:
            parser.error(f"--check {args.check}: pass RANKS,TP,PP, e.g. 8,2,2")
        if world % (tp * pp) or world > 8:
            parser.error(f"--check {args.check}: at most 8 ranks, a multiple of TP x PP")
    sys.path.insert(0, str(HERE.parent))
    return scale_sim.run(args, _machine(), _free_stem(args.out, "scale-sim"))


def _free_stem(out: str, kind: str) -> str:
    """``<date>-<host>-<kind>``, numbered past the results an earlier run left in ``out``."""
    now = datetime.datetime.now(datetime.timezone.utc)
    stem = f"{now.date()}-{socket.gethostname()}-{kind}"
    taken = 1
    while (Path(out) / f"{stem}.json").exists():  # an earlier run's results stay
        taken += 1
        stem = f"{now.date()}-{socket.gethostname()}-{kind}-{taken}"
    return stem


def _machine() -> dict[str, object]:
    """The machine and versions a result file records."""
    return {
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        **_versions(),
    }


def _cuda_problem(procs: list[int]) -> str | None:
    """Why ``--device cuda`` cannot run here, or ``None``. Asked in this process, which starts
    no rank itself (the ranks are forked from a server that never touches CUDA)."""
    import torch

    if not torch.cuda.is_available():
        built = (
            f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
        )
        return (
            f"no CUDA device is visible to torch on this machine (torch {torch.__version__}, "
            f"{built}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}"
            "). Run it on a machine with a GPU, or measure the CPU with --device cpu"
        )
    count = torch.cuda.device_count()
    if max(procs) > count:
        return (
            f"--procs {','.join(map(str, procs))} needs {max(procs)} GPUs (one per process); "
            f"this machine has {count}: pass --procs {count}"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument(
        "--sizes", default=None, help="states to measure (256M, 1G, 4G; default 256M,1G)"
    )
    parser.add_argument("--big", action="store_true", help="also the ~4 GiB state")
    parser.add_argument(
        "--procs",
        default=None,
        help="process counts (TP = processes; default 1,2; cuda: 1; --scale: 2,4,8)",
    )
    parser.add_argument(
        "--scale",
        action="store_true",
        help="the same total state (one of --sizes, default 256M) saved and loaded at each of "
        "--procs ranks, CPU: save, blocking, load, planning and coordination per save, with and "
        "without cached plans, files and metadata per step (benchmarks/scale.py)",
    )
    parser.add_argument(
        "--scale-sim",
        action="store_true",
        help="a save's collectives, planning and metadata at --procs simulated ranks (default "
        "64,256,1024; torch's fake process group, every rank's collectives recorded and "
        "replayed on rank 0 and the last rank; benchmarks/scale_sim.py)",
    )
    parser.add_argument(
        "--check",
        default="8,2,2",
        help="--scale-sim: first a real gloo run of RANKS,TP,PP against its simulation "
        "(default 8,2,2; empty: none)",
    )
    parser.add_argument(
        "--shard",
        choices=("tp", "dp"),
        default="tp",
        help="--scale: how the state is split over the ranks (tp: tensor parallel over every "
        "rank; dp: data parallel, AdamW, the replicas' writes spread over the ranks)",
    )
    parser.add_argument(
        "--saves", type=int, default=6, help="--scale: saves per fit (3 or more; default 6)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"repetitions per measurement (default {REPEATS['cpu']}; {REPEATS['cuda']} on cuda)",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny state, once: seconds")
    parser.add_argument("--dir", default=str(HERE / ".scratch"), help="checkpoint filesystem")
    parser.add_argument("--out", default=str(HERE / "results"), help="where results go")
    parser.add_argument(
        "--only-hf-export",
        action="store_true",
        help="only the Hugging Face export scaling (dense, and MoE saved with EP=2)",
    )
    parser.add_argument(
        "--skip-hf-export",
        action="store_true",
        help="without the Hugging Face export scaling (always skipped on cuda: it runs on CPU)",
    )
    parser.add_argument(
        "--only-dedup", action="store_true", help="only the frozen base with and without dedup"
    )
    parser.add_argument(
        "--skip-dedup",
        action="store_true",
        help="without the frozen base with and without dedup (skipped on cuda unless --dedup)",
    )
    parser.add_argument("--dedup", action="store_true", help="on cuda: with the dedup rows")
    parser.add_argument(
        "--skip-restart",
        action="store_true",
        help="without the restart rows (launch -> first resumed step)",
    )
    parser.add_argument(
        "--only-s3",
        action="store_true",
        help="only the local disk against an S3 server on loopback (benchmarks/s3.py)",
    )
    parser.add_argument(
        "--only-fast-tier",
        action="store_true",
        help="only the fast tier against the persistent one on 2 simulated nodes: recovery "
        "time (own copies, a peer's copies, the persistent tier), blocking per save, steps lost "
        "(one of --sizes, default 1G; benchmarks/fast_tier.py)",
    )
    parser.add_argument(
        "--only-loads",
        action="store_true",
        help="only cold loads side by side (ours, torch.load, plain DCP, raw dist_checkpointing "
        "and the files' cold reads) in 2 x --repeats rounds that alternate the methods' order, "
        "our load's phases timed apart (--sizes, default 1G; --procs, default 1,2; "
        "benchmarks/load_rounds.py)",
    )
    parser.add_argument(
        "--optimizers",
        default=None,
        help="--only-loads: the optimizers the state is trained with (adamw: torch AdamW; "
        "distributed: Megatron-Core's distributed optimizer over Megatron DDP; "
        "distributed-bf16: the same over bf16 weights with fp32 main parameters, as "
        "Megatron-LM trains; default all three); --only-fast-tier: one of them (default adamw)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model trains (cuda: one process per GPU; adds the D2H bandwidth)",
    )
    parser.add_argument(
        "--stacks-after",
        type=float,
        default=None,
        help="seconds after which a fit of ours that has not returned prints every thread's "
        "stack to stderr, and again each time as long (default: 120 on cuda, never on cpu; 0: "
        "never)",
    )
    from benchmarks import s3

    s3.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = REPEATS[args.device]
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: pass 1 or more")
    if args.scale:
        return _scale(parser, args)
    if args.scale_sim:
        return _scale_sim(parser, args)
    if args.only_loads:
        from benchmarks import load_rounds

        return load_rounds.run(args)
    if args.only_fast_tier:
        from benchmarks import fast_tier

        if args.device != "cpu":
            parser.error(f"--only-fast-tier --device {args.device}: it runs on the CPU (gloo)")
        return fast_tier.run(args)
    if args.sizes is None:
        args.sizes = "256M,1G"
    if args.procs is None:
        args.procs = "1" if args.device == "cuda" else "1,2"
    if args.stacks_after is None:
        args.stacks_after = 120.0 if args.device == "cuda" else 0.0
    if args.stacks_after < 0 or args.stacks_after != args.stacks_after:
        parser.error(f"--stacks-after {args.stacks_after}: pass seconds >= 0 (0: never)")
    if args.only_s3:
        return s3.run(args)
    if args.only_hf_export:
        scratch = Path(args.dir).resolve()
        shutil.rmtree(scratch, ignore_errors=True)
        sys.path.insert(0, str(HERE.parent))
        rows = hf_export_scaling(scratch, args.quick)
        shutil.rmtree(scratch, ignore_errors=True)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"{datetime.date.today()}-{socket.gethostname()}-hf-export"
        (out / f"{stem}.json").write_text(json.dumps(rows, indent=2) + "\n")
        table = "\n".join(hf_table(rows)) + "\n"
        (out / f"{stem}.md").write_text(table)
        print(table)
        return 0
    if args.only_dedup:
        return _only_dedup(args)
    unknown = [s for s in args.sizes.split(",") if s not in ("256M", "1G", "4G")]
    if unknown:
        parser.error(f"--sizes {args.sizes}: unknown {unknown}; use 256M, 1G, 4G")
    try:
        procs = [int(p) for p in args.procs.split(",")]
    except ValueError:
        parser.error(f"--procs {args.procs}: pass process counts, e.g. 1,2")
    if args.device == "cuda":
        problem = _cuda_problem([1] if args.quick else procs)
        if problem:
            print(f"python -m benchmarks --device cuda: {problem}", file=sys.stderr)
            return 2
        # CPU-side figures, measured by the CPU run: not worth a GPU's minutes.
        args.skip_hf_export = True
        args.skip_dedup = args.skip_dedup or not args.dedup
    now = datetime.datetime.now(datetime.timezone.utc)
    host = socket.gethostname()
    stem = f"{now.date()}-{host}" + ("-cuda" if args.device == "cuda" else "")
    stem += "-quick" if args.quick else ""
    data: dict[str, Any] = {
        "machine": {
            "host": host,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "checkpoint_dir": str(Path(args.dir).resolve()),
            **_versions(),
        },
        "date": now.isoformat(timespec="seconds"),
        "device": args.device,
        "repeats": 1 if args.quick else args.repeats,
        "runs": [],
    }
    results = Results(Path(args.out), stem, data)

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    # A time limit's SIGTERM: the ranks are killed (run_distributed's cleanup) and what was
    # measured is written, with the run marked as cut short.
    signal.signal(signal.SIGTERM, stop)
    try:
        run(args, results)
    except (SystemExit, KeyboardInterrupt):
        data["cut_short"] = True
        results.write()
        raise
    table = results.write()
    from benchmarks import report

    report.chart(data, results.out / f"{stem}.png")
    print(table)
    print(f"results: {results.out / stem}.json / .md / .png")
    return 1 if data.get("errors") else 0


def _versions() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    versions: dict[str, Any] = {}
    for name in ("torch", "lightning", "megatron-core", "nvidia-resiliency-ext"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return versions


if __name__ == "__main__":
    sys.exit(main())
