"""The fast-tier benchmark (``python -m benchmarks --only-fast-tier``): its steps-lost arithmetic
against a simulated timeline of saves and failures, and its figures and tables from made-up
measurements (no run needed; the quick mode itself runs on simulated nodes, outside CI).

Axes: the cadence (2, 20, 500 steps) x the save's time in flight (none, half a cadence, a whole
cadence); the tables' ratios (which row is the reference), the first save of each tier left
out of the medians; the command line's refusal of a state too large.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import fast_tier  # noqa: E402 - the repository's benchmarks, not a package


def _simulated_loss(cadence: int, in_flight: float, samples: int = 20000) -> float:
    """Mean steps lost over failures spread evenly on a long run: saves start at every
    multiple of ``cadence`` and count ``in_flight`` steps later; a failure resumes the newest
    save counted by then."""
    horizon_start, horizon_end = 4 * cadence, 404 * cadence
    total = 0.0
    for i in range(samples):
        failure = horizon_start + (horizon_end - horizon_start) * (i + 0.5) / samples
        started = (failure // cadence) * cadence
        while started + in_flight > failure:  # not counted yet: the save before
            started -= cadence
        total += failure - started
    return total / samples


@pytest.mark.parametrize("cadence", [2, 20, 500])
@pytest.mark.parametrize("share_in_flight", [0.0, 0.5, 1.0])
def test_steps_lost_is_half_a_cadence_plus_the_save_in_flight(
    cadence: int, share_in_flight: float
) -> None:
    in_flight = share_in_flight * cadence
    fast, persistent = fast_tier.steps_lost(cadence, 7 * cadence, in_flight, 0.0)
    assert fast == pytest.approx(_simulated_loss(cadence, in_flight), rel=1e-3)
    assert persistent == pytest.approx(_simulated_loss(7 * cadence, 0.0), rel=1e-3)


def _launch(first_step: float, set_up: float, loaded: float, tier: str, peers: int) -> Any:
    return {
        "phases": {
            "rank started": 0.1,
            "model set up": set_up,
            "state loaded": loaded,
            "first step starts": first_step,
        },
        "resumed_step": fast_tier.KILLED_AT if tier == "fast" else fast_tier.PERSISTED,
        "recovery": {"tier": tier, "ranks_from_peers": peers, "time_s": 0.5},
    }


def _result() -> dict[str, Any]:
    fast = [
        {"step": s, "blocking_time_s": b, "hook_s": b + 0.1, "total_time_s": 4.0}
        for s, b in ((2, 9.0), (6, 0.2), (10, 0.4), (14, 0.3))
    ]
    persistent = [
        {"step": s, "blocking_time_s": b, "hook_s": b + 0.1, "total_time_s": 2.0}
        for s, b in ((4, 9.0), (8, 0.6), (12, 0.6))
    ]
    return {
        "size": "quick",
        "saves": {
            "fast_saves": fast,
            "persistent_saves": persistent,
            "step_s": 1.0,
            "hook_without_save_s": 0.01,
        },
        "launches": {
            fast_tier.ROWS[0]: [
                _launch(4.0, 2.0, 3.0, "fast", 0),
                _launch(6.0, 2.0, 3.0, "fast", 0),
            ],
            fast_tier.ROWS[1]: [
                {**_launch(8.0, 2.0, 7.0, "fast", 1), "parts": {"check the copies": c}}
                for c in (1.0, 2.0, 6.0)
            ],
            fast_tier.ROWS[2]: [_launch(10.0, 2.0, 6.0, "persistent", 0)] * 2,
        },
    }


def test_the_tables_compare_each_row_with_the_persistent_tier_and_leave_first_saves_out() -> None:
    result = _result()
    summary = fast_tier.summarise(result)
    # The first save of each tier (9 s: its buffers allocated) is not in the medians.
    assert summary["fast"]["blocking_time_s"] == pytest.approx(0.3)
    assert summary["persistent"]["blocking_time_s"] == pytest.approx(0.6)
    assert summary["first_fast"]["blocking_time_s"] == 9.0
    own = summary["rows"][fast_tier.ROWS[0]]
    assert (own["first_step_s"], own["min_s"], own["max_s"], own["load_s"]) == (5.0, 4.0, 6.0, 1.0)
    table = fast_tier.report(result, summary, "machine", "command")
    rows: dict[str, list[str]] = {}  # the recovery table's rows: each name's first line
    for line in table.splitlines():
        rows.setdefault(line.split(" | ")[0][2:], line.split(" | "))
    # persistent / this: 10 / 5 to the first step, 4 / 1 for the recovery and load.
    assert rows[fast_tier.ROWS[0]][3] == "2.00" and rows[fast_tier.ROWS[0]][7] == "4.00"
    assert rows[fast_tier.ROWS[1]][3] == "1.25" and rows[fast_tier.ROWS[1]][7] == "0.80"
    assert rows[fast_tier.ROWS[2]][3] == "—"
    assert "Fast / persistent blocking: 0.50 (library figures)" in table
    # Where a recovery went: each function's median over the launches ("—": not timed).
    labels = [label for label, _, _ in fast_tier.RECOVERY_PARTS]
    breakdown = "| fast tier, peer copies | " + " | ".join(
        "2.00" if label == "check the copies" else "—" for label in labels
    )
    assert breakdown + " |" in table
    # Steps lost with this run's d: total save time over step time (4 and 2 steps).
    assert "| 20 / 500 | 10 | 250 | 25x | 14.0 | 252.0 |" in table


def test_a_state_too_large_for_the_machine_is_refused_naming_the_argument(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = argparse.Namespace(quick=False, sizes="4G", repeats=1, dir=str(tmp_path), out="x")
    assert fast_tier.run(args) == 2
    assert "--sizes 4G: pass one state, 256M or 1G (or --quick)" in capsys.readouterr().err
    assert not (tmp_path / "fast-tier").exists()


@pytest.mark.parametrize(
    ("fast", "persistent", "verdict"),
    [
        (1.0, 2.0, "MET"),
        (0.2, 2.0, "MET"),
        (1.01, 2.0, "MISSED"),
        (3.0, 2.0, "MISSED"),
        (None, 2.0, "—"),
        (1.0, None, "—"),
        (1.0, 0.0, "—"),
    ],
)
def test_the_fast_tier_meets_its_target_at_half_the_persistent_tiers_time_or_less(
    fast: float | None, persistent: float | None, verdict: str
) -> None:
    assert fast_tier.judge(fast, persistent) == verdict


def test_each_fast_row_is_judged_against_each_persistent_stand_in() -> None:
    result = _result()
    # The throttled shared directory: recovery + load 10 s (from 2 s set up to 12 s loaded).
    result["launches"][fast_tier.THROTTLED] = [_launch(14.0, 2.0, 12.0, "persistent", 0)] * 3
    result["throttle"] = "ext4 on /dev/loop0, reads capped"
    summary = fast_tier.summarise(result)
    got = {(f, p): (fs, ps, v) for f, p, fs, ps, v in fast_tier.targets(summary["rows"])}
    own, peer, local = fast_tier.ROWS
    # Own copies 1 s, a peer's 5 s; the persistent tier 4 s on the local disk, 10 s throttled.
    assert got == {
        (own, local): (1.0, 4.0, "MET"),
        (peer, local): (5.0, 4.0, "MISSED"),
        (own, fast_tier.THROTTLED): (1.0, 10.0, "MET"),
        (peer, fast_tier.THROTTLED): (5.0, 10.0, "MET"),
    }
    table = fast_tier.report(result, summary, "machine", "command")
    assert f"| {peer} | {fast_tier.THROTTLED} | 5.00 | 10.00 | 0.50 | MET |" in table
    assert f"| {peer} | {local} | 5.00 | 4.00 | 1.25 | MISSED |" in table
    assert f"`{fast_tier.THROTTLED}`: ext4 on /dev/loop0, reads capped." in table


def test_a_stand_in_not_measured_says_why() -> None:
    result = {**_result(), "throttle": None, "throttle_why": "no block I/O controller"}
    table = fast_tier.report(result, fast_tier.summarise(result), "machine", "command")
    assert f"`{fast_tier.THROTTLED}`: not measured (no block I/O controller)." in table
