"""A load into GPU tensors reads each record through pinned host buffers, straight to its place.

Axes: record size (under one chunk, several chunks with a ragged end), dtype (fp32, bf16),
reader threads (1, 2). Every record must arrive bit-identical, through the pinned path (no
torch.load of the record, no pageable copy), and the load must hold no second copy of the state
on the device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_mcore_ckpt.engine import _parallel_reader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MiB = 1024 * 1024


@pytest.mark.parametrize("threads", [1, 2])
def test_records_load_into_gpu_tensors_through_pinned_buffers(
    tmp_path: Path, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(0)
    saved = {
        "small": torch.randn(300, 7, generator=g),
        # 80 MiB + a ragged end: three chunks of 32 MiB, the last one partial.
        "large": torch.randn(20 * MiB + 333, generator=g),
        "bf16": torch.randn(5 * MiB, generator=g).to(torch.bfloat16),
    }
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path), thread_count=2))
    bounced: list[tuple[Any, bool]] = []
    read = _parallel_reader.DeviceBounce.read

    def counted(self: Any, stream: Any, position: int, dest: torch.Tensor) -> None:
        bounced.append((dest.device, all(b.is_pinned() for b in self.buffers)))
        read(self, stream, position, dest)

    monkeypatch.setattr(_parallel_reader.DeviceBounce, "read", counted)
    targets = {k: torch.full_like(v, -7, device="cuda") for k, v in saved.items()}
    torch.cuda.synchronize()
    state_bytes = sum(t.numel() * t.element_size() for t in targets.values())
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    dcp.load(targets, storage_reader=_parallel_reader.ParallelFileSystemReader(tmp_path, threads))
    peak = torch.cuda.max_memory_allocated() - base
    for key, value in saved.items():
        assert torch.equal(targets[key].cpu(), value), key
    assert len(bounced) == len(saved)
    assert all(device.type == "cuda" and pinned for device, pinned in bounced)
    # Nothing of the state was allocated on the device again (a second copy would be > 80 MiB).
    assert peak < 0.1 * state_bytes, (peak, state_bytes)
