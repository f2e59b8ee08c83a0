"""The resume check finds what breaks exact resume, and names it at the first resumed step.

Each test runs the real check (real Trainer runs on fresh processes, real checkpoints, a real
SIGTERM) on a job whose restore is deliberately broken in one way, and asserts the divergence it
reports: the step, and which of loop counters, data, RNG, weights, optimizer state and loss
differ first.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import _jobs
import pytest

from lightning_mcore_ckpt import check_resume

pytestmark = pytest.mark.timeout(600)

STOP, TOTAL = 2, 4


def _check(tmp_path: Path, **job: Any) -> Any:
    return check_resume(
        functools.partial(_jobs.build, layout="1", **job),
        stop_at=STOP,
        max_steps=TOTAL,
        how="sigterm",
        world_size=1,
        workdir=tmp_path / "work",
        check_determinism=False,
    )


def _first(report: Any, resumed_from: int = STOP) -> Any:
    (result,) = report.results
    assert result.resumed_from == resumed_from
    assert not report.exact and result.divergence is not None, str(report)
    # The first batch trained after the resume is where it shows.
    assert result.divergence.step == resumed_from + 1, result.divergence.message
    return result.divergence


def test_a_correct_job_is_exact(tmp_path: Path) -> None:
    report = _check(tmp_path)
    assert report.exact, str(report)
    assert "sigterm  exact (resumed from step 2)" in str(report)


@pytest.mark.parametrize(
    ("broken", "cause"),
    [
        ("rng", "rng:torch"),
        ("dataloader", "data"),
        ("optimizer", "optimizer"),
        ("off_by_one", "loop"),
    ],
)
def test_a_broken_restore_is_named_at_the_first_resumed_step(
    tmp_path: Path, broken: str, cause: str
) -> None:
    # Off by one: the loop resumes at the step before the one saved.
    found = _first(_check(tmp_path, broken=broken), STOP - 1 if broken == "off_by_one" else STOP)
    # Categories are checked in the order a cause shows up (loop, data, RNG, weights, optimizer,
    # scheduler, loss): the first one named is what was not restored; its effects follow.
    assert next(iter(found.differs)) == cause, found.message
    assert found.message.split(": ", 1)[1].startswith(
        {
            "rng:torch": "torch CPU RNG",
            "data": "data order",
            "optimizer": "optimizer state",
            "loop": "loop counters",
        }[cause]
    )
    if broken != "off_by_one":
        assert "weights" not in found.differs and "weights identical until then" in found.message


def test_a_module_attribute_missing_from_the_checkpoint_shows_as_the_loss_alone(
    tmp_path: Path,
) -> None:
    found = _first(_check(tmp_path, unsaved_state=True))
    assert found.differs == {"loss": [0]}
    assert "not in the checkpoint" in found.message


def test_a_job_seeded_from_the_clock_is_reported_as_not_deterministic(tmp_path: Path) -> None:
    report = check_resume(
        functools.partial(_jobs.build, layout="1", clock_seed=True),
        stop_at=STOP,
        max_steps=TOTAL,
        how="sigterm",
        world_size=1,
    )
    assert not report.deterministic and not report.exact
    assert report.results == []  # resume is not judged
    assert report.nondeterminism is not None and report.nondeterminism.step == 1
    assert "NOT DETERMINISTIC" in str(report)


def test_bad_arguments_are_refused_before_any_run(tmp_path: Path) -> None:
    build = functools.partial(_jobs.build, layout="1")
    with pytest.raises(ValueError, match=r"stop_at must be before max_steps"):
        check_resume(build, stop_at=4, max_steps=4)
    with pytest.raises(ValueError, match=r"how='pause'.*choose from"):
        check_resume(build, stop_at=1, max_steps=4, how="pause")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    with pytest.raises(ValueError, match=r"workdir=.*not empty"):
        check_resume(build, stop_at=1, max_steps=4, workdir=tmp_path / "used")
    assert sorted(p.name for p in (tmp_path / "used").iterdir()) == ["x"]
