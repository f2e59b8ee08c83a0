"""The fast tier's content check next to the save it guards:
``python -m benchmarks.content_check [--size 1G] [--repeats 3]``.

One rank's state of ``--size`` (fp32 tensors of 64 MiB, as a large model's are laid out),
in host memory as a fast save stages it. Timed side by side, alternating, ``--repeats``
rounds: ``non_finite`` over the staged state (``FastTier(check_finite=True)`` runs it before
the write, in the background) and the write itself (``torch.save``, hashed on the way, fsynced:
the fast tier's ``write_payload``) into a temporary directory. Printed: the medians, their
ratio, and the check's throughput.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.report import machine_line

CHUNK = 64 * 2**20


def _size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].isalpha() else int(text)


def _state(nbytes: int) -> dict[str, torch.Tensor]:
    count = max(1, nbytes // CHUNK)
    generator = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(CHUNK // 4, generator=generator) for i in range(count)}


def run(size: str, repeats: int) -> dict[str, float]:
    from lightning_mcore_ckpt.engine import non_finite, write_payload

    state = _state(_size(size))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    checks, writes = [], []
    with tempfile.TemporaryDirectory(prefix="lmc-content-") as tmp:
        for round_ in range(repeats):
            order = ("check", "write") if round_ % 2 == 0 else ("write", "check")
            for what in order:
                started = time.perf_counter()
                if what == "check":
                    assert non_finite(state) == []
                    checks.append(time.perf_counter() - started)
                else:
                    write_payload(Path(tmp, "state.pt"), {"state": state})
                    writes.append(time.perf_counter() - started)
    check, write = statistics.median(checks), statistics.median(writes)
    return {"bytes": nbytes, "check_s": check, "write_s": write, "ratio": check / write}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1G")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    result = run(args.size, args.repeats)
    print(machine_line(f"temporary directory {tempfile.gettempdir()}"))
    gib = result["bytes"] / 2**30
    print(f"state: {gib:.2f} GiB, {args.repeats} rounds, medians")
    print(
        f"  content check (non_finite): {result['check_s']:.3f} s ({gib / result['check_s']:.1f} GiB/s)"
    )
    print(f"  fast save write (hashed, fsynced): {result['write_s']:.3f} s")
    print(f"  check / write: {result['ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
