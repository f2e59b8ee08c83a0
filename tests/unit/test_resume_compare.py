"""The resume check's comparison: the first divergence, what differs, what is still identical."""

from __future__ import annotations

import copy
from typing import Any

from lightning_mcore_ckpt.resume_check._compare import (
    compare_finals,
    compare_timelines,
    start_index,
)
from lightning_mcore_ckpt.resume_check._run import InterruptionResult, ResumeReport


def _record(step: int, batch: int, epoch: int = 0, **over: Any) -> dict[str, Any]:
    record = {
        "loop": {"epoch": epoch, "batch": batch, "global_step": step, "stepped_batches": step},
        "data": [f"s{step}a", f"s{step}b"],
        "rng": {"torch": f"t{step}", "megatron:model-parallel-rng": f"m{step}"},
        "weights": f"w{step}",
        "optimizer": f"o{step}",
        "scheduler": f"l{step}",
        "loss": f"x{step}",
        "stepped": True,
    }
    record.update(over)
    return record


def _timeline(n: int = 6) -> list[dict[str, Any]]:
    return [_record(step, step % 3, epoch=step // 3) for step in range(n)]


def _ranks(timeline: list[dict[str, Any]], ranks: int = 2) -> dict[int, list[dict[str, Any]]]:
    return {r: copy.deepcopy(timeline) for r in range(ranks)}


def test_identical_runs_have_no_divergence() -> None:
    ref = _ranks(_timeline())
    assert compare_timelines(ref, copy.deepcopy(ref)) is None


def test_a_resumed_run_is_aligned_at_the_step_it_resumed_from() -> None:
    ref = _ranks(_timeline())
    resumed = {r: t[3:] for r, t in copy.deepcopy(ref).items()}
    assert start_index(ref[0], 3) == 3
    assert compare_timelines(ref, resumed, resumed_from=3) is None


def test_an_rng_stream_that_differs_on_one_rank_is_named_with_its_rank() -> None:
    ref = _ranks(_timeline())
    resumed = {r: t[3:] for r, t in copy.deepcopy(ref).items()}
    resumed[1][0]["rng"]["megatron:model-parallel-rng"] = "other"
    found = compare_timelines(ref, resumed, resumed_from=3)
    assert found is not None
    assert found.step == 4 and found.epoch == 1 and found.batch == 0
    assert found.differs == {"rng:megatron:model-parallel-rng": [1]}
    assert "Megatron-Core RNG tracker 'model-parallel-rng' (dropout) differs on rank 1" in (
        found.message
    )
    assert "data order, weights, optimizer state identical" in found.message
    assert "weights identical until then" in found.message


def test_the_first_divergence_wins_over_later_ones() -> None:
    ref = _ranks(_timeline())
    run = copy.deepcopy(ref)
    run[0][4]["weights"] = "other"
    run[0][2]["data"] = ["zz", "yy"]
    found = compare_timelines(ref, run)
    assert found is not None and found.step == 3 and set(found.differs) == {"data"}
    assert "expected samples ['s2a', 's2b'], got ['zz', 'yy']" in found.detail


def test_only_the_loss_differing_points_at_state_outside_the_checkpoint() -> None:
    ref = _ranks(_timeline())
    resumed = {r: t[2:] for r, t in copy.deepcopy(ref).items()}
    for t in resumed.values():
        t[0]["loss"] = "changed"
    found = compare_timelines(ref, resumed, resumed_from=2)
    assert found is not None and found.differs == {"loss": [0, 1]}
    assert "not in the checkpoint" in found.message


def test_loop_counters_are_checked_before_everything_else() -> None:
    ref = _ranks(_timeline())
    resumed = {r: t[2:] for r, t in copy.deepcopy(ref).items()}
    for t in resumed.values():
        t[0]["loop"]["global_step"] = 1
    found = compare_timelines(ref, resumed, resumed_from=2)
    assert found is not None and list(found.differs) == ["loop"]
    assert "loop counters" in found.detail


def test_a_run_that_stops_early_is_reported_after_its_identical_batches() -> None:
    ref = _ranks(_timeline())
    resumed = {r: t[3:5] for r, t in copy.deepcopy(ref).items()}
    found = compare_timelines(ref, resumed, resumed_from=3)
    assert found is not None and found.differs == {"length": [0, 1]}
    assert "trained 3 batches and this run 2" in found.message


def test_finals_compare_the_state_after_the_last_step() -> None:
    final = {
        r: {"loop": {"epoch": 2, "global_step": 6}, "weights": "w", "rng": {"torch": "t"}}
        for r in range(2)
    }
    other = copy.deepcopy(final)
    assert compare_finals(final, other) is None
    other[0]["weights"] = "x"
    found = compare_finals(final, other)
    assert found is not None and found.step is None and found.differs == {"weights": [0]}
    assert found.message.startswith("after the last step: weights differs on rank 0")


def test_report_is_exact_only_when_deterministic_and_every_interruption_is_exact() -> None:
    ok = ResumeReport(stop_at=2, max_steps=4, world_size=1)
    ok.results.append(InterruptionResult("sigterm", 2, None))
    assert ok.exact and "EXACT" in str(ok) and ok.to_dict()["exact"] is True
    ref = _ranks(_timeline())
    run = copy.deepcopy(ref)
    run[0][0]["loss"] = "y"
    bad = ResumeReport(
        stop_at=2, max_steps=4, world_size=1, nondeterminism=compare_timelines(ref, run)
    )
    assert not bad.exact and "NOT DETERMINISTIC" in str(bad)
