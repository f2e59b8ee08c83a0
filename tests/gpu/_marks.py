"""Marks shared by the GPU tier: run only with two CUDA devices."""

from __future__ import annotations

import pytest
import torch

TWO_GPUS = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]
