"""Cold loads into GPU tensors, side by side: our reader's pinned path against the path it
replaced, and the read limit of the same files.

``python -m benchmarks.device_reads [--out DIR] [--rounds N]`` (needs CUDA): a 1 GiB state (16
fp32 tensors of 64 MiB) saved with torch DCP into 2 files, then, round after round, each in
turn with the page cache dropped first:

- ``limit``: the files read cold, one thread per file (as many streams as the reader uses);
- ``bounce32`` / ``bounce128``: :class:`~lightning_mcore_ckpt.engine._parallel_reader.ParallelFileSystemReader`
  loading into CUDA tensors through pinned buffers of 32 MiB (the default) / 128 MiB;
- ``pageable``: the same reader with device records sent through ``torch.load`` into pageable
  host memory and a copy (what it did before the pinned path).

Every load is checked bit for bit. Results: ``device-reads.json`` in ``--out``, after each round.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from lightning_mcore_ckpt.engine import _parallel_reader

MiB = 1024 * 1024


def _drop(files: list[str]) -> None:
    os.sync()
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _limit(files: list[str]) -> float:
    def read(name: str) -> None:
        with open(name, "rb", buffering=0) as f:
            while f.read(8 * MiB):
                pass

    _drop(files)
    start = time.perf_counter()
    threads = [threading.Thread(target=read, args=(f,)) for f in files]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.device_reads", description=__doc__)
    parser.add_argument("--dir", default="/tmp/lmc-device-reads", help="checkpoint filesystem")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="where results go")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs CUDA")
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(16 * MiB + 7 * i, generator=g) for i in range(16)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory), thread_count=2))
    files = [str(p) for p in directory.glob("*.distcp")]
    targets = {k: torch.empty_like(v, device="cuda") for k, v in state.items()}
    stock = _parallel_reader._read_into

    def pageable(stream: Any, offset: int, layout: torch.Tensor, target: torch.Tensor) -> bool:
        return target.device.type == "cpu" and stock(stream, offset, layout, target)

    def load(mode: str) -> float:
        _parallel_reader._read_into = pageable if mode == "pageable" else stock  # type: ignore[assignment]
        _parallel_reader.DeviceBounce.CHUNK = (128 if mode == "bounce128" else 32) * MiB
        for target in targets.values():
            target.fill_(-1)
        _drop(files)
        torch.cuda.synchronize()
        start = time.perf_counter()
        dcp.load(targets, storage_reader=_parallel_reader.ParallelFileSystemReader(directory, 2))
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        assert all(torch.equal(targets[k].cpu(), v) for k, v in state.items()), mode
        return seconds

    results: dict[str, Any] = {
        "bytes": sum(os.path.getsize(f) for f in files),
        "files": len(files),
        "device": torch.cuda.get_device_name(),
        "rounds": [],
    }
    load("bounce32")  # CUDA, the allocators and the pinned buffers warmed up
    load("pageable")
    modes = ["bounce32", "pageable", "bounce128"]
    for i in range(args.rounds):
        row = {"limit": _limit(files)}
        for mode in modes if i % 2 == 0 else modes[1:] + modes[:1]:  # each first in turn
            row[mode] = load(mode)
        results["rounds"].append(row)
        print(row, flush=True)
        Path(args.out, "device-reads.json").write_text(json.dumps(results, indent=1) + "\n")
    _parallel_reader._read_into = stock  # type: ignore[assignment]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
