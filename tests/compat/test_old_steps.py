"""Steps written by an earlier version of the package still load, and resume exactly.

``fixtures/v0_1/ckpt`` holds ``global_step_4`` of a tiny run written by lightning-mcore-ckpt
0.1.0 (before the callback composed Lightning's ``ModelCheckpoint``: its state then held only
``dirpath`` and ``last_global_step_saved``), with megatron-core 0.19.2 and torch 2.13 on CPU;
``expected.json`` the losses and weight digests of the same run uninterrupted to step 6
(``_old_run.train`` is the run, unchanged since).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lightning_mcore_ckpt import _compat, layout
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

FIXTURE = Path(__file__).parent / "fixtures" / "v0_1"


@pytest.mark.skipif(
    not _compat._mcore_at_least("0.17"),
    reason="written by megatron-core 0.19, which 0.16 cannot read (refused, tested elsewhere)",
)
def test_a_step_written_by_0_1_resumes_exactly(tmp_path: Path) -> None:
    import _old_run

    expected = json.loads((FIXTURE / "expected.json").read_text())
    dirpath = tmp_path / "ckpt"
    shutil.copytree(FIXTURE / "ckpt", dirpath)
    (resumed,) = run_distributed(
        _old_run.train, 1, str(dirpath), _old_run.MAX_STEPS, "last", timeout=240
    )
    reference = expected["reference"]
    start = expected["interrupted_at"]
    assert resumed["start"] == start
    # The step's state is loaded exactly: the first resumed step computes the same loss.
    assert resumed["losses"][0] == reference["losses"][start]
    # What follows is exact where this CPU's arithmetic is the fixture machine's: the same
    # run from scratch here reproduces the stored uninterrupted run.
    (here,) = run_distributed(
        _old_run.train, 1, str(tmp_path / "fresh"), _old_run.MAX_STEPS, None, timeout=240
    )
    if here["losses"] == reference["losses"]:
        assert resumed["losses"] == reference["losses"][start:]
        assert resumed["weights"] == reference["weights"]
    else:  # another CPU (the optimizer's float32 rounding differs): within rounding
        assert resumed["losses"] == pytest.approx(reference["losses"][start:], rel=1e-6)
    assert [s.step for s in layout.complete_steps(dirpath)] == [4, 6]
    meta = layout.read_metadata(layout.step_dir(dirpath, 6))
    assert meta is not None and meta["format_version"] == layout.METADATA_FORMAT_VERSION


def test_the_callback_state_of_0_1_loads(tmp_path: Path) -> None:
    from lightning_mcore_ckpt import MegatronCheckpoint

    callback = MegatronCheckpoint(tmp_path)
    callback.load_state_dict({"dirpath": str(tmp_path), "last_global_step_saved": 4})
    assert callback._last_global_step_saved == 4
    assert (callback.best_model_path, callback.best_k_models, callback.last_model_path) == (
        "",
        {},
        "",
    )
