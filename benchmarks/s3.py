"""Object storage against the local disk, side by side: ``python -m benchmarks --only-s3``
(or ``python -m benchmarks.s3``).

A checkpoint-sized step (shard-like ``*.distcp`` files plus a commit marker) is

- written to the local disk with fsync, and read back cold (``posix_fadvise(DONTNEED)``);
- published to an S3 server on loopback (``publication.publish_step``: every object, the listing
  check, the marker, the tracker), then read back through a view of the store
  (``store_views.open_view``: each shard a remote file, read by ranged GETs through
  ``remote_files.open_read``), and downloaded whole (``ObjectStore.download``).

The server is moto (``tests/storage/_s3server.py``): an in-memory Python server on the same
machine. It measures this package's client path and the protocol's overhead, not the bandwidth
of a real object store.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MiB = 2**20
CHUNK = 8 * MiB  # one read() of the readers (a ranged GET of that size through a view)


def _write_step(step: Path, files: int, file_size: int, block: bytes) -> float:
    """A committed step of ``files`` shard-like files, each fsynced, then its marker; seconds."""
    start = time.perf_counter()
    model = step / "model"
    model.mkdir(parents=True)
    sizes = {}
    for i in range(files):
        path = model / f"__{i}_0.distcp"
        with open(path, "wb") as f:
            for _ in range(file_size // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        sizes[f"model/{path.name}"] = file_size
    number = int(step.name.rsplit("_", 1)[1])
    marker = {"global_step": number, "files": sizes, "saved_at": time.time()}
    tmp = step / "metadata.json.tmp"
    with open(tmp, "w") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step / "metadata.json")
    fd = os.open(step, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def _read_all(paths: list[Path], opener: Any, chunk: int = CHUNK) -> float:
    """Every file read whole, ``chunk`` bytes per ``read()``; seconds."""
    start = time.perf_counter()
    for path in paths:
        with opener(path) as f:
            while f.read(chunk):
                pass
    return time.perf_counter() - start


def _drop_cache(paths: list[Path]) -> None:
    if not hasattr(os, "posix_fadvise"):
        return
    for path in paths:
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def measure(
    scratch: Path, total: int, files: int, repeats: int, concurrency: int, part_mb: int
) -> dict[str, Any]:
    """Every figure, ``repeats`` rounds; each round runs every method in turn."""
    sys.path.insert(0, str(HERE.parent / "tests" / "storage"))
    from _s3server import S3Server

    from lightning_mcore_ckpt.storage import publication, remote_files, store_views
    from lightning_mcore_ckpt.storage.object_store import ObjectStore

    server = S3Server(scratch / "server").start()
    saved_env = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    rounds: list[dict[str, float]] = []
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        server.create_bucket(bucket)
        url = f"s3://{bucket}/run"
        store = ObjectStore.from_url(url, concurrency=concurrency, part_size=part_mb * MiB)
        file_size = total // files
        block = os.urandom(CHUNK)
        for r in range(1, repeats + 1):
            local = scratch / "local"
            shutil.rmtree(local, ignore_errors=True)
            step = local / f"global_step_{r}"
            row: dict[str, float] = {}
            row["local_write_s"] = _write_step(step, files, file_size, block)
            shards = sorted((step / "model").glob("*.distcp"))
            nbytes = sum(p.stat().st_size for p in shards)
            row["bytes"] = float(nbytes)

            figures = publication.publish_step(store, step)
            row["publish_s"] = figures["upload_time_s"]
            row["upload_bytes"] = float(figures["upload_bytes"])

            _drop_cache(shards)
            row["local_read_s"] = _read_all(shards, lambda p: open(p, "rb"))

            start = time.perf_counter()
            view = store_views.open_view(f"{url}/{step.name}")
            row["view_open_s"] = time.perf_counter() - start
            remote = [
                view / "model" / p.name
                for p in shards
                if remote_files.remote_size(view / "model" / p.name) is not None
            ]
            assert len(remote) == len(shards), "every shard is a remote file of the view"
            row["ranged_read_s"] = _read_all(remote, remote_files.open_read)
            # One GET per part_size: what the per-request cost weighs.
            row["ranged_read_big_s"] = _read_all(remote, remote_files.open_read, part_mb * MiB)

            down = scratch / "download"
            shutil.rmtree(down, ignore_errors=True)
            down.mkdir(parents=True)
            start = time.perf_counter()
            for p in shards:
                store.download(f"{step.name}/model/{p.name}", down / p.name)
            row["download_s"] = time.perf_counter() - start
            shutil.rmtree(down, ignore_errors=True)

            publication.remove_published(store, r)  # the server keeps objects in memory
            rounds.append(row)
            print(
                f"round {r}: write {row['local_write_s']:.2f}s, publish {row['publish_s']:.2f}s, "
                f"read {row['local_read_s']:.2f}s, ranged {row['ranged_read_s']:.2f}s "
                f"({row['ranged_read_big_s']:.2f}s by part), "
                f"download {row['download_s']:.2f}s",
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
        "bytes": int(rounds[0]["bytes"]),
        "files": files,
        "concurrency": concurrency,
        "part_mb": part_mb,
        "rounds": rounds,
    }


ROWS = (
    # (label, seconds key, bytes key)
    ("write to local disk (fsync each file, marker by rename)", "local_write_s", "bytes"),
    ("publish to S3 (`publication.publish_step`)", "publish_s", "upload_bytes"),
    ("read from local disk (cold)", "local_read_s", "bytes"),
    ("read through a view (ranged GETs, `remote_files.open_read`)", "ranged_read_s", "bytes"),
    ("read through a view, one GET per part (`read(part_size)`)", "ranged_read_big_s", "bytes"),
    ("download whole files (`ObjectStore.download`)", "download_s", "bytes"),
)


def report(result: dict[str, Any], machine: str) -> str:
    rounds = result["rounds"]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    def spread(key: str) -> str:
        values = [r[key] for r in rounds]
        return f"{min(values):.3f}\u2013{max(values):.3f}"

    gbps = {key: med(size) / med(key) / 1e9 for _, key, size in ROWS}
    size = result["bytes"] / MiB
    lines = [
        f"### Object storage (S3) against the local disk ({size:.0f} MiB in "
        f"{result['files']} shard files)",
        "",
        machine,
        "",
        f"Median of {len(rounds)} rounds (each round: write, publish, read, ranged read, "
        f"download). Uploads: {result['concurrency']} requests per file, "
        f"{result['part_mb']} MiB parts; reads: {CHUNK // MiB} MiB per `read()` unless said.",
        "",
        "| operation | s (median) | min\u2013max s | GB/s | vs local disk |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, key, _ in ROWS:
        base = "local_write_s" if key in ("local_write_s", "publish_s") else "local_read_s"
        ratio = gbps[key] / gbps[base]
        lines.append(
            f"| {label} | {med(key):.3f} | {spread(key)} | {gbps[key]:.2f} | "
            f"{'—' if key == base else f'{ratio:.2f}x'} |"
        )
    lines += [
        "",
        f"Opening the step's view (one listing, the marker and tracker downloaded): "
        f"{med('view_open_s') * 1000:.0f} ms (median).",
        f"A step saved to S3 costs the local write plus the upload: "
        f"{med('local_write_s') + med('publish_s'):.2f} s, "
        f"{(med('local_write_s') + med('publish_s')) / med('local_write_s'):.1f}x the local "
        "write alone.",
        "",
        "The server is moto on 127.0.0.1: an in-memory Python server sharing this machine's CPUs "
        "with the client. These figures are this package's client path and the protocol's "
        "overhead, not a real object store's bandwidth.",
        "",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.nodes:  # uploads from 1 and several simulated nodes
        from benchmarks import s3_nodes

        return s3_nodes.run(args)
    scratch = Path(args.dir).resolve() / "s3"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    total = 16 * MiB if args.quick else args.s3_mib * MiB
    files = 2 if args.quick else 4
    repeats = 1 if args.quick else args.repeats
    try:
        result = measure(scratch, total, files, repeats, args.s3_concurrency, args.s3_part_mb)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    machine = (
        f"Measured {now:%Y-%m-%d %H:%M} UTC on `{socket.gethostname()}`: {os.cpu_count()} CPUs, "
        f"{platform.system()} {platform.release()}, the local files on `{args.dir}`'s disk, "
        "the S3 server on loopback."
    )
    table = report(result, machine)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{now:%Y-%m-%d}-{socket.gethostname()}-s3" + ("-quick" if args.quick else "")
    (out / f"{stem}.md").write_text(table)
    print(table)
    print(f"results: {out / stem}.md")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--s3-mib", type=int, default=256, help="with --only-s3: the step's size (MiB)"
    )
    parser.add_argument(
        "--s3-concurrency", type=int, default=8, help="with --only-s3: requests per file"
    )
    parser.add_argument(
        "--s3-part-mb", type=int, default=64, help="with --only-s3: multipart part size (MiB)"
    )
    parser.add_argument(
        "--nodes",
        default=None,
        help="with --only-s3: instead, one step's upload from each of these node counts, e.g. "
        "1,2 (1: one process uploads it all; N: N simulated nodes each upload their share; "
        "benchmarks/s3_nodes.py)",
    )
    parser.add_argument(
        "--s3-files",
        type=int,
        default=8,
        help="with --only-s3 --nodes: the step's shard files (each node count divides it)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.s3", description=__doc__)
    parser.add_argument("--repeats", type=int, default=3, help="rounds")
    parser.add_argument("--quick", action="store_true", help="16 MiB, one round: seconds")
    parser.add_argument("--dir", default=str(HERE / ".scratch"), help="the local disk to use")
    parser.add_argument("--out", default=str(HERE / "results"), help="where results go")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    sys.exit(main())
