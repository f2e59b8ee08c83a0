"""``python -m benchmarks --only-fast-tier --quick`` end to end (about 30 s on 2 cores; needs
simulated nodes with a ``node_dir``: Linux, root): every recovery row launched and resumed from
the tier it stands for, ``/dev/shm``'s row included where ``/dev/shm`` is there, its speed
measured and its bound judged, and its directory under ``/dev/shm`` removed afterwards; with
torch AdamW (the default) and with Megatron-Core's distributed optimizer over bf16 weights
(``--optimizers distributed-bf16``, as Megatron-LM trains)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _benchmarks import run_benchmarks

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import fast_tier  # noqa: E402 - the repository's benchmarks, not a package


def _ours() -> set[str]:
    if not fast_tier.SHM.is_dir():
        return set()
    return {p.name for p in fast_tier.SHM.glob("lmc-bench-fast-tier-*")}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("optimizer", ["adamw", "distributed-bf16"])
def test_the_fast_tier_benchmarks_quick_mode_runs_every_row(tmp_path: Path, optimizer: str) -> None:
    from lightning_mcore_ckpt.testing import nodes_unavailable

    why = nodes_unavailable()
    if why is not None:
        pytest.skip(why)
    before = _ours()
    chosen = [] if optimizer == "adamw" else ["--optimizers", optimizer]
    run_benchmarks(
        "--only-fast-tier",
        "--quick",
        *chosen,
        "--out",
        str(tmp_path / "out"),
        "--dir",
        str(tmp_path / "scratch"),
    )
    suffix = "" if optimizer == "adamw" else f"-{optimizer}"
    (raw,) = (tmp_path / "out").glob(f"*-fast-tier-quick{suffix}.json")
    data = json.loads(raw.read_text())
    assert data["optimizer"] == optimizer
    rows = data["summary"]["rows"]
    own, peer, persistent = fast_tier.ROWS
    for row in (own, peer):
        assert rows[row]["resumed_step"] == [fast_tier.KILLED_AT] and rows[row]["tier"] == ["fast"]
    assert rows[persistent]["resumed_step"] == [fast_tier.PERSISTED]
    # Each rank's peak memory during the load is measured (Linux's VmHWM, reset at set-up).
    peaks = rows[peer]["peak_extra_mib"]
    assert len(peaks) == 2 and all(p is not None and p > 0 for p in peaks), peaks
    bounds = data["summary"]["bounds"]
    assert bounds["read"]["gbps"] and bounds["link"]["gbps"]
    shm = bounds["rows"][fast_tier.SHM_ROW]
    (table,) = (tmp_path / "out").glob(f"*-fast-tier-quick{suffix}.md")
    if data["shm"] is None:  # no /dev/shm, or too small: said, not launched
        assert data["shm_why"] and fast_tier.SHM_ROW not in rows
        assert shm["verdict"] == "MISSED" and data["shm_why"] in shm["why"]
        assert f"`{fast_tier.SHM_ROW}`: not measured ({data['shm_why']})." in table.read_text()
    else:
        got = rows[fast_tier.SHM_ROW]
        assert got["resumed_step"] == [fast_tier.KILLED_AT] and got["tier"] == ["fast"]
        assert got["ranks_from_peers"] == [0]
        assert len(data["shm_reads"]) == 1 and bounds["shm"]["gbps"]
        assert (
            shm["why"] is None
            and shm["bound_s"]
            and shm["speed_gbps"] == pytest.approx(bounds["shm"]["gbps"] / fast_tier.NODES)
        )
        assert f"| {fast_tier.SHM_ROW} | " in table.read_text()
    # Its directory under /dev/shm is gone.
    assert _ours() <= before
