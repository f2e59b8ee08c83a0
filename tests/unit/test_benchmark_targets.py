"""The benchmark judges each of the issue's targets from its figures, on CPU and on GPU runs,
and a target whose figures are missing (a method failed, a run was cut short) is MISSED, never
MET. Checked on made-up figures: no GPU, no run needed."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402 - the repository's benchmarks, not a package

GB = 10**9


def _summary(value: float) -> dict[str, float]:
    return {"median": value, "min": value, "max": value, "n": 1}


def _figures(save: float, blocking: float, load: float | None = None, **extra: Any) -> dict:
    loads = {} if load is None else {"load_s": _summary(load)}
    return {
        **loads,
        "save_s": _summary(save),
        "blocking_s": _summary(blocking),
        "bytes": 2 * GB,
        "peak_rss_extra": 0,
        "device": "cuda:0",
        **extra,
    }


def _run(device: str) -> dict[str, Any]:
    """A run that meets every target: 2 GB of state, on one process."""
    methods = {
        "ours-sync": _figures(
            1.0,
            1.0,
            0.6,
            first_save_s=1.1,
            write_s=_summary(0.9),
            load_device_peak_bytes=int(2.1 * GB),
            trained_state_bytes=2 * GB,
        ),
        "ours-async": _figures(
            1.1,
            0.05,
            first_blocking_s=0.9,
            state_bytes=2 * GB,
            peak_rss_extra=int(2.1 * GB),
            fixed_costs={"hidden": 64, "blocking_s": _summary(0.01), "bytes": 10**6},
        ),
        "raw dist_checkpointing": _figures(2.0, 2.0, 0.9),
        "torch.save (Lightning default)": _figures(2.0, 2.0, 0.7),
        "torch.distributed.checkpoint": _figures(1.5, 1.5, 0.8),
        "torch DCP async": _figures(1.6, 0.08, first_blocking_s=0.5),
        "side by side": {
            "ours": _summary(1.0),
            "plain DCP": _summary(1.5),
            "raw dist_checkpointing": _summary(2.0),
        },
    }
    limit = {
        "bytes": GB,
        "write_gbps": 2.0,
        "read_gbps": 2.0,
        "parallel_read_gbps": 4.0,
        "read_streams": 4,
        "copy_gbps": 30.0,
        "hash_gbps": 50.0,
        "read_cache": "cold",
    }
    run = {"size": "1G", "world": 1, "device": device, "limit": limit, "methods": methods}
    run["d2h"] = {"pinned_d2h_gbps": 50.0, "pageable_d2h_gbps": 10.0, "gpu": "a GPU"}
    run["step_overhead"] = {"step_s": 1.0, "callback_s": 0.001, "ranks": 1}
    return run


def _checks(run: dict[str, Any]) -> dict[str, tuple[bool, str]]:
    methods, _ = report._methods(run)
    sync = run["methods"]["ours-sync"]["save_s"]["median"]
    by = {name: report._row(name, m, run["limit"], sync) for name, m in methods.items()}
    overhead = run["step_overhead"]["callback_s"] / run["step_overhead"]["step_s"]
    return {
        name.split(": ", 1)[1]: (ok, value)
        for name, ok, value in report.targets(run, by, overhead, run["limit"])
    }


GPU_ONLY = {
    "async blocking <= 1.2 x D2H time + fixed costs",
    "async blocking <= DCP async blocking",
    "device memory during a GPU load <= 1.1 x trained state",
}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_target_of_the_issue_is_judged_and_met_by_a_run_that_meets_it(device: str) -> None:
    run = _run(device)
    if device == "cpu":
        run["methods"]["ours-async"]["blocking_s"] = _summary(0.05)
    checks = _checks(run)
    assert all(ok for ok, _ in checks.values()), checks
    expected = {
        "sync save >= 0.8 x disk write",
        "hashing every file < 5 % of a save at the disk's speed",
        "sync save >= plain DCP (side by side)",
        "sync save >= raw dist_checkpointing (side by side)",
        "host memory during an async save <= 1.1 x rank state bytes",
        "first async blocking <= sync save",
        "first sync save <= 1.2 x later ones",
        "async total <= 1.2 x sync save",
        "cold load >= 0.8 x parallel read limit",
        "cold load >= torch.load",
        "callback step overhead < 1 %",
    }
    if device == "cuda":
        expected |= GPU_ONLY
    else:
        expected |= {"async blocking <= 10 % of sync save"}
    hashing = "hashing every file < 5 % of a save at the disk's speed"
    assert set(checks) == expected - {hashing}  # no unhashed round in these figures


# Each case: what changes in a run that meets every target, and the one target it misses.
MISSES = {
    # 2 GB at 50 GB/s pinned: 40 ms of copy; 1.2 x that + 10 ms of fixed costs is 58 ms.
    "blocking above the D2H bound": (
        lambda r: r["methods"]["ours-async"].update(blocking_s=_summary(0.06)),
        "async blocking <= 1.2 x D2H time + fixed costs",
    ),
    "the fixed costs not measured: none allowed": (
        lambda r: r["methods"]["ours-async"].pop("fixed_costs"),
        "async blocking <= 1.2 x D2H time + fixed costs",
    ),
    "blocking above DCP async's": (
        lambda r: r["methods"]["torch DCP async"].update(blocking_s=_summary(0.04)),
        "async blocking <= DCP async blocking",
    ),
    "DCP async failed": (
        lambda r: r["methods"].update({"torch DCP async": {"error": "Traceback\nBoom"}}),
        "async blocking <= DCP async blocking",
    ),
    "host memory above 1.1 x the state": (
        lambda r: r["methods"]["ours-async"].update(peak_rss_extra=int(2.3 * GB)),
        "host memory during an async save <= 1.1 x rank state bytes",
    ),
    "a second copy of the state on the device during the load": (
        lambda r: r["methods"]["ours-sync"].update(load_device_peak_bytes=4 * GB),
        "device memory during a GPU load <= 1.1 x trained state",
    ),
    # 2 GB in 0.6 s is 3.3 GB/s: 0.83 of 4 GB/s; at 8 GB/s over 4 streams, 0.42.
    "the load below 0.8 of the parallel read limit": (
        lambda r: r["limit"].update(parallel_read_gbps=8.0),
        "cold load >= 0.8 x parallel read limit",
    ),
    "the load slower than torch.load": (
        lambda r: r["methods"]["torch.save (Lightning default)"].update(load_s=_summary(0.5)),
        "cold load >= torch.load",
    ),
    "torch.save failed": (
        lambda r: r["methods"].update({"torch.save (Lightning default)": {"error": "Boom"}}),
        "cold load >= torch.load",
    ),
}
# ... and the ones where two targets go together.
MISSES_TWO = {
    "the side-by-side rounds failed": (
        lambda r: r["methods"].update({"side by side": {"error": "Boom"}}),
        {
            "sync save >= plain DCP (side by side)",
            "sync save >= raw dist_checkpointing (side by side)",
        },
    ),
}


@pytest.mark.parametrize("case", sorted(MISSES) + sorted(MISSES_TWO))
def test_a_run_that_misses_a_target_is_told_which(case: str) -> None:
    change, missed = MISSES[case] if case in MISSES else MISSES_TWO[case]
    run = copy.deepcopy(_run("cuda"))
    change(run)
    checks = _checks(run)
    expected = {missed} if isinstance(missed, str) else missed
    assert {name for name, (ok, _) in checks.items() if not ok} == expected, checks


def test_gpu_targets_are_not_judged_on_a_cpu_run() -> None:
    assert not GPU_ONLY & set(_checks(_run("cpu")))


def _restart(ours: float, lightning: float) -> dict[str, Any]:
    from benchmarks.restart import PHASES, ROWS

    def row(total: float, step: int) -> dict[str, Any]:
        phases = {p: total * (i + 1) / len(PHASES) for i, p in enumerate(PHASES)}
        return {
            "launch_to_first_step_s": _summary(total),
            "phases": phases,
            "step": step,
            "device": "cuda:0",
            "in_fit": True,
        }

    return {
        "size": "1G",
        "world": 1,
        "device": "cuda",
        "steps_before": 2,
        "bytes": {ROWS[1]: GB, ROWS[2]: GB},
        "rows": {ROWS[0]: row(3.0, 1), ROWS[1]: row(ours, 3), ROWS[2]: row(lightning, 3)},
    }


@pytest.mark.parametrize(("ours", "lightning", "met"), [(4.0, 5.0, True), (5.5, 5.0, False)])
def test_restart_is_judged_against_lightnings_default_resume(
    ours: float, lightning: float, met: bool
) -> None:
    lines, [(name, ok, value)] = report.restart_table(_restart(ours, lightning))
    assert name == "1G/1p: restart (launch -> first resumed step) <= Lightning default"
    assert ok is met and value.startswith(f"{ours:.2f} s vs {lightning:.2f} s")
    table = "\n".join(lines)
    for row in ("| fresh start | 3.00", f"| ours, resumed | {ours:.2f}", "| Lightning default"):
        assert row in table


def test_the_tables_of_a_run_where_methods_failed_name_them_and_miss_their_targets() -> None:
    run = _run("cuda")
    run["methods"]["ours-async"] = {"error": "Traceback ...\nRuntimeError: the writer died"}
    results = {
        "date": "2026-11-26T00:00:00+00:00",
        "device": "cuda",
        "machine": {"host": "h", "cpus": 16, "platform": "Linux"},
        "runs": [run],
        "restart": [_restart(4.0, 5.0)],
        "errors": [{"what": "dedup 4G", "error": "Traceback\nDistributedFailure: rank 0 died"}],
    }
    table, verdicts = report.tables(results)
    assert "**Failed: ours-async**: RuntimeError: the writer died" in table
    assert "**Failed: dedup 4G**: DistributedFailure: rank 0 died" in table
    assert "MISSED  1G/1p: async blocking  (not measured)" in verdicts
    assert "| ours-sync | cuda:0 |" in table and "### Restart" in table
    assert any(v.startswith("MET   1G/1p: restart") for v in verdicts)
