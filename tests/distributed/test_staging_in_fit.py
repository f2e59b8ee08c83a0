"""What a save stages, and what a bf16 model exports, observed inside ``fit``: the CPU twins of
the GPU tier's staging and export tests (``tests/gpu/test_one_gpu.py`` runs the same functions,
from ``_staging``, with ``accelerator="gpu"``).

On the CPU an async save copies every tensor into pageable host memory (a snapshot: the weights
changed while the write is held do not reach the file), bounded or not; a sync save of CPU
tensors copies nothing. Axes: the cap (None; 16 KiB, below the largest tensor of the tiny
model) x sync/async, the pairs that differ (a sync save copies nothing on the CPU, whatever the
cap); 2 gloo ranks (DP=2).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

CELLS = {  # (async save, ckpt_max_staging_bytes)
    "async-unbounded": (True, None),
    "async-bounded": (True, 16 * 2**10),
    "sync-bounded": (False, 16 * 2**10),
}


@pytest.mark.parametrize("cell", list(CELLS))
def test_a_save_inside_fit_stages_what_trained_and_writes_the_snapshot(
    tmp_path: Path, cell: str
) -> None:
    import _staging

    async_save, cap = CELLS[cell]
    results = run_distributed(
        _staging.observe_async_save, 2, str(tmp_path), "cpu", cap, async_save, timeout=240
    )
    for out in results:
        _staging.check_staging(out, "cpu", async_save)
    _staging.saved_weights_are_the_snapshot(str(tmp_path), results[0]["before"])


def test_a_bf16_model_exports_what_it_computed_inside_fit(tmp_path: Path) -> None:
    import _staging

    from lightning_mcore_ckpt.tiny import tiny_hf_model

    tiny_hf_model(tmp_path / "src", "qwen2")
    (out,) = run_distributed(_staging.export_bf16, 1, str(tmp_path), "cpu", timeout=240)
    _staging.check_bf16_export(tmp_path, out, "cpu")
