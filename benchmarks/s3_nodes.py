"""Uploads of one step from 1 node and from several simulated nodes, side by side:
``python -m benchmarks --only-s3 --nodes 1,2``.

The same step (shard-like ``*.distcp`` files, an equal share written by each node) is committed
to an S3 server on loopback, as the callback's commit does it (``StoreTier``: the seal, then the
publication), in alternating rounds:

- **1 node**: the whole step in one directory, as on a shared file system; one process seals it
  and uploads all of it (``StoreTier.publish`` -> ``publication.publish_step``);
- **N nodes** (``testing.run_nodes`` with a ``node_dir``: each node's share in its own node-local
  directory, the same path on every node): every node's leader uploads its part at once
  (``StoreTier.part_upload`` on the others, ``StoreTier.gather_parts`` on global rank 0:
  ``node_parts.upload_part``, ``await_parts``, ``merge_parts``); rank 0 then seals the step with
  the other nodes' files and writes the marker (``StoreTier.publish`` ->
  ``publication.publish_parts``).

The files are written, fsynced and hashed before the clock starts (the ranks' writes and
digests); the time runs from the moment every node is ready (a barrier) to the marker's write.
The S3 server's CPU time and the machine's over that window are recorded, to tell whether the
server or the machine was the limit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.report import machine_line

HERE = Path(__file__).resolve().parent
MiB = 2**20
_BLOCK = 8 * MiB
_TICK = os.sysconf("SC_CLK_TCK")


def parse_nodes(text: str, files: int) -> list[int]:
    """``--nodes``: node counts, each dividing the step's ``files``; a clear error else."""
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        raise ValueError(f"--nodes {text}: pass node counts, e.g. 1,2") from None
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise ValueError(f"--nodes {text}: pass distinct node counts of at least 1, e.g. 1,2")
    uneven = [n for n in counts if files % n]
    if uneven:
        raise ValueError(
            f"--nodes {text}: {uneven} do not divide the step's {files} files; pass counts "
            f"that do (e.g. 1,2)"
        )
    return counts


# --- CPU accounting (Linux /proc) ------------------------------------------------------------


def process_cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def machine_cpu() -> tuple[float, float]:
    """The machine's (busy, total) CPU seconds since boot, over every CPU."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    total = sum(values[:8])  # guest time is counted in user already
    return (total - idle) / _TICK, total / _TICK


class Window:
    """The CPU the S3 server, this process and the machine used between ``start`` and ``stop``."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid

    def start(self) -> Window:
        self._server = process_cpu_s(self.server_pid)
        self._own = time.process_time()
        self._busy, _ = machine_cpu()
        self._wall = time.perf_counter()
        return self

    def stop(self) -> dict[str, float]:
        wall = time.perf_counter() - self._wall
        busy, _ = machine_cpu()
        return {
            "seconds": wall,
            "server_cpu_s": process_cpu_s(self.server_pid) - self._server,
            "client_cpu_s": time.process_time() - self._own,
            "machine_busy_s": busy - self._busy,
        }


# --- a node's share of the step --------------------------------------------------------------


def write_share(step: Path, node: int, files: int, file_size: int) -> dict[str, str]:
    """Node ``node``'s shard files of ``step`` (``model/__<node>_<i>.distcp``), each fsynced,
    then hashed as a rank's writer records them; their digests by path relative to the step."""
    from lightning_mcore_ckpt.format import integrity

    model = step / "model"
    model.mkdir(parents=True, exist_ok=True)
    hashes = {}
    for i in range(files):
        path = model / f"__{node}_{i}.distcp"
        with open(path, "wb") as f:
            left = file_size
            while left:
                chunk = os.urandom(min(_BLOCK, left))
                f.write(chunk)
                left -= len(chunk)
            f.flush()
            os.fsync(f.fileno())
        hashes[f"model/{path.name}"] = integrity.hash_file(path)
    return hashes


def _tier(url: str, root: Path, config: dict[str, Any]) -> Any:
    from lightning_mcore_ckpt.storage.object_store import ObjectStore
    from lightning_mcore_ckpt.storage.store_tier import StoreTier

    store = ObjectStore.from_url(
        url, concurrency=config["concurrency"], part_size=config["part_mb"] * MiB
    )
    return StoreTier(store, root, durability="store", staging=False)


def _seal(step: Path, number: int, hashes: dict[str, str], parts: Any = None) -> float:
    from lightning_mcore_ckpt.storage.seal import seal_step

    started = time.perf_counter()
    seal_step(step, {"global_step": number, "hashes": hashes}, parts=parts)
    return time.perf_counter() - started


def one_node(scratch: Path, url: str, number: int, config: dict[str, Any]) -> dict[str, Any]:
    """The whole step in one directory, sealed and published by this one process."""
    root = scratch / "one-node"
    step = root / f"global_step_{number}"
    nodes, per_node = config["split"], config["files"] // config["split"]
    hashes: dict[str, str] = {}
    for node in range(nodes):
        hashes.update(write_share(step, node, per_node, config["file_size"]))
    tier = _tier(url, root, config)
    window = Window(config["server_pid"]).start()
    seal_s = _seal(step, number, hashes)
    figures = tier.publish(step, first=True)
    row = window.stop()
    shutil.rmtree(root, ignore_errors=True)
    return {
        **row,
        "nodes": 1,
        "seal_s": seal_s,
        "bytes": int(figures["upload_bytes"]),
        "node_upload_s": [float(figures["upload_time_s"])],
        "node_bytes": [int(figures["upload_bytes"])],
        "upload_nodes": 1,
    }


def node_rank(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """One simulated node's leader (one rank per node): its share written into its node-local
    directory, then, from the barrier on, its part uploaded; rank 0 also gathers every node's
    confirmation, seals the step and publishes it."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        root = Path(config["node_dir"]) / "tier"
        number = config["number"]
        step = root / f"global_step_{number}"
        per_node = config["files"] // world_size
        mine = write_share(step, rank, per_node, config["file_size"])
        recorded: list[dict[str, str]] = [{} for _ in range(world_size)]
        dist.all_gather_object(recorded, mine)  # every rank's digests, as the commit record
        hashes = {k: v for part in recorded for k, v in part.items()}
        tier = _tier(config["url"], root, config)
        tier.share_nodes(list(range(world_size)), rank, timeout_s=config["parts_timeout_s"])
        dist.barrier()
        window = Window(config["server_pid"]).start()
        started = time.perf_counter()
        if rank == 0:
            parts = tier.gather_parts(step, hashes)  # its own part, then the others' confirmations
            gathered = time.perf_counter() - started
            # Each node's own upload, as its confirmation says (rank 0's gather also waits).
            confirmed = tier._parts[step.name]
            uploads = [float(c["upload_time_s"]) for c in confirmed]
            node_bytes = [int(c["upload_bytes"]) for c in confirmed]
            seal_s = _seal(step, number, mine, parts)
            figures = tier.publish(step, first=True)
        else:
            tier.part_upload(step, hashes)()
        row = window.stop()
        cpu: list[float] = [0.0] * world_size
        dist.all_gather_object(cpu, row["client_cpu_s"])
        shutil.rmtree(step, ignore_errors=True)
        if rank != 0:
            return {}
        return {
            **row,
            "nodes": world_size,
            "seal_s": seal_s,
            "gather_s": gathered,
            "bytes": int(figures["upload_bytes"]),
            "upload_nodes": int(figures["upload_nodes"]),
            "node_upload_s": uploads,
            "node_bytes": node_bytes,
            "client_cpu_s": sum(cpu),
        }
    finally:
        dist.destroy_process_group()


def several_nodes(
    scratch: Path, url: str, number: int, nodes: int, config: dict[str, Any], env: dict[str, str]
) -> dict[str, Any]:
    from lightning_mcore_ckpt.testing import run_nodes

    node_dir = scratch / "node-local"
    cfg = {**config, "url": url, "number": number, "node_dir": str(node_dir)}
    out = run_nodes(node_rank, nodes, 1, cfg, node_dir=node_dir, env=env, timeout=1800)
    shutil.rmtree(node_dir.with_name(f"{node_dir.name}.nodes"), ignore_errors=True)
    return out[0]  # type: ignore[no-any-return]


def measure(
    scratch: Path,
    counts: list[int],
    total: int,
    files: int,
    repeats: int,
    concurrency: int,
    part_mb: int,
) -> dict[str, Any]:
    """Every node count, ``repeats`` rounds; each round runs every count in turn, the order
    reversed every other round (a drift of the machine weighs on each alike)."""
    sys.path.insert(0, str(HERE.parent / "tests" / "storage"))
    from _s3server import S3Server

    from lightning_mcore_ckpt.storage import publication
    from lightning_mcore_ckpt.storage.object_store import ObjectStore

    server = S3Server(scratch / "server").start()
    assert server._proc is not None
    env = server.env()
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    config = {
        "files": files,
        "file_size": total // files,
        "split": max(counts),
        "concurrency": concurrency,
        "part_mb": part_mb,
        "server_pid": server._proc.pid,
    }
    config["parts_timeout_s"] = 60.0 if total <= 64 * MiB else 600.0  # a node lost: named
    rows: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        server.create_bucket(bucket)
        for r in range(1, repeats + 1):
            for n in counts if r % 2 else counts[::-1]:
                url = f"s3://{bucket}/{n}-nodes"
                if n == 1:
                    row = one_node(scratch, url, r, config)
                else:
                    row = several_nodes(scratch, url, r, n, config, env)
                store = ObjectStore.from_url(url)
                assert r in publication.published_steps(store), (n, r)
                publication.remove_published(store, r)  # the server keeps objects in memory
                rows[n].append(row)
                print(
                    f"round {r}, {n} node(s): {row['seconds']:.2f}s, "
                    f"{row['bytes'] / row['seconds'] / 1e9:.3f} GB/s, server CPU "
                    f"{row['server_cpu_s'] / row['seconds']:.2f} cores",
                    flush=True,
                )
    finally:
        server.stop()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return {
        "bytes": total,
        "files": files,
        "concurrency": concurrency,
        "part_mb": part_mb,
        "rows": rows,
    }


def report(result: dict[str, Any], machine: str) -> str:
    rows: dict[int, list[dict[str, Any]]] = result["rows"]
    counts = list(rows)
    first = rows[counts[0]]

    def med(n: int, key: str) -> float:
        return statistics.median(r[key] for r in rows[n])

    def per_s(n: int, key: str) -> float:  # a CPU time over the window: cores in use
        return statistics.median(r[key] / r["seconds"] for r in rows[n])

    size = result["bytes"] / MiB
    base = counts[0]
    lines = [
        f"### Uploads of one step from 1 and {', '.join(map(str, counts[1:])) or '-'} nodes "
        f"({size:.0f} MiB in {result['files']} shard files)",
        "",
        machine,
        "",
        f"Median of {len(first)} round{'s' if len(first) > 1 else ''}; each round publishes the same step at every node count "
        "in turn (the order reversed every other round). Uploads: "
        f"{result['concurrency']} requests per file, {result['part_mb']} MiB parts, up to 4 "
        "files at once per uploading process. 1 node: one process seals and uploads the whole "
        "step (`publication.publish_step`), as on a shared file system. N nodes: simulated "
        "nodes (`testing.run_nodes`, a node-local directory each), each node's leader uploads "
        "its share at once (`node_parts.upload_part`), rank 0 awaits the others' confirmations "
        "(`await_parts`), seals, and writes the marker (`publication.publish_parts`). The time "
        "runs from every node ready (files written, fsynced, hashed) to the marker.",
        "",
        f"| nodes | s (median) | min\u2013max s | GB/s | vs {base} node"
        f"{'s' if base > 1 else ''} | each node's upload, s | seal, s | S3 server CPU, cores "
        "| uploaders' CPU, cores | machine busy, cores |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n in counts:
        values = [r["seconds"] for r in rows[n]]
        gbps = med(n, "bytes") / med(n, "seconds") / 1e9
        ratio = med(base, "seconds") / med(n, "seconds")
        uploads = [statistics.median(r["node_upload_s"][i] for r in rows[n]) for i in range(n)]
        lines.append(
            f"| {n} | {med(n, 'seconds'):.3f} | {min(values):.3f}\u2013{max(values):.3f} | "
            f"{gbps:.3f} | {'—' if n == base else f'{ratio:.2f}x the rate'} | "
            f"{' / '.join(f'{u:.2f}' for u in uploads)} | {med(n, 'seal_s'):.3f} | "
            f"{per_s(n, 'server_cpu_s'):.2f} | {per_s(n, 'client_cpu_s'):.2f} | "
            f"{per_s(n, 'machine_busy_s'):.2f} |"
        )
    lines += [
        "",
        "CPU columns: CPU seconds over the window's seconds (1.00 = one core busy the whole "
        "time); the uploaders' is every uploading process's together; the machine's counts "
        "everything that ran on it, other jobs included.",
        "",
        "The server is moto on 127.0.0.1: one Python process (its request threads share one "
        "interpreter lock) on the same machine as the uploaders. These figures show whether the "
        "client path uploads a step's parts in parallel across nodes, not a real object store's "
        "bandwidth: where the server is near one core, it is the limit, and more nodes cannot "
        "go faster here.",
        "",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``--only-s3 --nodes ...``: the table, written to ``--out``."""
    from lightning_mcore_ckpt.testing import nodes_unavailable

    files = 4 if args.quick else args.s3_files
    try:
        counts = parse_nodes(args.nodes, files)
    except ValueError as err:
        print(f"python -m benchmarks --only-s3: {err}", file=sys.stderr)
        return 2
    why = nodes_unavailable() if max(counts) > 1 else None
    if why is not None:
        print(f"python -m benchmarks --only-s3 --nodes {args.nodes}: {why}", file=sys.stderr)
        return 2
    scratch = Path(args.dir).resolve() / "s3-nodes"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    total = 8 * MiB if args.quick else args.s3_mib * MiB
    repeats = 1 if args.quick else args.repeats
    try:
        result = measure(
            scratch, counts, total, files, repeats, args.s3_concurrency, args.s3_part_mb
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    machine = machine_line(f"the files on `{args.dir}`'s disk, the S3 server on loopback.")
    table = report(result, machine)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{time.strftime('%Y-%m-%d', time.gmtime())}-{socket.gethostname()}-s3-nodes" + (
        "-quick" if args.quick else ""
    )
    (out / f"{stem}.md").write_text(table)
    (out / f"{stem}.json").write_text(json.dumps({"machine": machine, **result}, indent=2) + "\n")
    print(table)
    print(f"results: {out / stem}.md / .json")
    return 0
