"""``python -m benchmarks``: save/load speed against the disk's limit and the alternatives.

Everything is measured in one run, on one machine, side by side: report medians and ratios, not
single absolute times (these machines are shared and noisy). Writes
``benchmarks/results/<date>-<host>.json``, a Markdown table next to it, and a PNG chart.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MiB = 2**20


def disk_limit(directory: Path, size: int, repeats: int) -> dict[str, Any]:
    """Sequential writes with fsync, and reads (cold: the kernel drops the file's pages).

    The writes come one after the other, as a run's saves do. Cloud disks give a burst and then
    a lower sustained speed (here: 1.6 GB/s for the first GB, 0.3 GB/s after four): the first
    write is reported as the burst, the median of the others as ``write_gbps``, the speed a
    run's later saves can reach.
    """
    directory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(8 * MiB)
    writes, reads, cold = [], [], hasattr(os, "posix_fadvise")
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
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            while f.read(8 * MiB):
                pass
        reads.append(time.perf_counter() - start)
    for path in paths:
        path.unlink()
    later = sorted(writes[1:])
    w, r = later[len(later) // 2], sorted(reads)[len(reads) // 2]
    return {
        "bytes": written,
        "write_gbps": written / w / 1e9,
        "burst_write_gbps": written / writes[0] / 1e9,
        "read_gbps": written / r / 1e9,
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

    from lightning_mcore_ckpt import integrity

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
    for key in ("write_gbps", "burst_write_gbps", "read_gbps", "copy_gbps", "hash_gbps"):
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(HERE.parent))
    from benchmarks import dedup, workloads
    from lightning_mcore_ckpt.testing import run_distributed

    scratch = Path(args.dir).resolve()
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    sizes = ["quick"] if args.quick else args.sizes.split(",") + (["4G"] if args.big else [])
    procs = [1] if args.quick else [int(p) for p in args.procs.split(",")]
    device = args.device
    d2h = None
    if device == "cuda":
        d2h = run_distributed(workloads.d2h, 1, {}, timeout=600)[0]
    repeats = 1 if args.quick else args.repeats
    results: dict[str, Any] = {
        "machine": {
            "host": socket.gethostname(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "checkpoint_dir": str(scratch),
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "runs": [],
    }
    for size in sizes:
        hidden, layers = workloads.SIZES[size]
        state_bytes = 3 * 4 * (12 * layers * hidden * hidden)  # weights + 2 Adam moments
        limit = disk_limit(scratch, max(state_bytes, 64 * MiB), repeats)
        limits = [limit]
        for world in procs:
            print(f"== state {size}, {world} process(es)", flush=True)
            cfg = {
                "size": size,
                "repeats": repeats + 1,
                "every": 1 if args.quick else 3,
                "dir": str(scratch / f"{size}-{world}"),
                "device": device,
            }
            figures = run_distributed(workloads.save_load, world, cfg, timeout=3600)[0]
            overhead = workloads.critical_path(
                run_distributed(
                    workloads.step_overhead,
                    world,
                    {
                        "size": size,
                        "steps": 6 if args.quick else 12,
                        "dir": cfg["dir"],
                        "device": device,
                    },
                    timeout=3600,
                )
            )
            # The disk's speed drifts on shared machines: measured before and after each run.
            limits.append(disk_limit(scratch, max(state_bytes, 64 * MiB), repeats))
            limit = _mean_limit(limits[-2:])
            run_ = {
                "size": size,
                "world": world,
                "device": device,
                "limit": limit,
                "methods": figures,
                "step_overhead": overhead,
            }
            if d2h is not None:
                run_["d2h"] = d2h
            results["runs"].append(run_)
            shutil.rmtree(cfg["dir"], ignore_errors=True)
        # A frozen base saved with and without dedup (one process).
        root = scratch / f"{size}-dedup"
        figures = run_distributed(
            dedup.frozen_saves, 1, {"size": size, "dir": str(root), "device": device}, timeout=3600
        )[0]
        results.setdefault("dedup", []).append({"size": size, **figures})
        shutil.rmtree(root, ignore_errors=True)
    results["hf_export"] = [] if args.skip_hf_export else hf_export_scaling(scratch, args.quick)
    shutil.rmtree(scratch, ignore_errors=True)
    return results


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


def _row(name: str, m: dict[str, Any], limit: dict[str, Any], sync_save: float) -> dict[str, Any]:
    save = m["save_s"]["median"]
    out = {
        "method": name,
        "save_s": save,
        "save_spread": (m["save_s"]["min"], m["save_s"]["max"]),
        "blocking_s": m["blocking_s"]["median"],
        "blocking_of_sync": m["blocking_s"]["median"] / sync_save,
        "bytes": m["bytes"],
        "save_gbps": m["bytes"] / save / 1e9,
        "save_vs_limit": m["bytes"] / save / 1e9 / limit["write_gbps"],
        "peak_rss_mib": m["peak_rss_extra"] / MiB,
    }
    if "load_s" in m:
        load = m["load_s"]["median"]
        out.update(
            load_s=load,
            load_gbps=m["bytes"] / load / 1e9,
            load_vs_limit=m["bytes"] / load / 1e9 / limit["read_gbps"],
        )
    return out


def tables(results: dict[str, Any]) -> tuple[str, list[str]]:
    from benchmarks import dedup

    lines = [
        f"Measured {results['date']} on {results['machine']['host']} "
        f"({results['machine']['cpus']} CPUs, {results['machine']['platform']}).",
        "",
    ]
    verdicts = []
    for run_ in results["runs"]:
        limit, methods = run_["limit"], run_["methods"]
        sync_save = methods["ours-sync"]["save_s"]["median"]
        lines += [
            f"### State {run_['size']}, {run_['world']} process(es)",
            "",
            f"Disk limit: write {limit['write_gbps']:.3f} GB/s with fsync sustained (burst "
            f"{limit.get('burst_write_gbps', limit['write_gbps']):.3f} GB/s), read "
            f"{limit['read_gbps']:.3f} GB/s ({limit['read_cache']}), "
            f"{limit['bytes'] / MiB:.0f} MiB file; host memory copy "
            f"{limit['copy_gbps']:.2f} GB/s; XXH3-128 on one thread "
            f"{limit.get('hash_gbps', 0):.1f} GB/s (means of before and after the run).",
            "",
            "| method | save s (median, min-max) | blocking s | blocking / sync save | GB/s | x disk limit | load s | load x read limit | peak extra RSS MiB |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        rows = [
            _row(name, m, limit, sync_save)
            for name, m in methods.items()
            if isinstance(m, dict) and "save_s" in m
        ]
        for r in rows:
            load = f"{r['load_s']:.3f}" if "load_s" in r else "-"
            load_ratio = f"{r['load_vs_limit']:.2f}" if "load_s" in r else "-"
            lines.append(
                f"| {r['method']} | {r['save_s']:.3f} ({r['save_spread'][0]:.3f}-"
                f"{r['save_spread'][1]:.3f}) | {r['blocking_s']:.3f} | {r['blocking_of_sync']:.2f} "
                f"| {r['save_gbps']:.3f} | {r['save_vs_limit']:.2f} | {load} | {load_ratio} | "
                f"{r['peak_rss_mib']:.0f} |"
            )
        by = {r["method"]: r for r in rows}
        side = methods["side by side"]
        if "verified_load_s" in methods["ours-sync"]:
            ours_sync = methods["ours-sync"]
            lines += [
                "",
                f"A cold load that re-hashes every file first (ckpt_verify_hashes=True): "
                f"{ours_sync['verified_load_s']['median']:.3f} s, against "
                f"{ours_sync['load_s']['median']:.3f} s; the re-hash alone (cold) "
                f"{ours_sync['rehash_s']['median']:.3f} s.",
            ]
        lines += [
            "",
            "Sync saves side by side, round after round (median s): "
            + ", ".join(f"{name} {v['median']:.3f}" for name, v in side.items())
            + ".",
        ]
        write = methods["ours-sync"]["write_s"]["median"]
        first = methods["ours-sync"]["first_save_s"], methods["ours-async"]["first_blocking_s"]
        lines += [
            "",
            "Our rows are the steady state (every save but the first). The first save: sync "
            f"{first[0]:.3f} s; async blocking {first[1]:.3f} s.",
            "",
            f"Where a sync save's {sync_save:.3f} s go: {write:.3f} s writing shards and extra "
            f"state (the slowest rank), {sync_save - write:.3f} s planning, staging, finalising "
            "and committing.",
        ]
        if "d2h" in run_:
            lines += [
                "",
                f"Device-to-host copy: {run_['d2h']['pinned_d2h_gbps']:.1f} GB/s into pinned "
                f"memory, {run_['d2h']['pageable_d2h_gbps']:.1f} GB/s into pageable memory.",
            ]
        step = run_["step_overhead"]
        overhead = step["callback_s"] / step["step_s"]
        lines += [
            "",
            f"Step time {step['step_s'] * 1e3:.1f} ms; the callback's own work on a step without "
            f"a save: {step['callback_s'] * 1e6:.0f} us ({overhead:.3%} of the step).",
        ]
        if step.get("ranks", 1) > 1:
            lines += [
                f"That is on the last rank to reach it, which the step waits for; an earlier rank "
                f"waits {step['waiting_s'] * 1e3:.1f} ms there for it (the ranks' skew, which "
                "the next collective would absorb without the callback).",
            ]
        lines += [""]
        checks = targets(run_, by, overhead, limit)
        for name, ok, value in checks:
            verdicts.append(f"{'MET ' if ok else 'MISSED'}  {name}  ({value})")
    for row in results.get("dedup", []):
        dedup_lines, verdict = dedup.report(row["size"], row)
        lines += dedup_lines
        verdicts.append(f"{'MET ' if verdict[1] else 'MISSED'}  {verdict[0]}  ({verdict[2]})")
    lines += hf_table(results["hf_export"])
    lines += ["", "### Targets", "", "```", *verdicts, "```", ""]
    return "\n".join(lines), verdicts


def targets(
    run_: dict[str, Any], by: dict[str, Any], overhead: float, limit: dict[str, Any]
) -> list[tuple[str, bool, str]]:
    """The issue's targets, each as (name, met, measured)."""
    tag = f"{run_['size']}/{run_['world']}p"
    methods = run_["methods"]
    ours, sync = by["ours-sync"], methods["ours-sync"]
    sync_s = sync["save_s"]["median"]
    asy = methods["ours-async"]
    checks = [
        (
            f"{tag}: sync save >= 0.8 x disk write",
            ours["save_vs_limit"] >= 0.8,
            f"{ours['save_vs_limit']:.2f}",
        ),
    ]
    # Against the other libraries: the rounds run side by side (same minute, same disk).
    side = methods["side by side"]
    if "ours, files not hashed" in side:
        # The hashing's own time (the state's bytes at one thread's XXH3 speed, as if no
        # writer thread hashed in parallel) against a sync save; the side-by-side difference
        # is reported with it (on a noisy disk it is within the saves' spread).
        at_disk = limit["write_gbps"] / limit["hash_gbps"]
        in_save = ours["bytes"] / 1e9 / limit["hash_gbps"] / sync_s
        seen = side["ours"]["median"] / side["ours, files not hashed"]["median"] - 1
        checks.append(
            (
                f"{tag}: hashing every file < 5 % of a save at the disk's speed",
                at_disk < 0.05,
                f"{at_disk:.1%} at {limit['write_gbps']:.2f} GB/s, one thread hashing "
                f"{limit['hash_gbps']:.1f} GB/s; {in_save:.1%} of this run's sync save; side "
                f"by side {seen:+.1%}",
            )
        )
    for other in ("plain DCP", "raw dist_checkpointing"):
        ratio = side[other]["median"] / side["ours"]["median"]
        checks.append(
            (f"{tag}: sync save >= {other} (side by side)", ratio >= 1.0, f"{ratio:.2f}x")
        )
    blocking = asy["blocking_s"]["median"] / sync_s
    if run_.get("device", "cpu") == "cuda":
        per_rank = asy["bytes"] / run_["world"] / 1e9
        bound = 1.2 * per_rank / run_["d2h"]["pinned_d2h_gbps"] / sync_s
        checks.append(
            (
                f"{tag}: async blocking <= 1.2 x D2H time",
                blocking <= bound,
                f"{blocking:.1%} of sync; bound {bound:.1%}",
            )
        )
    else:
        # The snapshot is a copy of the state: its floor is disk write / memory copy bandwidth.
        floor = limit["write_gbps"] / limit["copy_gbps"]
        checks.append(
            (
                f"{tag}: async blocking <= 10 % of sync save",
                blocking <= 0.10,
                f"{blocking:.1%}; a copy of the state alone: {floor:.1%}",
            )
        )
    first_async = asy["first_blocking_s"] / sync_s
    first_sync = sync["first_save_s"] / sync_s
    total = asy["save_s"]["median"] / sync_s
    load = ours.get("load_s", float("inf"))
    torch_load = by["torch.save (Lightning default)"].get("load_s", 0.0)
    checks += [
        (f"{tag}: first async blocking <= sync save", first_async <= 1.0, f"{first_async:.2f}"),
        (f"{tag}: first sync save <= 1.2 x later ones", first_sync <= 1.2, f"{first_sync:.2f}"),
        (f"{tag}: async total <= 1.2 x sync save", total <= 1.2, f"{total:.2f}"),
        (
            f"{tag}: cold load >= 0.8 x read limit",
            ours.get("load_vs_limit", 0) >= 0.8,
            f"{ours.get('load_vs_limit', 0):.2f}",
        ),
        (f"{tag}: cold load >= torch.load", load <= torch_load, f"{torch_load / load:.2f}x"),
        (f"{tag}: callback step overhead < 1 %", overhead < 0.01, f"{overhead:.2%}"),
    ]
    return checks


def hf_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "### Hugging Face export",
        "",
        "| model | hidden | layers | model MiB | export s | MB/s | largest slice MiB | "
        "a layer's experts MiB | peak extra RSS MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        kind = f"MoE, {r['experts']} experts, EP=2" if r.get("experts") else "dense"
        stacked = r.get("stacked_experts_bytes", 0)
        experts = f"{stacked / MiB:.0f}" if stacked else "-"
        lines.append(
            f"| {kind} | {r['hidden']} | {r.get('layers', '-')} | {r['bytes'] / MiB:.0f} | "
            f"{r['seconds']:.3f} | {r['bytes'] / 1e6 / r['seconds']:.0f} | "
            f"{r['largest_tensor_bytes'] / MiB:.1f} | "
            f"{experts} | {r['peak_rss_extra'] / MiB:.0f} |"
        )
    return lines


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [n for n, v in runs[0]["methods"].items() if isinstance(v, dict) and "save_s" in v]
    width = 0.8 / len(runs)
    for i, run_ in enumerate(runs):
        m = run_["methods"]
        xs = [j + i * width for j in range(len(names))]
        label = f"{run_['size']}, {run_['world']}p"
        axes[0].bar(xs, [m[n]["save_s"]["median"] for n in names], width, label=label)
        axes[1].bar(
            xs, [m[n]["bytes"] / m[n]["save_s"]["median"] / 1e9 for n in names], width, label=label
        )
        axes[1].axhline(run_["limit"]["write_gbps"], color=f"C{i}", ls="--", lw=1)
    for ax, title in zip(
        axes, ("save time (s, median)", "save throughput (GB/s; dashed: disk)"), strict=True
    ):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))])
        ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--sizes", default="256M,1G", help="states to measure (256M, 1G, 4G)")
    parser.add_argument("--big", action="store_true", help="also the ~4 GiB state")
    parser.add_argument("--procs", default="1,2", help="process counts (TP = processes)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions per measurement")
    parser.add_argument("--quick", action="store_true", help="a tiny state, once: seconds")
    parser.add_argument("--dir", default=str(HERE / ".scratch"), help="checkpoint filesystem")
    parser.add_argument("--out", default=str(HERE / "results"), help="where results go")
    parser.add_argument(
        "--only-hf-export",
        action="store_true",
        help="only the Hugging Face export scaling (dense, and MoE saved with EP=2)",
    )
    parser.add_argument(
        "--skip-hf-export", action="store_true", help="without the Hugging Face export scaling"
    )
    parser.add_argument(
        "--only-dedup", action="store_true", help="only the frozen base with and without dedup"
    )
    parser.add_argument(
        "--only-s3",
        action="store_true",
        help="only the local disk against an S3 server on loopback (benchmarks/s3.py)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model trains (cuda: one process per GPU; adds the D2H bandwidth)",
    )
    from benchmarks import s3

    s3.add_arguments(parser)
    args = parser.parse_args(argv)
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
    if args.device == "cuda" and args.procs == parser.get_default("procs"):
        args.procs = "1"
    results = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{results['date'][:10]}-{results['machine']['host']}" + ("-quick" if args.quick else "")
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    table, _ = tables(results)
    (out / f"{stem}.md").write_text(table)
    chart(results, out / f"{stem}.png")
    print(table)
    print(f"results: {out / stem}.json / .md / .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
