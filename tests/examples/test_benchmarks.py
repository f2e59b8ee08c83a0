"""The benchmark's quick mode runs end to end, so the benchmark code cannot rot."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from _benchmarks import run_benchmarks

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_benchmark_quick_mode_writes_results_table_and_chart(tmp_path: Path) -> None:
    run_benchmarks(
        "--quick",
        "--out",
        str(tmp_path),
        "--dir",
        str(tmp_path / "scratch"),
    )
    (result,) = tmp_path.glob("*-quick.json")
    data = json.loads(result.read_text())
    (run,) = data["runs"]
    assert run["limit"]["write_gbps"] > 0 and run["limit"]["read_gbps"] > 0
    methods = {k for k, v in run["methods"].items() if isinstance(v, dict) and "save_s" in v}
    assert methods == {
        "ours-sync",
        "ours-async",
        "raw dist_checkpointing",
        "torch.save (Lightning default)",
        "torch.distributed.checkpoint",
        "ours-async (megatron writer)",
        "torch DCP async",
    }
    # Every target of the issue is judged, first saves included.
    assert run["methods"]["ours-sync"]["first_save_s"] > 0
    assert run["methods"]["ours-async"]["first_blocking_s"] > 0
    for name in methods:
        figures = run["methods"][name]
        assert figures["save_s"]["median"] > 0 and figures["bytes"] > 0
    # The sync saves compared round after round, in the same minutes.
    side = run["methods"]["side by side"]
    assert set(side) == {"ours", "ours, files not hashed", "plain DCP", "raw dist_checkpointing"}
    assert run["methods"]["ours-sync"]["verified_load_s"]["median"] > 0
    assert all(v["median"] > 0 for v in side.values())
    assert run["step_overhead"]["callback_s"] > 0 and data["hf_export"][0]["seconds"] > 0
    table = result.with_suffix(".md").read_text()
    assert "| ours-sync |" in table and "### Targets" in table
    for target in (
        "disk write",
        "plain DCP (side by side)",
        "raw dist_checkpointing (side by side)",
        "hashing every file < 5 % of a save at the disk",
        "async blocking",
        "first async",
        "first sync",
        "async total",
        "cold load >= 0.8",
        "torch.load",
        "step overhead",
        "frozen base, later saves",
        "host memory during an async save",
        "restart (launch -> first resumed step) <= Lightning default",
    ):
        assert target in table, target
    assert "### Restart: launch -> first step done" in table
    assert result.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "scratch").exists()  # scratch space is cleaned up


def _figures(
    save: float, blocking: float, load: float | None = None, **extra: float
) -> dict[str, Any]:
    loads = {} if load is None else {"load_s": {"median": load, "min": load, "max": load}}
    return {
        **loads,
        "save_s": {"median": save, "min": save, "max": save},
        "blocking_s": {"median": blocking, "min": blocking, "max": blocking},
        "bytes": 2 * 10**9,
        "peak_rss_extra": 0,
        **extra,
    }


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_target_is_judged_on_cpu_and_on_gpu(device: str) -> None:
    # The GPU run (--device cuda) judges async blocking against the measured device-to-host
    # copy of each rank's bytes; the rest as on CPU. Checked here without a GPU.
    sys.path.insert(0, str(ROOT))
    from benchmarks.__main__ import _row, targets

    limit = {"write_gbps": 2.0, "read_gbps": 4.0, "copy_gbps": 10.0}
    # The state: 2 GB on the rank; host memory during the async saves and device memory during
    # the load within 1.1 x of it.
    methods = {
        "ours-sync": _figures(
            1.0,
            1.0,
            0.6,
            first_save_s=1.1,
            load_device_peak_bytes=2 * 10**9,
            trained_state_bytes=2 * 10**9,
        ),
        "ours-async": _figures(
            1.1, 0.04, first_blocking_s=0.9, state_bytes=2 * 10**9, peak_rss_extra=2 * 10**9
        ),
        "raw dist_checkpointing": _figures(2.0, 2.0),
        "torch.save (Lightning default)": _figures(2.0, 2.0, 0.7),
        "torch.distributed.checkpoint": _figures(1.5, 1.5),
        "torch DCP async": _figures(1.5, 0.05),
        "side by side": {
            "ours": {"median": 1.0},
            "plain DCP": {"median": 1.5},
            "raw dist_checkpointing": {"median": 2.0},
        },
    }
    run = {"size": "1G", "world": 1, "device": device, "limit": limit, "methods": methods}
    run["d2h"] = {"pinned_d2h_gbps": 50.0, "pageable_d2h_gbps": 10.0}
    by = {name: _row(name, m, limit, 1.0) for name, m in methods.items() if "save_s" in m}
    checks = {
        name.split(": ", 1)[1]: (ok, value) for name, ok, value in targets(run, by, 0.001, limit)
    }
    assert all(ok for ok, _ in checks.values()), checks
    bound = (
        "async blocking <= 1.2 x D2H time + fixed costs"
        if device == "cuda"
        else "async blocking <= 10 % of sync save"
    )
    assert bound in checks, checks
    # 2 GB at 50 GB/s: 40 ms of copy; 1.2 x that is the bound (of a 1 s sync save; no fixed
    # costs measured here, so none are allowed).
    methods["ours-async"]["blocking_s"]["median"] = 0.06 if device == "cuda" else 0.2
    late = {n.split(": ", 1)[1]: ok for n, ok, _ in targets(run, by, 0.001, limit)}
    assert late[bound] is False


def test_step_overhead_counts_what_the_last_rank_to_arrive_spends() -> None:
    # Rank 0 reaches the callback first at step 1 and waits 50 ms there for rank 1; at step 2
    # the other way round. The step pays what the last to arrive spends: 0.2 and 0.3 ms.
    sys.path.insert(0, str(ROOT))
    from benchmarks.workloads import critical_path

    ranks = [
        {"step_s": 1.0, "callback_s": 0.05, "hook_s": [0.05, 0.0003, 0.0002]},
        {"step_s": 1.0, "callback_s": 0.02, "hook_s": [0.0002, 0.02, 0.06]},
    ]
    figures = critical_path(ranks)
    assert figures["callback_s"] == 0.0002  # median of 0.0002, 0.0003, 0.0002
    assert figures["waiting_s"] == 0.05  # median of 0.05, 0.02, 0.06
    assert figures["ranks"] == 2


@pytest.mark.timeout(600)
def test_benchmark_scale_mode_measures_each_rank_count_through_real_saves(tmp_path: Path) -> None:
    # The scale mode end to end on a tiny state at 1 and 2 ranks (TP over every rank): every
    # figure of the table is measured from real Trainer saves and loads, and judged.
    run_benchmarks(
        "--scale",
        "--quick",
        "--procs",
        "1,2",
        "--saves",
        "3",
        "--out",
        str(tmp_path),
        "--dir",
        str(tmp_path / "scratch"),
    )
    (result,) = tmp_path.glob("*-scale-quick-tp.json")
    data = json.loads(result.read_text())
    low, high = data["rows"]
    assert (low["world"], high["world"]) == (1, 2)
    # The same total state: each of 2 ranks holds about half of what one rank holds.
    assert (
        0.4 < high["cached"]["state_bytes_per_rank"] / low["cached"]["state_bytes_per_rank"] < 0.6
    )
    for row in (low, high):
        for mode in ("cached", "uncached"):
            figures = row[mode]
            assert figures["save_s"] > 0 and figures["planning_s"] > 0
            assert figures["collective_calls"] > 0 and figures["coordination_aligned"]
            assert figures["step_files"]["metadata_bytes"] > 0
        assert row["async"]["blocking_s"] > 0 and row["cached"]["load_s"] > 0
        # Cached plans skip Megatron-Core's validation and DCP's plan gather.
        assert row["cached"]["collective_calls"] < row["uncached"]["collective_calls"]
    assert high["cached"]["step_files"]["extra_files"] == 2
    assert any("dist_checkpointing" in line for line in high["uncached"]["profile"])
    table = result.with_suffix(".md").read_text()
    assert "## Scale: 1, 2 ranks" in table and "### Targets" in table
    assert "coordination per save, cached plans: 2 ranks <= 1.2 x 1" in table
    assert not (tmp_path / "scratch").exists()
