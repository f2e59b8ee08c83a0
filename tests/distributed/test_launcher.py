"""run_distributed: real gloo ranks, failures surface with their traceback, nothing hangs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from lightning_mcore_ckpt.testing import DistributedFailure, run_distributed

pytestmark = pytest.mark.timeout(120)


def _all_reduce_rank(rank: int, world_size: int, shared: str) -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([rank + 1])
    dist.all_reduce(value)
    Path(shared, f"rank{rank}").write_text(str(int(value)))
    dist.destroy_process_group()
    return int(value)


def _raise_on_rank_1(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait here forever


def _hang_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(3600)


def _die_on_rank_0(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(3)
    time.sleep(3600)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_form_a_gloo_group_and_share_a_directory(tmp_path: Path, world_size: int) -> None:
    results = run_distributed(_all_reduce_rank, world_size, str(tmp_path), timeout=60)
    expected = world_size * (world_size + 1) // 2
    assert results == [expected] * world_size
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank{r}" for r in range(world_size)]


def test_exception_in_one_rank_fails_with_its_traceback_and_frees_the_others() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedFailure, match="rank 1 of 2 failed") as info:
        run_distributed(_raise_on_rank_1, 2, timeout=60)
    assert "ValueError: boom on purpose" in str(info.value)
    assert "_raise_on_rank_1" in str(info.value)
    assert time.monotonic() - start < 50  # rank 0, stuck in the barrier, was killed


def test_a_hung_rank_is_killed_at_the_timeout() -> None:
    with pytest.raises(DistributedFailure, match=r"ranks \[1\] of 2 did not finish within 5 s"):
        run_distributed(_hang_on_rank_1, 2, timeout=5)


def test_a_rank_that_dies_without_reporting_is_named() -> None:
    with pytest.raises(DistributedFailure, match="rank 0 of 2 died with exit code 3"):
        run_distributed(_die_on_rank_0, 2, timeout=60)
