"""One run of the cross-version test's job, under whichever Python runs this script.

``python _cross.py RUN_DIR CKPT_DIR MAX_STEPS [last]``: train the job on 2 gloo processes to
``MAX_STEPS`` (saving every 2 steps into ``CKPT_DIR``), resuming from its last step when asked;
the resume check's probe records every batch under ``RUN_DIR/probe``. Prints the versions it ran
with as one JSON line.
"""

from __future__ import annotations

import functools
import json
import os
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
# (its sharding types differ between the versions) with Megatron's bf16. LMC_CROSS_JOB picks.
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
JOB = JOBS[os.environ.get("LMC_CROSS_JOB", "adamw")]


def main(run_dir: str, ckpt_dir: str, max_steps: str, ckpt_path: str | None = None) -> None:
    from lightning_mcore_ckpt import _compat
    from lightning_mcore_ckpt.resume_check._run import _launch

    # What stopped the job is returned (check-resume gives it a verdict of its own): raise it.
    failure = _launch(
        JOB, 2, Path(run_dir), Path(ckpt_dir), int(max_steps), ckpt_path, None, 1, 400.0
    )
    if failure is not None:
        raise failure
    print(json.dumps(_compat.versions()))


if __name__ == "__main__":
    main(*sys.argv[1:])
