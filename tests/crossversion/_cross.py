"""Runs of the cross-version test's jobs, under whichever Python runs this script.

``python _cross.py PLAN.json``: the plan is a list of runs, made in order in this one process
(the libraries are imported, and the ranks' forkserver started, once for all of them). Each run
is ``{"job", "run_dir", "ckpt_dir", "max_steps", "ckpt", "copy_from"}``: train ``job`` on 2
gloo processes to ``max_steps`` (saving every 2 steps into ``ckpt_dir``), resuming from
``ckpt`` (``"last"``) when given, after copying ``copy_from`` to ``ckpt_dir`` when given; the
resume check's probe records every batch under ``run_dir/probe``. A run that fails stops the
plan with its error (exit code 1). Prints the versions it ran with as one JSON line.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "resume")]
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(HERE.parent / "resume"), os.environ.get("PYTHONPATH", "")]
)

import _jobs  # noqa: E402

# The cells: tensor-parallel shards (resharding-sensitive keys), a frozen input embedding and a
# partly frozen layer stack (optimizer states for only some params), accumulation, a stateful
# loader with workers; torch AdamW under bf16 autocast, or Megatron's distributed optimizer
# (its sharding types differ between the versions) with Megatron's bf16.
_CELL = dict(
    layout="tp2",
    cadence="steps",
    every=2,
    accumulate=2,
    frozen="all_params",
    data="stateful2",
    steps_per_epoch=3,
)
JOBS = {
    "adamw": functools.partial(_jobs.build, **_CELL, precision="bf16-mixed"),
    "distributed": functools.partial(
        _jobs.build, **_CELL, precision="megatron-bf16", optimizer="distributed"
    ),
}


def main(plan_file: str) -> None:
    from lightning_mcore_ckpt import _compat
    from lightning_mcore_ckpt.resume_check._job import Placement
    from lightning_mcore_ckpt.resume_check._run import _launch

    for run in json.loads(Path(plan_file).read_text()):
        ckpt_dir = Path(run["ckpt_dir"])
        if run.get("copy_from"):
            shutil.copytree(run["copy_from"], ckpt_dir)
        # What stopped the job is returned (check-resume gives it a verdict of its own): raise it.
        failure = _launch(
            JOBS[run["job"]],
            2,
            Path(run["run_dir"]),
            Placement(ckpt_dir=ckpt_dir, fast_dir=Path(run["run_dir"]) / "node_local" / "fast"),
            int(run["max_steps"]),
            run.get("ckpt"),
            None,
            1,
            400.0,
            None,  # no log file: Lightning's banners go where they always went
        )
        if failure is not None:
            raise failure
    print(json.dumps(_compat.versions()))


if __name__ == "__main__":
    main(*sys.argv[1:])
