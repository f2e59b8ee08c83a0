"""The resume check finds what breaks exact resume, and names it at the first resumed step.

Each test runs the real check (real Trainer runs on fresh processes, real checkpoints, a real
SIGTERM) on a job whose restore is deliberately broken in one way, and asserts the divergence it
reports: the step, and which of loop counters, data, RNG, weights, optimizer state and loss
differ first.
"""

from __future__ import annotations

import functools
import json
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


def test_nodes_and_wipe_node_are_refused_where_they_cannot_run_before_any_run(
    tmp_path: Path,
) -> None:
    build = functools.partial(_jobs.build, layout="1")
    work = tmp_path / "work"
    with pytest.raises(ValueError, match=r"nodes=2, world_size=3\).*multiple of 2"):
        check_resume(build, stop_at=1, max_steps=4, world_size=3, nodes=2, workdir=work)
    with pytest.raises(ValueError, match=r"nodes=0\): must be a positive int"):
        check_resume(build, stop_at=1, max_steps=4, nodes=0, workdir=work)
    for nodes in (None, 1):
        with pytest.raises(ValueError, match=r"how='wipe-node', nodes=1\).*pass nodes=2"):
            check_resume(build, stop_at=1, max_steps=4, how="wipe-node", nodes=nodes)
    # A config says whether it has a fast tier: refused without one, before any run.
    config = _config(tmp_path, "NarrowGPTModule", 2)
    with pytest.raises(ValueError, match=r"how='wipe-node'\).*has no MegatronCheckpoint with a "):
        check_resume(config, stop_at=1, max_steps=4, how="wipe-node", nodes=2, workdir=work)
    assert not work.exists() or not any(work.iterdir())


def _config(tmp_path: Path, model: str, devices: int, **init_args: Any) -> Path:
    """A LightningCLI config (as a user writes one) for the resume check: ``model`` is a class
    of ``_subclass_jobs``."""
    import yaml

    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": devices,
            "max_steps": TOTAL,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "strategy": {"class_path": "lightning_mcore_ckpt.MegatronStrategy"},
            "callbacks": [
                {
                    "class_path": "lightning_mcore_ckpt.MegatronCheckpoint",
                    "init_args": {"dirpath": str(tmp_path / "job"), "every_n_train_steps": 1},
                }
            ],
        },
        "model": {"class_path": f"_subclass_jobs.{model}", "init_args": init_args},
        "data": {
            "class_path": "lightning_mcore_ckpt.tiny.TokenDataModule",
            "init_args": {"num_samples": 16, "batch_size": 2},
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_subclass_forwarding_some_arguments_of_a_tiny_module_resumes_exactly(
    tmp_path: Path,
) -> None:
    # LightningCLI gives the module's hparams the arguments of the class the config names only:
    # the base class reads its own arguments from attributes, not from hparams.
    report = check_resume(
        _config(tmp_path, "NarrowGPTModule", 1, lr=0.002, dropout=0.1),
        stop_at=STOP,
        how="sigterm",
        workdir=tmp_path / "work",
        check_determinism=False,
    )
    assert report.exact, str(report)
    assert "sigterm  exact (resumed from step 2)" in str(report)


@pytest.mark.parametrize(
    ("fail_in", "fail_rank", "run"),
    [
        ("every_run", 0, "the uninterrupted run"),
        ("every_run", 1, "the uninterrupted run"),
        ("resume", 0, "the resumed run (sigterm)"),
        ("resume", 1, "the resumed run (sigterm)"),
    ],
)
def test_a_job_that_fails_to_run_gets_its_own_verdict_and_exit_code(
    tmp_path: Path, fail_in: str, fail_rank: int, run: str
) -> None:
    from _cli import run_cli

    config = _config(tmp_path, "FailingGPTModule", 2, fail_in=fail_in, fail_rank=fail_rank)
    args = ["check-resume", "--config", str(config), "--stop-at", str(STOP), "--how", "sigterm"]
    done = run_cli(*args, "--workdir", str(tmp_path / "work"))
    # Not a divergence (exit 1) nor bad usage (2): the job's own error, named.
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    where = "on_load_checkpoint" if fail_in == "resume" else "configure_model"
    exception = f'KeyError: "tokenizer_path (FailingGPTModule\'s own bug, in {where})"'
    assert (
        f"FAILED TO RUN: {run} failed on rank {fail_rank}, so resume could not be judged:\n"
        f"  {exception}\n"
        f"  at {Path(__file__).parent / '_subclass_jobs.py'}:"
    ) in done.stdout
    assert ", in _fail\n  This is an error of the job itself, not a divergence" in done.stdout
    assert done.stdout.rstrip().endswith("NOT CHECKED: the job failed to run")
    assert "DIVERGED" not in done.stdout and "NOT EXACT" not in done.stdout
    assert "Traceback (most recent call last)" not in done.stdout + done.stderr
    if fail_in == "resume":  # what was judged before it: the runs it had
        assert "NOT DETERMINISTIC" not in done.stdout
    # The JSON report: the same verdict, with the whole traceback.
    done = run_cli(*args, "--workdir", str(tmp_path / "work_json"), "--json")
    assert done.returncode == 3
    report = json.loads(done.stdout)
    assert report["exact"] is False and report["results"] == []
    failure = report["failure"]
    assert (failure["run"], failure["ranks"], failure["exception"]) == (run, [fail_rank], exception)
    assert failure["traceback"].startswith("Traceback (most recent call last)")
    assert failure["traceback"].rstrip().endswith(exception)


def test_a_job_that_fails_to_run_raises_job_failed_from_the_python_api(tmp_path: Path) -> None:
    from lightning_mcore_ckpt.resume_check import JobFailed

    with pytest.raises(JobFailed) as failed:
        check_resume(
            _config(tmp_path, "FailingGPTModule", 1, fail_in="resume"),
            stop_at=STOP,
            how="sigterm",
            workdir=tmp_path / "work",
            check_determinism=False,
        )
    failure = failed.value.failure
    assert failure.run == "the resumed run (sigterm)" and failure.ranks == [0], failure.traceback
    assert failure.exception.startswith('KeyError: "tokenizer_path')
    assert failed.value.report.failure is failure and not failed.value.report.exact
    assert str(failed.value) == str(failed.value.report)
