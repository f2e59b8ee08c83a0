"""Steps across megatron-core versions: 0.16's resume under 0.19; 0.19's are refused by 0.16.

Both with torch AdamW and with Megatron's distributed optimizer (whose sharded format differs
between the versions: both read and write ``dp_reshardable`` the same way).

Needs the other supported combination's Python (``LMC_OTHER_PYTHON``: ``.ci/run`` builds both,
megatron-core 0.19 on Python 3.12 and 0.16 on Python 3.11, and sets it; ``LMC_REQUIRE_OTHER=1``
turns the skip into a failure). The steps are generated in the run: step 2 of one job
(tensor-parallel shards, frozen parameters, gradient accumulation, a stateful loader with
workers, bf16) written by one version, resumed to step 4 from copies of it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_mcore_ckpt import layout
from lightning_mcore_ckpt.resume_check._run import _read_run

HERE = Path(__file__).resolve().parent
OTHER = os.environ.get("LMC_OTHER_PYTHON")
WRITTEN, MAX_STEPS = 2, 4

if not OTHER and os.environ.get("LMC_REQUIRE_OTHER") == "1":
    raise RuntimeError("LMC_REQUIRE_OTHER=1 but LMC_OTHER_PYTHON is not set")
pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(not OTHER, reason="set LMC_OTHER_PYTHON to the other combination's python"),
]


def _run(
    python: str, run_dir: Path, ckpt_dir: Path, max_steps: int, ckpt: str | None, job: str = "adamw"
) -> dict:
    args = [python, str(HERE / "_cross.py"), str(run_dir), str(ckpt_dir), str(max_steps)]
    done = subprocess.run(
        [*args, *([ckpt] if ckpt else [])],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "LMC_CROSS_JOB": job},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mcore(python: str) -> str:
    done = subprocess.run(
        [
            python,
            "-c",
            "from lightning_mcore_ckpt import _compat; print(_compat.versions()['megatron_core'])",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def pythons() -> dict[str, str]:
    """The Python of the older and of the newer megatron-core (``"old"``, ``"new"``)."""
    from packaging.version import Version

    found = {sys.executable: _mcore(sys.executable), str(OTHER): _mcore(str(OTHER))}
    assert len(set(found.values())) == 2, f"both Pythons run megatron-core {found}"
    old, new = sorted(found, key=lambda p: Version(found[p]))
    return {"old": old, "new": new}


@pytest.mark.parametrize("job", ["adamw", "distributed"])
def test_a_step_written_by_the_older_version_resumes_exactly_under_the_newer(
    tmp_path: Path, pythons: dict[str, str], job: str
) -> None:
    written = tmp_path / "written"
    wrote = _run(pythons["old"], tmp_path / "write", written, WRITTEN, None, job)
    metadata = layout.read_metadata(written / f"global_step_{WRITTEN}")
    assert metadata is not None and metadata["versions"]["megatron_core"] == wrote["megatron_core"]

    runs = {}
    for who in ("old", "new"):
        shutil.copytree(written, tmp_path / who / "checkpoints")
        versions = _run(
            pythons[who],
            tmp_path / who / "run",
            tmp_path / who / "checkpoints",
            MAX_STEPS,
            "last",
            job,
        )
        timelines, finals, resumed_from = _read_run(tmp_path / who / "run" / "probe")
        assert resumed_from == WRITTEN, f"{who} did not resume from step {WRITTEN}"
        runs[who] = (timelines, finals, versions)
    (own, own_final, _), (cross, cross_final, _) = runs["old"], runs["new"]
    assert sorted(own) == sorted(cross) == [0, 1]
    for rank in own:
        assert len(own[rank]) == len(cross[rank]) > 0, rank
        for j, (a, b) in enumerate(zip(own[rank], cross[rank], strict=True)):
            # What the resume restored (weights, optimizer) is compared where it was loaded; what
            # does not depend on the arithmetic (loop counters, samples, every RNG stream, the LR
            # schedule) at every batch. The losses themselves are not compared: from the same
            # state, the two versions' forward passes differ in the last bits.
            keys = ["loop", "data", "rng", "scheduler"] + (
                ["weights", "optimizer"] if j == 0 else []
            )
            differs = [k for k in keys if a[k] != b[k]]
            assert not differs, (
                f"rank {rank}, batch {a['loop']}: {differs} differ between the resume of step "
                f"{WRITTEN} (written by megatron-core {wrote['megatron_core']}) under "
                f"{runs['old'][2]['megatron_core']} and under {runs['new'][2]['megatron_core']}"
            )
        for key in ("loop", "rng", "scheduler"):
            assert own_final[rank][key] == cross_final[rank][key], (rank, key)


def test_a_step_written_by_the_newer_version_is_refused_by_the_older_naming_both(
    tmp_path: Path, pythons: dict[str, str]
) -> None:
    # megatron-core 0.16 cannot read the format of 0.17+ (common state inside the torch_dist
    # files): refused before training, naming both versions, with nothing written.
    written = tmp_path / "checkpoints"
    new = _run(pythons["new"], tmp_path / "write", written, WRITTEN, None)["megatron_core"]
    old = _mcore(pythons["old"])
    before = sorted(p.relative_to(written) for p in written.rglob("*"))
    args = [pythons["old"], str(HERE / "_cross.py"), str(tmp_path / "run"), str(written)]
    done = subprocess.run(
        [*args, str(MAX_STEPS), "last"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode != 0
    assert (
        f"was written by megatron-core {new}, whose format megatron-core {old} cannot read"
        in done.stderr
    ), done.stderr[-4000:]
    assert "Load it with megatron-core >= 0.17" in done.stderr
    # Nothing written: no step, marker or tracker. The run's lock may be left when Lightning's
    # launcher kills rank 0 (its peer failed first) before it releases it; the next run
    # recovers a dead owner's lock (tests/faults/test_damage_lock_input.py).
    after = sorted(p.relative_to(written) for p in written.rglob("*"))
    assert [p for p in after if p.name != layout.LOCK_FILE] == before
