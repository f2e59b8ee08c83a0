"""The fast-tier benchmark (``python -m benchmarks --only-fast-tier``): its steps-lost arithmetic
against a simulated timeline of saves and failures, and its figures and tables from made-up
measurements (no run needed; the quick mode itself runs on simulated nodes, outside CI).

Axes: the cadence (2, 20, 500 steps) x the save's time in flight (none, half a cadence, a whole
cadence); the tables' ratios (which row is the reference), the first save of each tier left
out of the medians; each fast row against each persistent stand-in (the local disk, the
throttled shared directory, the S3 bucket on loopback), a stand-in measured or not; the rows a
run launches; the command line's refusal of a state too large; the fast tier against its own
bounds (the arithmetic, which speed bounds which row, the fixed costs named, MET at or under the
bound, MISSED and why when a speed or a row was not measured, the table; the speeds measured each
round between the launches, the cold read of the copies a node serves).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import fast_tier  # noqa: E402 - the repository's benchmarks, not a package


def _sealed_copy(step: Path, rank: int, size: int) -> None:
    """Rank ``rank``'s files in ``step``, ``size`` bytes each, under a seal naming them."""
    from lightning_mcore_ckpt.fast import files

    written = {}
    for name in files.files_of(rank):
        (step / name).parent.mkdir(parents=True, exist_ok=True)
        (step / name).write_bytes(b"x" * size)
        written[name] = (size, "digest")
    files.write_seal(step, rank, 2, written)


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


def test_each_ranks_peak_memory_during_the_load_is_its_median_over_the_launches() -> None:
    result = _result()
    assert "Memory during the recovery and load" not in fast_tier.report(
        result, fast_tier.summarise(result), "machine", "command"
    )  # not measured: no table
    peer = result["launches"][fast_tier.ROWS[1]]
    for launch, peaks in zip(peer, ([130.0, 70.0], [140.0, 60.0], [500.0, None]), strict=True):
        launch["peak_extra_mib"] = peaks
    table = fast_tier.report(result, fast_tier.summarise(result), "machine", "command")
    assert "| fast tier, peer copies | 140 | 65 |" in table  # a launch not measured: left out
    assert "| fast tier, own copies | — | — |" in table


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
        scratch: Path,
        row: str,
        size: str,
        timeout: float,
        throttled: Any,
        s3: Any,
        shm: Any = None,
        optimizer: str = "adamw",
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
    # Interleaved with the other rows; the second round led by the second row, the others
    # after it in reverse.
    order = [row for row, _ in calls]
    rows = [*fast_tier.ROWS, fast_tier.S3_ROW]
    assert order == [*rows, rows[1], rows[0], *rows[2:][::-1]]
    assert all(s3 is stand for _, s3 in calls)


# --- the fast tier against its own bounds ------------------------------------------------------


def test_a_bound_is_the_slack_times_the_bytes_over_the_speed_plus_the_fixed_costs() -> None:
    # 1.2 x (500 MB / 2 GB/s) + 0.45 s; the slack and GB/s (10^9 bytes a second) are the issue's.
    assert fast_tier.BOUND_SLACK == 1.2 and fast_tier.GB == 1e9
    assert fast_tier.bound_s(500_000_000, 2.0, 0.45) == pytest.approx(0.75)
    assert fast_tier.bound_s(1_000_000_000, 0.5, 0.0) == pytest.approx(2.4)
    assert fast_tier.bound_s(500_000_000, 2.0, 0.0, slack=1.0) == pytest.approx(0.25)
    # The parts the bound names are parts the benchmark times, and none moves bytes.
    labels = [label for label, _, _ in fast_tier.ALL_PARTS]
    assert set(fast_tier.FIXED_PARTS) <= set(labels)
    assert set(fast_tier.BYTE_PARTS) <= set(label for label, _, _ in fast_tier.RECOVERY_PARTS)
    assert not set(fast_tier.FIXED_PARTS) & set(fast_tier.BYTE_PARTS)


def test_the_fixed_costs_are_the_named_parts_and_the_rest_of_recovery_and_load() -> None:
    row = {
        "load_s": 2.0,
        "parts": {
            "check the copies": 0.5,
            "fetch, in all": 0.6,
            "inventory": 0.1,
            "into model and optimizer": 0.2,
            "extra/ loaded": None,  # not timed: not named
            "recovery, in all": 1.5,  # holds the others: not a fixed cost
        },
    }
    fixed, moving = fast_tier.fixed_costs(row)
    assert moving == pytest.approx(1.1)
    assert list(fixed) == ["inventory", "into model and optimizer", fast_tier.OTHER]
    assert fixed["inventory"] == 0.1 and fixed["into model and optimizer"] == 0.2
    assert fixed[fast_tier.OTHER] == pytest.approx(0.6)  # 2.0 - 1.1 - 0.3
    # Parts that sum past recovery + load (medians of different launches): "other" is 0.
    fixed, _ = fast_tier.fixed_costs({**row, "load_s": 1.0})
    assert fixed[fast_tier.OTHER] == 0.0


def _speeds(read_gbps: float | None, link_gbps: float | None) -> tuple[Any, Any]:
    read = (
        {"gbps": read_gbps, "n": 3, "bytes": 10**9, "streams": 2, "bytes_per_rank": 5 * 10**8}
        if read_gbps
        else {"gbps": None, "n": 0, "why": "the medium's read speed: no copy"}
    )
    link = (
        {"gbps": link_gbps, "n": 3, "bytes": 5 * 10**8}
        if link_gbps
        else {"gbps": None, "n": 0, "why": "the link: the link job failed: boom"}
    )
    return read, link


def _fast_rows() -> dict[str, dict[str, Any]]:
    own, peer, _ = fast_tier.ROWS
    return {
        own: {"load_s": 1.0, "parts": {"check the copies": 0.55, "inventory": 0.1}},
        peer: {"load_s": 2.0, "parts": {"check the copies": 0.5, "fetch, in all": 0.6}},
    }


def test_own_copies_are_bound_by_the_read_speed_and_peer_copies_by_the_slower_of_link_and_read() -> (
    None
):
    own, peer, _ = fast_tier.ROWS
    got = fast_tier.bounds(_fast_rows(), *_speeds(4.0, 1.0))
    # Own: a node's share of the 4 GB/s read (2 nodes share the disk): 2 GB/s;
    # 1.2 x 0.5 GB / 2 GB/s + (0.1 inventory + 0.35 other) = 0.3 + 0.45: 0.75 s, under the
    # 1.0 s measured (0.55 s of it checking: more than 1.2 x the 0.25 s the read takes).
    assert got[own]["speed_gbps"] == 2.0 and got[own]["speed"] == "read / 2 nodes"
    assert got[own]["transfer_s"] == pytest.approx(0.3)
    assert got[own]["fixed"] == {"inventory": 0.1, fast_tier.OTHER: pytest.approx(0.35)}
    assert got[own]["fixed_s"] == pytest.approx(0.45)
    assert got[own]["bound_s"] == pytest.approx(0.75)
    assert (got[own]["measured_s"], got[own]["bytes_s"]) == (1.0, 0.55)
    assert got[own]["verdict"] == "MISSED" and got[own]["why"] is None
    # Peer: the link (1 GB/s) is slower than the read: 1.2 x 0.5 GB / 1 GB/s + 0.9 other =
    # 1.5 s < 2.0 s measured.
    assert got[peer]["speed_gbps"] == 1.0 and got[peer]["speed"] == "min(link, read / 2 nodes)"
    assert got[peer]["transfer_s"] == pytest.approx(0.6)
    assert got[peer]["fixed"] == {fast_tier.OTHER: pytest.approx(0.9)}
    assert got[peer]["bound_s"] == pytest.approx(1.5)
    assert got[peer]["verdict"] == "MISSED"
    # A slower medium (1 GB/s, 0.5 a node): own 1.2 x 0.5 / 0.5 + 0.45 = 1.65 s (MET); peer now
    # bound by the read (0.5 GB/s, slower than the 1 GB/s link): 1.2 + 0.9 = 2.1 s (MET).
    got = fast_tier.bounds(_fast_rows(), *_speeds(1.0, 1.0))
    assert got[own]["bound_s"] == pytest.approx(1.65) and got[own]["verdict"] == "MET"
    assert got[peer]["speed_gbps"] == 0.5
    assert got[peer]["bound_s"] == pytest.approx(2.1) and got[peer]["verdict"] == "MET"
    # Without the slack the peer copies' would be missed (1.0 + 0.9 = 1.9 s < 2.0 s): the 1.2 is
    # in the bound; with the link's speed for the own copies' bound it would be 1.05 s.
    assert fast_tier.bound_s(5 * 10**8, 0.5, 0.9, slack=1.0) < 2.0


@pytest.mark.parametrize(
    ("measured", "bound", "verdict"),
    [(1.0, 1.0, "MET"), (0.5, 1.0, "MET"), (1.01, 1.0, "MISSED"), (None, 1.0, "MISSED")],
)
def test_a_bound_is_met_at_or_under_it_and_missed_without_a_figure(
    measured: float | None, bound: float | None, verdict: str
) -> None:
    assert fast_tier.judge_bound(measured, bound) == verdict
    assert fast_tier.judge_bound(measured, None) == "MISSED"


def test_a_bound_not_measured_is_missed_saying_why() -> None:
    own, peer, _ = fast_tier.ROWS
    # No read speed: neither bound can be computed.
    got = fast_tier.bounds(_fast_rows(), *_speeds(None, 1.0))
    for row in (own, peer):
        assert got[row]["verdict"] == "MISSED" and got[row]["bound_s"] is None
        assert got[row]["why"] == "not measured: the medium's read speed: no copy"
    # No link: own copies still judged; peer copies missed, saying why.
    got = fast_tier.bounds(_fast_rows(), *_speeds(0.5, None))
    assert got[own]["verdict"] == "MET" and got[own]["why"] is None
    assert got[peer]["verdict"] == "MISSED"
    assert got[peer]["why"] == "not measured: the link: the link job failed: boom"
    assert got[peer]["fixed_s"] == pytest.approx(0.9)  # its costs are still reported
    # A row not launched.
    got = fast_tier.bounds({own: _fast_rows()[own]}, *_speeds(2.0, 1.0))
    assert got[peer]["verdict"] == "MISSED" and got[peer]["fixed"] == {}
    assert got[peer]["why"] == "not measured: the row was not launched"


def test_a_speed_is_the_median_of_its_rounds_and_says_why_when_none_was_measured() -> None:
    runs: list[dict[str, Any]] = [
        {"bytes": 10, "gbps": 4.0, "streams": 2, "bytes_per_rank": 5},
        {"why": "the link job failed: timeout"},
        {"bytes": 10, "gbps": 1.0, "streams": 2, "bytes_per_rank": 5},
        {"bytes": 10, "gbps": 2.0, "streams": 2, "bytes_per_rank": 5},
    ]
    got = fast_tier.speed(runs, "the read")
    assert (got["gbps"], got["min_gbps"], got["max_gbps"], got["n"]) == (2.0, 1.0, 4.0, 3)
    assert (got["streams"], got["bytes_per_rank"]) == (2, 5)
    assert fast_tier.speed([{"why": "no copy"}], "the read") == {
        "gbps": None,
        "n": 0,
        "why": "the read: no copy",
    }
    assert fast_tier.speed(None, "the link")["why"] == "the link: not measured in this run"


def _bounded() -> dict[str, Any]:
    """:func:`_result`, with the parts of its fast rows' launches and the speeds of 3 rounds."""
    result = _result()
    own, peer, _ = fast_tier.ROWS
    for launch in result["launches"][own]:  # recovery + load 1 s each
        launch["parts"] = {
            "check the copies": 0.25,
            "inventory": 0.05,
            "into model and optimizer": 0.2,
            "extra/ checked": 0.05,
        }
    for launch in result["launches"][peer]:  # recovery + load 5 s; checks 1, 2, 6 s (median 2)
        launch["parts"]["fetch, in all"] = 1.5
    per_rank = 500_000_000
    result["medium_reads"] = [
        {"bytes": 2 * per_rank, "streams": 2, "seconds": 1.0, "gbps": g, "bytes_per_rank": per_rank}
        for g in (1.0, 4.0, 2.0)
    ]
    result["link_transfers"] = [
        {"bytes": per_rank, "seconds": 1.0, "gbps": g, "transfers_s": [1.0]}
        for g in (0.6, 0.4, 0.5)
    ]
    return result


def test_the_report_judges_the_fast_tier_against_its_own_bounds_in_a_table() -> None:
    result = _bounded()
    summary = fast_tier.summarise(result)
    json.dumps(summary)  # the JSON summary holds the bounds
    own, peer, _ = fast_tier.ROWS
    stored = summary["bounds"]
    assert stored["read"]["gbps"] == 2.0 and stored["link"]["gbps"] == 0.5
    assert stored["rows"][own]["verdict"] == "MET" and stored["rows"][peer]["verdict"] == "MISSED"
    table = fast_tier.report(result, summary, "machine", "command")
    assert "#### The fast tier against its own bounds" in table
    # Own: a node's share of the 2 GB/s read, 1 GB/s: 1.2 x 500 MB / 1 GB/s = 0.60 s + fixed
    # 0.75 s (0.05 + 0.2 + 0.05, 0.45 other) = 1.35 s against 1.00 s measured, 0.25 s of it
    # reading and checking.
    assert (
        f"| {own} | 477 | 1.00 (read / 2 nodes) | 0.60 | 0.75 | 1.35 | 1.00 | 0.25 | MET |" in table
    )
    # Peer: the link's 0.5 GB/s: 1.2 s + fixed 1.5 s (other) = 2.7 s against 5.0 s measured,
    # 3.5 s of it checking (2.0) and fetching (1.5).
    assert (
        f"| {peer} | 477 | 0.50 (min(link, read / 2 nodes)) | 1.20 | 1.50 | 2.70 | 5.00 | 3.50 "
        "| MISSED |" in table
    )
    assert "its cold read speed: 2.00 GB/s (median of 3; 1.00\u20134.00)" in table
    assert "2 copies, one thread each" in table
    assert (
        "gloo on loopback between the simulated nodes: 0.50 GB/s (median of 3; 0.40\u20130.60)"
        in table
    )
    # Which fixed costs went into each bound.
    assert (
        f"- {own}: `inventory` 0.050, `into model and optimizer` 0.200, `extra/ checked` 0.050, "
        "`other` 0.450; 0.750 s in all (not timed: `unpickle it (in memory)`, "
        "`optimizer state made`, `extra/ loaded`)." in table
    )
    assert f"- {peer}: `other` 1.500; 1.500 s in all" in table


def test_the_report_says_a_bound_not_measured_is_missed_and_why() -> None:
    result = _result()  # no speeds measured (a run before them, or both failed)
    result["link_transfers"] = [{"why": "the link job failed: timeout"}]
    table = fast_tier.report(result, fast_tier.summarise(result), "machine", "command")
    own, peer, _ = fast_tier.ROWS
    why = "the medium's read speed: not measured in this run"
    assert (
        f"| {own} | — | — (read / 2 nodes) | — | 1.00 | — | 1.00 | 0.00 | MISSED (not measured: "
        f"{why}) |" in table
    )
    # The peer row's costs still shown: 2 s checking (the median of 1, 2, 6), 3 s the rest.
    assert (
        f"| {peer} | — | — (min(link, read / 2 nodes)) | — | 3.00 | — | 5.00 | 2.00 | "
        f"MISSED (not measured: {why}; the link: the link job failed: timeout) |"
    ) in table
    assert f"its cold read speed: not measured ({why})" in table
    assert "the simulated nodes: not measured (the link: the link job failed: timeout)" in table


def test_the_speeds_are_measured_each_round_between_the_launches(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    rows = fast_tier.rows_measured(True, True)
    order = fast_tier.round_order(rows, 1)
    assert order == [rows[0], fast_tier.MEDIUM, rows[1], fast_tier.LINK, *rows[2:]]
    # Round 2 is led by the second row, the others after it in reverse; each speed stays
    # right after the row it bounds.
    assert fast_tier.round_order(rows, 2) == [
        rows[1],
        fast_tier.LINK,
        rows[0],
        fast_tier.MEDIUM,
        *rows[2:][::-1],
    ]
    first = fast_tier.round_order(list(fast_tier.ROWS), 1)  # no stand-in set up below
    calls: list[str] = []

    def recover_once(scratch: Path, row: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        calls.append(row)
        return _launch(3.0, 1.0, 2.0, "fast" if row.startswith("fast") else "persistent", 0)

    def read_cold(scratch: Path) -> dict[str, Any]:
        calls.append(fast_tier.MEDIUM)
        return {"bytes": 2, "streams": 2, "seconds": 1.0, "gbps": 1.0, "bytes_per_rank": 1}

    def link_speed(scratch: Path, timeout: float) -> dict[str, Any]:
        calls.append(fast_tier.LINK)
        return {"why": "the link job failed: no"}

    monkeypatch.setattr(fast_tier, "prepare", lambda *args: _result()["saves"])
    monkeypatch.setattr(fast_tier, "recover_once", recover_once)
    monkeypatch.setattr(fast_tier, "read_cold", read_cold)
    monkeypatch.setattr(fast_tier, "link_speed", link_speed)
    result = fast_tier.measure(tmp_path, "quick", 2, 60.0)
    second = fast_tier.round_order(list(fast_tier.ROWS), 2)
    assert calls == first + second
    assert len(result["medium_reads"]) == 2 and result["link_transfers"][0]["why"]


def test_the_cold_read_reads_every_copy_the_serving_node_holds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from lightning_mcore_ckpt.fast import files
    from lightning_mcore_ckpt.launch.namespaces import node_storage

    assert fast_tier.read_cold(tmp_path)["why"].startswith("no sealed fast-tier copy")
    assert fast_tier.link_speed(tmp_path, 1.0)["why"].startswith("no payload to size it by")
    step = files.step_dir(
        node_storage(tmp_path / "snapshot" / "local", fast_tier.NODES - 1) / "fast",
        fast_tier.KILLED_AT,
    )
    sizes = {0: 3 * fast_tier.MiB + 5, 1: 1000}  # its peer's copy, its own
    for rank, size in sizes.items():
        _sealed_copy(step, rank, size)
    monkeypatch.setattr(fast_tier.os, "sync", lambda: None)  # not the whole machine's, here
    got = fast_tier.read_cold(tmp_path)
    copies = {r: 2 * s + (step / files.seal_name(r)).stat().st_size for r, s in sizes.items()}
    assert got["streams"] == 2
    assert got["bytes"] == sum(copies.values())
    assert got["bytes_per_rank"] == copies[0]
    assert got["gbps"] == pytest.approx(got["bytes"] / got["seconds"] / 1e9)


# --- the fast tier on /dev/shm -----------------------------------------------------------------


def _with_shm(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with :data:`fast_tier.SHM_ROW` launched (recovery + load 0.8 s each, 0.1 s of
    it checking) and ``/dev/shm`` read in 3 rounds at 8, 2 and 4 GB/s."""
    result["launches"][fast_tier.SHM_ROW] = [
        {
            **_launch(3.0, 2.0, 2.8, "fast", 0),
            "parts": {"check the copies": 0.1, "inventory": 0.05},
        }
        for _ in range(2)
    ]
    result["shm"] = "each node's directory under `/dev/shm` (tmpfs: read from memory)"
    result["shm_reads"] = [
        {"bytes": 10**9, "streams": 2, "seconds": 1.0, "gbps": g, "bytes_per_rank": 500_000_000}
        for g in (8.0, 2.0, 4.0)
    ]
    return result


def test_the_dev_shm_row_is_bound_by_dev_shms_read_speed_not_the_disks() -> None:
    own, _, _ = fast_tier.ROWS
    rows = {**_fast_rows(), fast_tier.SHM_ROW: {"load_s": 0.5, "parts": {"inventory": 0.1}}}
    read, link = _speeds(0.5, 1.0)  # the disk: 0.5 GB/s, 0.25 a node
    shm = {"gbps": 8.0, "n": 3, "bytes": 10**9, "streams": 2, "bytes_per_rank": 5 * 10**8}
    got = fast_tier.bounds(rows, read, link, shm)[fast_tier.SHM_ROW]
    # A node's share of /dev/shm's 8 GB/s: 4 GB/s; 1.2 x 0.5 GB / 4 GB/s = 0.15 s, + 0.1
    # inventory + 0.4 other: 0.65 s, against 0.5 s measured: MET. With the disk's 0.25 GB/s a
    # node the bound would be 2.4 + 0.5 s.
    assert got["speed"] == "/dev/shm read / 2 nodes" and got["speed_gbps"] == 4.0
    assert got["transfer_s"] == pytest.approx(0.15)
    assert got["fixed"] == {"inventory": 0.1, fast_tier.OTHER: pytest.approx(0.4)}
    assert got["bound_s"] == pytest.approx(0.65)
    assert got["verdict"] == "MET" and got["why"] is None
    # The disk's own-copies bound is unchanged by it.
    assert fast_tier.bounds(rows, read, link, shm)[own] == fast_tier.bounds(rows, read, link)[own]
    # Slower memory (1 GB/s, 0.5 a node): 1.2 + 0.5 = 1.7 s; a measured 2 s is MISSED.
    slow = fast_tier.bounds(
        {fast_tier.SHM_ROW: {"load_s": 2.0, "parts": {}}}, read, link, {**shm, "gbps": 1.0}
    )[fast_tier.SHM_ROW]
    assert slow["bound_s"] == pytest.approx(1.2 + 2.0) and slow["verdict"] == "MET"
    slow = fast_tier.bounds(
        {fast_tier.SHM_ROW: {"load_s": 2.0, "parts": {"check the copies": 1.9}}},
        read,
        link,
        {**shm, "gbps": 2.0},
    )[fast_tier.SHM_ROW]
    # 1.2 x 0.5 / 1 = 0.6 s + 0.1 other: 0.7 s < 2.0 s measured.
    assert slow["bound_s"] == pytest.approx(0.7) and slow["verdict"] == "MISSED"


def test_the_dev_shm_bound_not_measured_is_missed_saying_why() -> None:
    read, link = _speeds(2.0, 1.0)
    rows = {**_fast_rows(), fast_tier.SHM_ROW: {"load_s": 0.5, "parts": {}}}
    # No /dev/shm speed given: MISSED, why; the other rows still judged.
    got = fast_tier.bounds(rows, read, link)
    assert got[fast_tier.SHM_ROW]["verdict"] == "MISSED"
    assert got[fast_tier.SHM_ROW]["bound_s"] is None
    assert got[fast_tier.SHM_ROW]["why"] == (
        "not measured: /dev/shm's read speed: not measured in this run"
    )
    assert got[fast_tier.ROWS[0]]["why"] is None
    # Measured speed, the row not launched.
    shm = {"gbps": 8.0, "n": 1, "bytes": 10**9, "streams": 2, "bytes_per_rank": 5 * 10**8}
    got = fast_tier.bounds(_fast_rows(), read, link, shm)
    assert got[fast_tier.SHM_ROW]["why"] == "not measured: the row was not launched"
    assert got[fast_tier.SHM_ROW]["verdict"] == "MISSED"


def test_the_dev_shm_row_is_in_every_table_the_json_and_judged_against_each_stand_in() -> None:
    result = _with_shm(_bounded())
    summary = fast_tier.summarise(result)
    json.dumps(summary)
    shm_row, own, local = fast_tier.SHM_ROW, fast_tier.ROWS[0], fast_tier.ROWS[2]
    assert summary["bounds"]["shm"]["gbps"] == 4.0  # the median of 8, 2, 4
    stored = summary["bounds"]["rows"][shm_row]
    # A node's share: 2 GB/s; 1.2 x 500 MB / 2 GB/s = 0.30 s + 0.70 s fixed (0.05 inventory,
    # 0.65 other: 0.8 - 0.1 - 0.05) = 1.00 s against 0.80 s measured.
    assert stored["bound_s"] == pytest.approx(1.0) and stored["verdict"] == "MET"
    verdicts = {(f, p): v for f, p, _, _, v in fast_tier.targets(summary["rows"])}
    assert verdicts[(shm_row, local)] == "MET"  # 0.8 s against 4 s
    assert (own, local) in verdicts
    table = fast_tier.report(result, summary, "machine", "command")
    lines = [line for line in table.splitlines() if line.startswith(f"| {shm_row} | ")]
    # The recovery table, where the recovery went, where the load went, against the
    # persistent tier, against its own bound.
    assert len(lines) == 5, table
    # recovery + load 0.80 s, persistent / this 4 / 0.8.
    assert lines[0].split(" | ")[6:8] == ["0.80", "5.00"]
    assert f"| {shm_row} | {local} | 0.80 | 4.00 | 0.20 | MET |" in table
    assert (
        f"| {shm_row} | 477 | 2.00 (/dev/shm read / 2 nodes) | 0.30 | 0.70 | 1.00 | 0.80 | 0.10 "
        "| MET |" in table
    )
    assert "`/dev/shm`: its read speed: 4.00 GB/s (median of 3; 2.00\u20138.00)" in table
    assert "nothing dropped from the page cache" in table
    assert f"`{shm_row}`: the own copies' launch with each node's directory under" in table


def test_the_dev_shm_row_not_measured_says_why_in_the_report_and_makes_no_figures() -> None:
    result = {**_bounded(), "shm": None, "shm_why": "/dev/shm has 10 MiB free, 300 MiB needed"}
    summary = fast_tier.summarise(result)
    table = fast_tier.report(result, summary, "machine", "command")
    why = "/dev/shm has 10 MiB free, 300 MiB needed"
    assert f"`{fast_tier.SHM_ROW}`: not measured ({why})." in table
    got = summary["bounds"]["rows"][fast_tier.SHM_ROW]
    full = f"not measured: the row was not launched; /dev/shm's read speed: {why}"
    assert got["verdict"] == "MISSED" and got["why"] == full
    assert (
        f"| {fast_tier.SHM_ROW} | 477 | — (/dev/shm read / 2 nodes) | — | — | — | — | — | MISSED ({full}) |"
        in table
    )
    assert f"`/dev/shm`: its read speed: not measured (/dev/shm's read speed: {why})." in table
    assert not [r for r, _, _, _, _ in fast_tier.targets(summary["rows"]) if r == fast_tier.SHM_ROW]


def test_the_dev_shm_row_and_its_speed_are_interleaved_with_the_others_each_round(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    rows = fast_tier.rows_measured(True, True, True)
    own, peer, persistent = fast_tier.ROWS
    assert rows == [own, peer, fast_tier.SHM_ROW, persistent, fast_tier.THROTTLED, fast_tier.S3_ROW]
    first = fast_tier.round_order(rows, 1)
    assert first == [
        own,
        fast_tier.MEDIUM,
        peer,
        fast_tier.LINK,
        fast_tier.SHM_ROW,
        fast_tier.SHM_MEDIUM,
        persistent,
        fast_tier.THROTTLED,
        fast_tier.S3_ROW,
    ]
    speeds = set(fast_tier.SPEED_AFTER.values())
    leaders = []
    for r in range(1, len(rows) + 1):
        order = fast_tier.round_order(rows, r)
        assert sorted(order) == sorted(first), r
        leaders.append(order[0])
        for row, speed in fast_tier.SPEED_AFTER.items():  # each speed right after its row
            assert order[order.index(row) + 1] == speed, (r, order)
        recovery = [item for item in order if item not in speeds]
        # The others after the leader in the rows' cyclic order in odd rounds, in reverse in
        # even ones.
        cycle = recovery if r % 2 else [recovery[0], *recovery[1:][::-1]]
        k = rows.index(cycle[0])
        assert cycle == rows[k:] + rows[:k], (r, recovery)
    assert leaders == rows  # every row leads a round, in turn
    calls: list[str] = []
    shms: list[Any] = []

    def recover_once(scratch: Path, row: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        calls.append(row)
        shms.append(args[-1])
        return _launch(3.0, 1.0, 2.0, "fast" if row.startswith("fast") else "persistent", 0)

    def speed(name: str) -> Any:
        def measured(*args: Any) -> dict[str, Any]:
            calls.append(name)
            if name == fast_tier.SHM_MEDIUM:
                assert isinstance(args[1], fast_tier.ShmDir) and args[1].base.is_dir()
            return {"bytes": 2, "streams": 2, "seconds": 1.0, "gbps": 1.0, "bytes_per_rank": 1}

        return measured

    monkeypatch.setattr(fast_tier, "prepare", lambda *args: _result()["saves"])
    monkeypatch.setattr(fast_tier, "recover_once", recover_once)
    monkeypatch.setattr(fast_tier, "read_cold", speed(fast_tier.MEDIUM))
    monkeypatch.setattr(fast_tier, "link_speed", speed(fast_tier.LINK))
    monkeypatch.setattr(fast_tier, "read_shm", speed(fast_tier.SHM_MEDIUM))
    shm_root = tmp_path / "shm"
    shm_root.mkdir()
    result = fast_tier.measure(tmp_path / "scratch", "quick", 2, 60.0, shm_root=shm_root)
    measured = fast_tier.rows_measured(False, False, True)
    assert calls == fast_tier.round_order(measured, 1) + fast_tier.round_order(measured, 2)
    assert len(result["launches"][fast_tier.SHM_ROW]) == 2 and len(result["shm_reads"]) == 2
    assert result["shm"].startswith(f"each node's directory under `{shm_root}`")
    assert result["shm_why"] is None
    # The ShmDir handed to every launch; its directory removed once the rounds are done.
    assert all(isinstance(s, fast_tier.ShmDir) for s in shms)
    assert list(shm_root.iterdir()) == []


def test_the_dev_shm_directory_is_removed_when_a_launch_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def recover_once(scratch: Path, row: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        raise RuntimeError("a rank died")

    monkeypatch.setattr(fast_tier, "prepare", lambda *args: _result()["saves"])
    monkeypatch.setattr(fast_tier, "recover_once", recover_once)
    shm_root = tmp_path / "shm"
    shm_root.mkdir()
    with pytest.raises(RuntimeError, match="a rank died"):
        fast_tier.measure(tmp_path / "scratch", "quick", 1, 60.0, shm_root=shm_root)
    assert list(shm_root.iterdir()) == []


def test_without_room_on_dev_shm_the_row_is_not_launched_saying_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[str] = []

    def recover_once(scratch: Path, row: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        calls.append(row)
        return _launch(3.0, 1.0, 2.0, "fast" if row.startswith("fast") else "persistent", 0)

    monkeypatch.setattr(fast_tier, "prepare", lambda *args: _result()["saves"])
    monkeypatch.setattr(fast_tier, "recover_once", recover_once)
    monkeypatch.setattr(fast_tier, "read_cold", lambda *args: {"why": "no copy"})
    monkeypatch.setattr(fast_tier, "link_speed", lambda *args: {"why": "no link"})
    result = fast_tier.measure(tmp_path, "quick", 1, 60.0, shm_root=tmp_path / "absent")
    assert fast_tier.SHM_ROW not in calls and fast_tier.SHM_ROW not in result["launches"]
    assert result["shm"] is None and result["shm_why"] == f"{tmp_path / 'absent'} is absent"
    assert result["shm_reads"] == []
    table = fast_tier.report(result, fast_tier.summarise(result), "machine", "command")
    assert f"`{fast_tier.SHM_ROW}`: not measured ({tmp_path / 'absent'} is absent)." in table


def test_dev_shm_is_refused_when_absent_or_too_small_and_its_copy_leaves_the_snapshot_as_is(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from lightning_mcore_ckpt.launch.namespaces import node_storage

    scratch = tmp_path / "scratch"
    for node in range(fast_tier.NODES):
        fast = node_storage(scratch / "snapshot" / "local", node) / "fast"
        fast.mkdir(parents=True)
        (fast / "state").write_bytes(b"x" * (3 * fast_tier.MiB))
    root = tmp_path / "shm"
    assert fast_tier.ShmDir.open(scratch, root) == (None, f"{root} is absent")
    root.mkdir()
    usage = fast_tier.shutil.disk_usage(root)
    # 2 x 6 MiB + 256 MiB needed; 100 MiB free.
    monkeypatch.setattr(
        fast_tier.shutil, "disk_usage", lambda path: usage._replace(free=100 * fast_tier.MiB)
    )
    got, why = fast_tier.ShmDir.open(scratch, root)
    assert got is None
    assert (
        why
        == f"{root} has 100 MiB free, 268 MiB needed (2 x the nodes' directories, 6 MiB, + 256 MiB)"
    )
    assert list(root.iterdir()) == []
    monkeypatch.undo()
    shm, why = fast_tier.ShmDir.open(scratch, root)
    assert shm is not None and why == "" and shm.base.parent == root
    assert shm.needed == 6 * fast_tier.MiB
    try:
        node_dir = shm.place(scratch / "snapshot")
        assert node_dir == shm.base / "local"
        for node in range(fast_tier.NODES):
            copied = node_storage(node_dir, node) / "fast" / "state"
            assert copied.read_bytes() == b"x" * (3 * fast_tier.MiB)
            copied.write_bytes(b"changed by a launch")
        shm.clear()
        node_dir = shm.place(scratch / "snapshot")  # afresh: what the killed job left
        assert (node_storage(node_dir, 1) / "fast" / "state").stat().st_size == 3 * fast_tier.MiB
        assert (
            node_storage(scratch / "snapshot" / "local", 1) / "fast" / "state"
        ).stat().st_size == (3 * fast_tier.MiB)
    finally:
        shm.close()
    assert list(root.iterdir()) == []


def test_dev_shms_read_reads_each_nodes_own_copy_from_the_copy_on_dev_shm(
    tmp_path: Path,
) -> None:
    from lightning_mcore_ckpt.fast import files
    from lightning_mcore_ckpt.launch.namespaces import node_storage

    scratch, root = tmp_path / "scratch", tmp_path / "shm"
    root.mkdir()
    (scratch / "snapshot" / "local.nodes").mkdir(parents=True)
    shm, _ = fast_tier.ShmDir.open(scratch, root)
    assert shm is not None
    try:
        assert fast_tier.read_shm(scratch, shm)["why"].startswith("no sealed fast-tier copy")
        sizes = {0: 3 * fast_tier.MiB + 5, 1: 1000}
        for rank, size in sizes.items():
            node = rank // fast_tier.PER_NODE
            step = files.step_dir(
                node_storage(scratch / "snapshot" / "local", node) / "fast", fast_tier.KILLED_AT
            )
            _sealed_copy(step, rank, size)
            # A peer's copy on the node too: not read by the own copies' ranks.
            peer = (rank + 1) % 2
            (step / files.files_of(peer)[0]).write_bytes(b"y" * 10 * fast_tier.MiB)
        got = fast_tier.read_shm(scratch, shm)
        seals = {
            r: (
                files.step_dir(
                    node_storage(scratch / "snapshot" / "local", r) / "fast", fast_tier.KILLED_AT
                )
                / files.seal_name(r)
            )
            .stat()
            .st_size
            for r in sizes
        }
        copies = {r: 2 * s + seals[r] for r, s in sizes.items()}
        assert got["streams"] == 2 and got["bytes"] == sum(copies.values())
        assert got["bytes_per_rank"] == copies[0]
        assert not fast_tier.node_storage_root(shm.node_dir).exists()  # cleared after the read
    finally:
        shm.close()
