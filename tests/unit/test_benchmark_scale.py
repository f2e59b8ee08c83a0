"""The scale mode of the benchmark (``python -m benchmarks --scale``): its figures from every
rank's measurements, its targets (MET only when measured and within bounds), its table, and
the probe that times a save's collectives. Checked on made-up figures: no run needed.

Axes: the coordination growth (within 1.2 x, above), the save time's growth (within the bytes
per rank's shrink, above), figures missing (coordination, save time, a single rank count),
collectives' order on the ranks (the same, different), a collective nested in another, called
outside a save, called from another thread; the command line's refusals.
"""

from __future__ import annotations

import copy
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import scale  # noqa: E402 - the repository's benchmarks, not a package

MiB = 2**20


def _save(collectives: list[tuple[str, float]], planning: float, profiled: bool = False) -> dict:
    return {
        "collectives": collectives,
        "save_s": 1.0,
        "plan_check_s": planning / 10,
        "planning_mcore_s": planning,
        "dcp_plan_s": planning / 2,
        "profiled": profiled,
    }


def _rank(rank: int, world: int, coordination: float, save_s: float) -> dict[str, Any]:
    """A rank's figures from 6 saves per mode (the last profiled): each save has two
    collectives; rank 0 arrives last at the first (waits for nobody), rank 1 at the second;
    the other ranks wait 0.5 s more."""

    def calls(i: int) -> list[tuple[str, float]]:
        wait = [0.0 if rank == 0 else 0.5, 0.0 if rank == 1 else 0.5]
        return [
            ("all_reduce", coordination / 2 + wait[0]),
            ("gather_object", coordination / 2 + wait[1]),
        ]

    modes: dict[str, Any] = {}
    for mode, _, async_save in scale.MODES:
        figures: dict[str, Any] = {
            "saves": [_save(calls(i), 0.1 * world, profiled=i == 5) for i in range(6)],
            "state_bytes": 64 * MiB // world,
        }
        if mode == "cached":
            figures["load_s"] = [1.0 + rank, 2.0 + rank, 3.0 + rank]  # slowest: the last rank
        if rank == 0:
            # The first two saves slower (planned afresh), the profiled last one too.
            totals = [9.0, 9.0, save_s, save_s, save_s, 9.0]
            figures["records"] = [
                {
                    "global_step": 2 * (i + 1),
                    "total_time_s": t,
                    "blocking_time_s": t / 10 if async_save else t,
                    "size_bytes": 64 * MiB,
                }
                for i, t in enumerate(totals)
            ]
            figures["step_files"] = {
                "files": 10 * world,
                "metadata_bytes": 1000 * world,
                "extra_bytes": 500 * world,
            }
            if not async_save:
                figures["profile"] = ["45 samples", "incl % self % incl s  function"]
        modes[mode] = figures
    return {"rank": rank, "modes": modes, "collective_latency_s": 0.001 * world}


def _rows(low: float = 0.1, high: float = 0.11, save_low: float = 2.0, save_high: float = 3.0):
    """Rows at 2 and 8 ranks: coordination ``low`` -> ``high``; save time ``save_low`` ->
    ``save_high`` (bytes per rank shrink 4 x: 32 MiB -> 8 MiB)."""
    return [
        scale.summarise(2, [_rank(r, 2, low, save_low) for r in range(2)], "tp"),
        scale.summarise(8, [_rank(r, 8, high, save_high) for r in range(8)], "tp"),
    ]


def _verdicts(rows: list[dict[str, Any]]) -> dict[str, tuple[bool, str]]:
    return {name: (ok, value) for name, ok, value in scale.targets(rows)}


COORDINATION = "coordination per save, cached plans: 8 ranks <= 1.2 x 2"
CACHED = "time per save (cached plans) grows no faster than bytes per rank shrink"
UNCACHED = "time per save (uncached plans) grows no faster than bytes per rank shrink"


def test_a_row_takes_the_steady_saves_the_critical_path_and_the_slowest_rank() -> None:
    low, high = _rows()
    # Coordination: per collective the shortest rank (the one that arrived last), summed.
    assert low["cached"]["coordination_s"] == pytest.approx(0.1)
    assert high["cached"]["coordination_s"] == pytest.approx(0.11)
    assert low["cached"]["coordination_aligned"] is True
    # The slowest rank's collectives include its waits: 0.5 s at one of the two.
    assert low["cached"]["collective_s_slowest"] == pytest.approx(0.6)
    assert low["cached"]["collective_calls"] == 2
    # Steady saves: the first two and the profiled last left out.
    assert low["cached"]["saves_measured"] == 3
    assert low["cached"]["save_s"] == 2.0 and high["uncached"]["save_s"] == 3.0
    assert low["async"]["blocking_s"] == pytest.approx(0.2)
    # Planning: the slowest rank's check and Megatron-Core's planning.
    assert high["cached"]["planning_s"] == pytest.approx(0.8 + 0.08)
    # Load: the slowest rank of each repeat, the median of the repeats.
    assert low["cached"]["load_s"] == 3.0 and high["cached"]["load_s"] == 9.0
    assert low["bytes_per_rank"] == 32 * MiB and high["bytes_per_rank"] == 8 * MiB
    assert high["cached"]["step_files"]["files"] == 80


def test_ranks_whose_collectives_differ_get_the_smallest_rank_total() -> None:
    same = [[("a", 1.0), ("b", 3.0)], [("a", 2.0), ("b", 1.0)]]
    assert scale.critical_path(same) == (2.0, True)
    differ = [[("a", 1.0), ("b", 3.0)], [("b", 2.0), ("a", 1.0)]]
    assert scale.critical_path(differ) == (3.0, False)
    fewer = [[("a", 1.0), ("b", 3.0)], [("a", 2.5)]]
    assert scale.critical_path(fewer) == (2.5, False)


def test_a_run_within_every_bound_meets_every_target() -> None:
    verdicts = _verdicts(_rows())
    assert set(verdicts) == {COORDINATION, CACHED, UNCACHED}
    assert all(ok for ok, _ in verdicts.values()), verdicts
    assert "1.10 x" in verdicts[COORDINATION][1]
    assert "save time x 1.50, bytes per rank / 4.00" in verdicts[CACHED][1]


# Each case: the rows' change, and the targets it misses.
MISSES = {
    "coordination grows 1.3 x": (lambda rows: _rows(high=0.13), {COORDINATION}),
    "save time grows faster than bytes per rank shrink": (
        lambda rows: _rows(save_high=8.5),
        {CACHED, UNCACHED},
    ),
    "coordination not measured": (
        lambda rows: [
            {**r, "cached": {k: v for k, v in r["cached"].items() if k != "coordination_s"}}
            for r in rows
        ],
        {COORDINATION},
    ),
    "the uncached fits failed": (
        lambda rows: [{k: v for k, v in r.items() if k != "uncached"} for r in rows],
        {UNCACHED},
    ),
    "bytes per rank not measured": (
        lambda rows: [{k: v for k, v in r.items() if k != "bytes_per_rank"} for r in rows],
        {CACHED, UNCACHED},
    ),
}


@pytest.mark.parametrize("case", sorted(MISSES))
def test_a_run_that_misses_a_target_is_told_which(case: str) -> None:
    change, missed = MISSES[case]
    verdicts = _verdicts(change(copy.deepcopy(_rows())))
    assert {name for name, (ok, _) in verdicts.items() if not ok} == missed, verdicts


def test_one_rank_count_judges_nothing() -> None:
    ((_, ok, value),) = scale.targets(_rows()[:1])
    assert not ok and "two or more" in value


def test_the_table_puts_the_rank_counts_side_by_side_with_ratios_targets_and_profiles() -> None:
    data = {
        "rows": _rows(),
        "size": "256M",
        "shard": "tp",
        "machine": {"cpus": 2},
        "oversubscribed": 8,
    }
    text = scale.table(data)
    assert "## Scale: 2, 8 ranks" in text and "8 ranks share 2 cores (oversubscribed)" in text
    assert "| coordination s (cached) | 0.1000 | 0.1100 | 1.10 x |" in text
    assert "| bytes/rank MiB | 32 | 8 | 0.25 x |" in text
    assert "| files/step | 20 | 80 | 4.00 x |" in text
    assert f"MET   {COORDINATION}" in text
    assert "### Profile of the planning of rank 0's save, 8 ranks, uncached plans" in text
    missed = scale.table({**data, "rows": _rows(high=0.2)})
    assert f"MISSED  {COORDINATION}" in missed


# --- the probe ------------------------------------------------------------------------------


def test_the_probe_counts_a_saves_outermost_collectives_of_its_thread_only() -> None:
    probe = scale.SaveProbe()
    inner = probe.timed_collective("all_gather", lambda: None)
    outer = probe.timed_collective("all_gather_object", lambda: inner())
    plan = probe.timed_phase("planning_mcore_s", lambda: outer())

    def save() -> None:
        plan()
        inner()
        other = threading.Thread(target=inner)  # another thread's collective: not the save's
        other.start()
        other.join()

    outer()  # outside a save: not counted
    probe.timed_save(save)()
    ((record,),) = [probe.take()]
    assert [name for name, _ in record["collectives"]] == ["all_gather_object", "all_gather"]
    assert record["planning_mcore_s"] >= 0 and record["save_s"] >= record["planning_mcore_s"]
    assert probe.take() == []


def test_a_profiled_save_samples_its_planning_and_is_left_out_of_the_medians() -> None:
    import time

    probe = scale.SaveProbe()

    def planning() -> None:
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            pass

    plan = probe.timed_phase("planning_mcore_s", planning)
    probe.profile_next = True
    probe.timed_save(plan)()
    (record,) = probe.take()
    assert record["profiled"] is True and probe.profile is not None
    assert any("(planning)" in line for line in probe.profile[2:]), probe.profile
    saves = [{"profiled": False}] * 4 + [{"profiled": True}]
    assert scale._steady(saves) == [2, 3]


# --- the command line -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--procs", "2,3"], "that divide 8"),
        (["--procs", "4"], "two or more rank counts"),
        (["--procs", "2,x"], "pass rank counts"),
        (["--saves", "2"], "--saves 2: pass 3 or more"),
        (["--sizes", "256M,1G"], "pass one state"),
        (["--device", "cuda"], "runs on the CPU"),
    ],
)
def test_the_scale_mode_refuses_bad_arguments_naming_them(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["--scale", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
