"""Steps across megatron-core versions: 0.16's resume under 0.19; 0.19's are refused by 0.16.

Both with torch AdamW and with Megatron's distributed optimizer (whose sharded format differs
between the versions: both read and write ``dp_reshardable`` the same way).

Needs the other supported combination's Python (``LMC_OTHER_PYTHON``: ``.ci/run`` builds both,
megatron-core 0.19 on Python 3.12 and 0.16 on Python 3.11, and sets it; ``LMC_REQUIRE_OTHER=1``
turns the skip into a failure). The steps are generated in the run: step 2 of one job
(tensor-parallel shards, frozen parameters, gradient accumulation, a stateful loader with
workers, bf16) written by one version, resumed to step 4 from copies of it. Each Python makes its
runs in one process (``_cross.py`` takes a plan): the older writes both jobs' steps and resumes
its own copies, the newer resumes its copies and writes the step the older must refuse.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_mcore_ckpt.format import markers
from lightning_mcore_ckpt.resume_check._run import _read_run
from lightning_mcore_ckpt.storage.lock import LOCK_FILE

HERE = Path(__file__).resolve().parent
OTHER = os.environ.get("LMC_OTHER_PYTHON")
WRITTEN, MAX_STEPS = 2, 4
JOBS = ("adamw", "distributed")

if not OTHER and os.environ.get("LMC_REQUIRE_OTHER") == "1":
    raise RuntimeError("LMC_REQUIRE_OTHER=1 but LMC_OTHER_PYTHON is not set")
pytestmark = [
    pytest.mark.timeout(1500),
    pytest.mark.skipif(not OTHER, reason="set LMC_OTHER_PYTHON to the other combination's python"),
]


def _plan(python: str, runs: list[dict], where: Path) -> subprocess.CompletedProcess[str]:
    """``runs`` (see ``_cross.py``) made in order by one process of ``python``."""
    where.mkdir(parents=True, exist_ok=True)
    plan = where / "plan.json"
    plan.write_text(json.dumps([{k: str(v) for k, v in r.items() if v is not None} for r in runs]))
    return subprocess.run(
        [python, str(HERE / "_cross.py"), str(plan)], capture_output=True, text=True, timeout=1400
    )


def _versions(done: subprocess.CompletedProcess[str]) -> dict:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run(
    job: str, run_dir: Path, ckpt_dir: Path, steps: int, copy_from: Path | None = None
) -> dict:
    """A run of ``_cross.py``'s plan; from a copy of ``copy_from``'s steps, resumed from "last"."""
    return dict(
        job=job,
        run_dir=run_dir,
        ckpt_dir=ckpt_dir,
        max_steps=steps,
        ckpt="last" if copy_from is not None else None,
        copy_from=copy_from,
    )


def _mcore(python: str) -> str:
    """The megatron-core installed for ``python`` (read from its metadata, not imported)."""
    done = subprocess.run(
        [python, "-c", "from importlib.metadata import version; print(version('megatron-core'))"],
        capture_output=True,
        text=True,
        timeout=120,
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


@pytest.fixture(scope="module")
def crossed(pythons: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every job's step 2 written by the older version and resumed to step 4 from copies of it
    by both; and a step written by the newer. ``root``, and each version's ``versions``."""
    root = tmp_path_factory.mktemp("cross")
    written = {job: root / job / "written" for job in JOBS}
    old = [_run(job, root / job / "write", written[job], WRITTEN) for job in JOBS]
    old += [
        _run(job, root / job / "old" / "run", root / job / "old" / "checkpoints", MAX_STEPS, w)
        for job, w in written.items()
    ]
    new = [
        _run(job, root / job / "new" / "run", root / job / "new" / "checkpoints", MAX_STEPS, w)
        for job, w in written.items()
    ]
    new.append(_run("adamw", root / "newer" / "write", root / "newer" / "checkpoints", WRITTEN))
    versions = {
        "old": _versions(_plan(pythons["old"], old, root / "old-plan")),
        "new": _versions(_plan(pythons["new"], new, root / "new-plan")),
    }
    return {"root": root, "versions": versions}


@pytest.mark.parametrize("job", JOBS)
def test_a_step_written_by_the_older_version_resumes_exactly_under_the_newer(
    crossed: dict, job: str
) -> None:
    root, versions = crossed["root"] / job, crossed["versions"]
    metadata = markers.read_metadata(root / "written" / f"global_step_{WRITTEN}")
    wrote = versions["old"]["megatron_core"]
    assert metadata is not None and metadata["versions"]["megatron_core"] == wrote

    runs = {}
    for who in ("old", "new"):
        timelines, finals, resumed_from = _read_run(root / who / "run" / "probe")
        assert resumed_from == WRITTEN, f"{who} did not resume from step {WRITTEN}"
        runs[who] = (timelines, finals, versions[who])
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
                f"{WRITTEN} (written by megatron-core {wrote}) under "
                f"{runs['old'][2]['megatron_core']} and under {runs['new'][2]['megatron_core']}"
            )
        for key in ("loop", "rng", "scheduler"):
            assert own_final[rank][key] == cross_final[rank][key], (rank, key)


def test_a_step_written_by_the_newer_version_is_refused_by_the_older_naming_both(
    tmp_path: Path, pythons: dict[str, str], crossed: dict
) -> None:
    # megatron-core 0.16 cannot read the format of 0.17+ (common state inside the torch_dist
    # files): refused before training, naming both versions, with nothing written.
    written = crossed["root"] / "newer" / "checkpoints"
    new = crossed["versions"]["new"]["megatron_core"]
    old = crossed["versions"]["old"]["megatron_core"]
    before = sorted(p.relative_to(written) for p in written.rglob("*"))
    resume = {**_run("adamw", tmp_path / "run", written, MAX_STEPS), "ckpt": "last"}
    done = _plan(pythons["old"], [resume], tmp_path)
    assert done.returncode != 0
    assert (
        f"was written by megatron-core {new}, whose format megatron-core {old} cannot read"
        in done.stderr
    ), done.stderr[-4000:]
    assert "Load it with megatron-core >= 0.17" in done.stderr
    # Nothing written: no step, marker or tracker. The run's lock files may be left, as
    # Lightning's launcher kills rank 0 (its peer failed first) wherever it is in the lock's
    # life: the lock itself before rank 0 releases it; the lock's temporary file while rank 0
    # takes it (written, then linked to the lock's name); the release's claim
    # (<lock>.claim-<digest>) while rank 0 releases it. The next run recovers each: a dead
    # owner's lock (tests/faults/test_damage_lock_input.py), a dead release's claim
    # (tests/faults/test_lock.py).
    after = sorted(p.relative_to(written) for p in written.rglob("*"))
    lock = [p for p in after if p.name == LOCK_FILE or p.name.startswith(f"{LOCK_FILE}.")]
    assert [p for p in after if p not in lock] == before
