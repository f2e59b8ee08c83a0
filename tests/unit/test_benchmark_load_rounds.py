"""The cold-load rounds of the benchmark (``python -m benchmarks --only-loads``): its per-round
ratios, its read limit and its targets, on made-up figures; its rounds' orders.

Axes: which method is faster in a round (ours, the other), a disk that slows down in one round
for every method (the ratios stay), which read is the limit (our files, the torch.save file),
bytes that differ between the reads, the target's edge (just met, just missed).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import load_rounds  # noqa: E402 - the repository's benchmarks, not a package


def _result(seconds: dict[str, list[float]], ours_bytes: int = 1000) -> dict[str, Any]:
    return {
        "rounds": len(seconds["ours"]),
        "seconds": seconds,
        "phases": [{"shard reads (in both)": 0.3}, {"shard reads (in both)": 0.5}],
        "threads": 4,
        "bytes": {"ours": ours_bytes, "read: our files": ours_bytes, "read: torch.save file": 500},
    }


def test_ratios_are_taken_within_each_round_then_their_median() -> None:
    # The disk slows down 3x in the second round, for every method: a comparison of medians
    # across rounds would mix minutes; the per-round ratios do not move.
    seconds = {
        "ours": [1.0, 3.0, 1.0],
        "torch.load": [2.0, 6.0, 2.0],
        "plain DCP": [0.5, 1.5, 0.5],
        "raw dist_checkpointing": [1.0, 3.0, 1.0],
        "read: our files": [0.9, 2.7, 0.9],
        "read: torch.save file": [0.5, 1.5, 0.5],  # half the bytes: the same speed
    }
    summary = load_rounds.summarise(_result(seconds))
    assert summary["ratios"]["ours vs torch.load"] == pytest.approx(2.0)
    assert summary["ratios"]["ours vs plain DCP"] == pytest.approx(0.5)
    assert summary["ratios"]["ours vs raw dist_checkpointing"] == pytest.approx(1.0)
    # The faster read of each round, scaled to our bytes: 0.9 s and 1.0 s for 1000 bytes.
    assert summary["ratios"]["ours of the read limit"] == pytest.approx(0.9)
    # Our files alone (the torch.save file is the faster here): 0.9 s for our 1000 bytes.
    assert summary["ratios"]["ours of reading our files whole"] == pytest.approx(0.9)
    assert summary["median_s"]["ours"] == 1.0
    assert summary["phases"]["shard reads (in both)"] == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("ours", "verdicts"),
    [
        (1.0, ["MET", "MET", "MET"]),  # faster than both; 0.8 of the read limit exactly
        (1.26, ["MET", "MISSED", "MISSED"]),  # slower than DCP; 0.63 of the limit
        (2.1, ["MISSED", "MISSED", "MISSED"]),
    ],
)
def test_targets(ours: float, verdicts: list[str]) -> None:
    seconds = {
        "ours": [ours] * 2,
        "torch.load": [2.0] * 2,
        "plain DCP": [1.25] * 2,
        "read: our files": [0.8] * 2,
        "read: torch.save file": [0.9] * 2,
    }
    summary = load_rounds.summarise(_result(seconds, ours_bytes=500))
    found = {name: verdict for name, verdict, _ in summary["targets"]}
    assert found == {
        "cold load >= torch.load": verdicts[0],
        "cold load >= plain DCP": verdicts[1],
        "cold load >= 0.8 x parallel read limit": verdicts[2],
    }
    table = load_rounds.report(
        [{"size": "1G", "world": 1, "result": _result(seconds), "summary": summary}], "m", "c"
    )
    assert f"{verdicts[2]:6s} cold load >= 0.8 x parallel read limit" in table


def test_every_method_leads_a_round_and_the_order_alternates() -> None:
    names = load_rounds.METHODS
    orders = [load_rounds.order_of(names, i) for i in range(len(names))]
    assert [order[0] for order in orders] == list(names)
    assert all(sorted(order) == sorted(names) for order in orders)
    # Who follows whom reverses from one round to the next.
    assert orders[0][1] == names[1]
    assert orders[1][1] == names[0]


def test_reading_our_files_whole_is_scaled_to_the_bytes_our_load_reads() -> None:
    # Our load reads 1000 bytes; the whole-file read read 2000 (another rank's extra/ too) in
    # 1.6 s: 0.8 s for ours, against a load of 1.0 s. The torch.save file, faster, does not
    # enter this ratio.
    seconds = {
        "ours": [1.0, 2.0],
        "read: our files": [1.6, 3.2],
        "read: torch.save file": [0.1, 0.2],
    }
    result = _result(seconds)
    result["bytes"]["read: our files"] = 2000
    summary = load_rounds.summarise(result)
    assert summary["ratios"]["ours of reading our files whole"] == pytest.approx(0.8)
    assert summary["ratios"]["ours of the read limit"] == pytest.approx(0.2)  # 0.2 s for 1000
