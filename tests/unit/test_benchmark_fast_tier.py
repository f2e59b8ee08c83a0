"""The fast-tier benchmark (``python -m benchmarks --only-fast-tier``): its steps-lost arithmetic
against a simulated timeline of saves and failures, and its figures and tables from made-up
measurements (no run needed; the quick mode itself runs on simulated nodes, outside CI).

Axes: the cadence (2, 20, 500 steps) x the save's time in flight (none, half a cadence, a whole
cadence); the tables' ratios (which row is the reference), the first save of each tier left
out of the medians; each fast row against each persistent stand-in (the local disk, the
throttled shared directory, the S3 bucket on loopback), a stand-in measured or not; the rows a
run launches; the command line's refusal of a state too large.
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


def _s3_launch(set_up: float, loaded: float, cpu: float) -> Any:
    return {
        **_launch(loaded + 1.0, set_up, loaded, "persistent", 0),
        "server_cpu_s": cpu,
        "server_dropped_bytes": 300 * fast_tier.MiB,
    }


def _with_stand_ins() -> dict[str, Any]:
    result = _result()
    # The throttled shared directory: recovery + load 10 s (from 2 s set up to 12 s loaded).
    result["launches"][fast_tier.THROTTLED] = [_launch(14.0, 2.0, 12.0, "persistent", 0)] * 3
    result["throttle"] = "ext4 on /dev/loop0, reads capped"
    # The S3 bucket on loopback: recovery + load 3, 8 and 9 s (median 8 s); its server's CPU.
    result["launches"][fast_tier.S3_ROW] = [
        _s3_launch(3.0, 6.0, 1.0),
        _s3_launch(3.0, 11.0, 2.5),
        _s3_launch(2.0, 11.0, 3.0),
    ]
    result["s3"] = "moto's S3 server on 127.0.0.1"
    result["s3_published"] = {
        "objects": 25,
        "upload_bytes": 255 * fast_tier.MiB,
        "upload_time_s": 4.5,
        "upload_throughput_gbps": 0.06,
    }
    return result


def test_each_fast_row_is_judged_against_each_persistent_stand_in() -> None:
    result = _with_stand_ins()
    summary = fast_tier.summarise(result)
    got = {(f, p): (fs, ps, v) for f, p, fs, ps, v in fast_tier.targets(summary["rows"])}
    own, peer, local = fast_tier.ROWS
    s3 = fast_tier.S3_ROW
    # Own copies 1 s, a peer's 5 s; the persistent tier 4 s on the local disk, 10 s throttled,
    # 8 s from the S3 bucket.
    assert got == {
        (own, local): (1.0, 4.0, "MET"),
        (peer, local): (5.0, 4.0, "MISSED"),
        (own, fast_tier.THROTTLED): (1.0, 10.0, "MET"),
        (peer, fast_tier.THROTTLED): (5.0, 10.0, "MET"),
        (own, s3): (1.0, 8.0, "MET"),
        (peer, s3): (5.0, 8.0, "MISSED"),
    }
    table = fast_tier.report(result, summary, "machine", "command")
    assert f"| {peer} | {fast_tier.THROTTLED} | 5.00 | 10.00 | 0.50 | MET |" in table
    assert f"| {peer} | {local} | 5.00 | 4.00 | 1.25 | MISSED |" in table
    assert f"| {own} | {s3} | 1.00 | 8.00 | 0.12 | MET |" in table
    assert f"| {peer} | {s3} | 5.00 | 8.00 | 0.62 | MISSED |" in table
    assert f"`{fast_tier.THROTTLED}`: ext4 on /dev/loop0, reads capped." in table


def test_the_s3_stand_in_has_its_rows_in_every_table_and_says_what_served_it() -> None:
    result = _with_stand_ins()
    table = fast_tier.report(result, fast_tier.summarise(result), "machine", "command")
    s3 = fast_tier.S3_ROW
    lines = [line for line in table.splitlines() if line.startswith(f"| {s3} | ")]
    # The recovery table, where the recovery went, where the load went.
    assert len(lines) == 3, table
    # launch -> first step 12 s (median of 7, 12, 12), against the local disk's 10 s;
    # recovery + load 8 s against 4 s.
    cells = lines[0].split(" | ")
    assert (cells[1], cells[3], cells[6], cells[7]) == ("12.00", "0.83", "8.00", "0.50")
    assert cells[9] == f"{fast_tier.PERSISTED} (persistent)"
    stand_in = table.split(f"`{s3}`: ", 1)[1].split("\n", 1)[0]
    assert stand_in.startswith("moto's S3 server on 127.0.0.1.")
    assert f"committed step {fast_tier.PERSISTED} was published" in stand_in
    assert "`publication.publish_step`" in stand_in
    assert "25 objects, 255 MiB, 4.50 s" in stand_in
    assert "spooled objects (300 MiB) were dropped from the page cache" in stand_in
    assert "CPU time per launch: 2.50 s (median)" in stand_in


def test_a_stand_in_not_measured_says_why() -> None:
    result = {
        **_result(),
        "throttle": None,
        "throttle_why": "no block I/O controller",
        "s3": None,
        "s3_why": "boto3 and moto not installed",
    }
    table = fast_tier.report(result, fast_tier.summarise(result), "machine", "command")
    assert f"`{fast_tier.THROTTLED}`: not measured (no block I/O controller)." in table
    assert f"`{fast_tier.S3_ROW}`: not measured (boto3 and moto not installed)." in table
    assert f"| {fast_tier.S3_ROW} |" not in table  # no figures made up for it


@pytest.mark.parametrize(
    ("throttled", "s3", "stand_ins"),
    [
        (True, True, [fast_tier.THROTTLED, fast_tier.S3_ROW]),
        (False, True, [fast_tier.S3_ROW]),
        (True, False, [fast_tier.THROTTLED]),
        (False, False, []),
    ],
)
def test_a_run_launches_every_stand_in_set_up(
    throttled: bool, s3: bool, stand_ins: list[str]
) -> None:
    assert fast_tier.rows_measured(throttled, s3) == [*fast_tier.ROWS, *stand_ins]


class _FakeStand:
    url = "s3://bench/run"

    def __init__(self) -> None:
        self.published: list[tuple[Path, int]] = []

    def publish(self, ckpt: Path, step: int) -> dict[str, Any]:
        self.published.append((ckpt, step))
        return {"objects": 3, "upload_bytes": fast_tier.MiB, "upload_time_s": 0.1}

    def describe(self) -> str:
        return "a fake bucket"


def test_the_s3_row_is_launched_each_round_from_the_step_the_job_left_in_the_bucket(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[tuple[str, Any]] = []

    def recover_once(
        scratch: Path, row: str, size: str, timeout: float, throttled: Any, s3: Any
    ) -> dict[str, Any]:
        calls.append((row, s3))
        tier = "fast" if row.startswith("fast") else "persistent"
        on_s3 = row == fast_tier.S3_ROW
        return {
            **_launch(3.0, 1.0, 2.0, tier, 0),
            "server_cpu_s": 0.5 if on_s3 else None,
            "server_dropped_bytes": fast_tier.MiB if on_s3 else None,
        }

    monkeypatch.setattr(fast_tier, "prepare", lambda *args: _result()["saves"])
    monkeypatch.setattr(fast_tier, "recover_once", recover_once)
    stand = _FakeStand()
    result = fast_tier.measure(tmp_path, "quick", 2, 60.0, None, stand)  # type: ignore[arg-type]
    # The step the killed job committed, published once, from the snapshot's shared directory.
    assert stand.published == [(tmp_path / "snapshot" / "shared" / "ckpt", fast_tier.PERSISTED)]
    assert result["s3"] == "a fake bucket" and result["s3_published"]["objects"] == 3
    assert list(result["launches"]) == [*fast_tier.ROWS, fast_tier.S3_ROW]
    assert len(result["launches"][fast_tier.S3_ROW]) == 2
    # Interleaved with the other rows, the order reversed in the second round.
    order = [row for row, _ in calls]
    assert order == [*fast_tier.ROWS, fast_tier.S3_ROW, fast_tier.S3_ROW, *fast_tier.ROWS[::-1]]
    assert all(s3 is stand for _, s3 in calls)
