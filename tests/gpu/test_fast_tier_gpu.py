"""The fast tier on one GPU: staged from the GPU into pinned host memory, resumed exactly.

A run saves a fast step every :data:`FAST` steps (no persistent step: ``save_last=False`` and a
cadence it never reaches) and ends; a second run resumes ``"last"``, which is then the newest
fast step, and must continue with the first run's losses, weights and optimizer state, bit for
bit. The staging buffers the fast saves copied the GPU tensors into must be pinned. Across the
optimizer (torch AdamW; Megatron-Core's distributed optimizer) x the precision (fp32,
``bf16-mixed``, Megatron's bf16: bf16 weights with fp32 main parameters, as Megatron-LM
trains). ``replicas=0``: one node.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _fast_tier import resumes_exactly

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize(
    ("optimizer", "precision"),
    [("adamw", "32"), ("distributed", "bf16-mixed"), ("distributed", "megatron-bf16")],
)
def test_fast_tier_on_one_gpu_stages_into_pinned_memory_and_resumes_exactly(
    tmp_path: Path, optimizer: str, precision: str
) -> None:
    resumes_exactly(tmp_path, optimizer, precision, "gpu")
