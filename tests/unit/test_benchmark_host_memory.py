"""The benchmark's host memory counts pinned memory, which resident-set figures do not show.

On a GPU, staging buffers are pinned (page-locked) host memory that the driver maps into the
process; an async save that pinned 1 GiB read 9 MiB more RSS. Axes: pinned memory held during
the measurement (none, grown then released, held), resident memory grown (no, yes).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import workloads

MiB = 1024 * 1024


@pytest.mark.parametrize("resident", [False, True], ids=["no-rss", "rss-grown"])
@pytest.mark.parametrize("pinned", ["none", "released", "held"])
def test_peak_host_memory_is_resident_plus_pinned(
    pinned: str, resident: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = {"bytes": 0}
    monkeypatch.setattr(workloads, "pinned_host_bytes", lambda: held["bytes"])
    with workloads.PeakRSS(interval=0.001) as peak:
        grown = bytearray(64 * MiB) if resident else None
        if grown is not None:
            grown[::4096] = b"x" * len(grown[::4096])  # touch every page
        if pinned != "none":
            held["bytes"] = 256 * MiB
            time.sleep(0.05)  # sampled while held
        if pinned == "released":
            held["bytes"] = 0
    want = (256 * MiB if pinned != "none" else 0) + (64 * MiB if resident else 0)
    assert want - 8 * MiB <= peak.extra <= want + 48 * MiB, (peak.extra, want)
    del grown


def test_no_pinned_memory_is_counted_before_cuda_is_used() -> None:
    import torch

    if torch.cuda.is_initialized():
        pytest.skip("CUDA was used in this process")
    assert workloads.pinned_host_bytes() == 0


@pytest.mark.parametrize("cached_mib", [0, 1024])
@pytest.mark.parametrize("active_mib", [0, 256])
def test_pinned_memory_is_what_is_in_use_not_what_the_allocator_keeps(
    active_mib: int, cached_mib: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The methods run one after the other in one process: blocks an earlier method pinned and
    freed stay owned by torch's pinned allocator (``allocated_bytes``) and are reused by the
    next. Only the blocks in use (``active_bytes``) are the memory a save holds."""
    import torch

    stats = {
        "allocated_bytes.current": (active_mib + cached_mib) * MiB,
        "active_bytes.current": active_mib * MiB,
    }
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: stats)
    assert workloads.pinned_host_bytes() == active_mib * MiB
