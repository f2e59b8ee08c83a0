"""The CPU shim: active without CUDA, a strict no-op with CUDA, and confined to Megatron modules."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from lightning_mcore_ckpt import _cpu


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_install_is_idempotent_and_reports_active_without_cuda() -> None:
    assert not torch.cuda.is_available()
    assert _cpu.install() is True
    assert _cpu.install() is True
    assert _cpu.installed()
    assert not _cpu.parallel_load_supported()


def test_global_torch_cuda_is_untouched() -> None:
    _cpu.install()
    from megatron.core.tensor_parallel import mappings

    assert mappings.torch is not torch
    assert mappings.torch.cuda.current_device() == torch.device("cpu")
    # Outside the listed Megatron modules, torch.cuda is the real one.
    assert torch.cuda.current_device is not mappings.torch.cuda.current_device
    assert mappings.torch.nn is torch.nn


def test_megatron_cuda_rng_is_the_cpu_generator() -> None:
    _cpu.install()
    from megatron.core.tensor_parallel import random as mcore_random

    torch.manual_seed(7)
    state = mcore_random._get_cuda_rng_state()
    a = torch.rand(3)
    mcore_random._set_cuda_rng_state(state)
    assert torch.equal(a, torch.rand(3))


def test_async_staging_copies_cpu_tensors() -> None:
    _cpu.install()
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    weight = torch.zeros(4)
    bucket = [("f", "k", ([], [("item", weight)]))]
    staged = FileSystemWriterAsync.preload_tensors(bucket, non_blocking=True)
    weight.add_(1.0)  # training goes on after staging
    assert torch.equal(staged[0][2][1][0][1], torch.zeros(4))


def test_install_does_nothing_when_cuda_is_available() -> None:
    result = _run(
        """
        import torch
        torch.cuda.is_available = lambda: True
        from lightning_mcore_ckpt import _cpu
        assert _cpu.install() is False
        assert not _cpu.installed()
        from megatron.core.tensor_parallel import mappings, random
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        from megatron.core import utils
        assert mappings.torch is torch
        assert random._get_cuda_rng_state.__module__ == random.__name__
        assert not hasattr(filesystem_async.FileSystemWriterAsync.preload_tensors, "__wrapped__")
        assert not hasattr(utils.GlobalMemoryBuffer.get_tensor, "__wrapped__")
        print("untouched")
        """
    )
    assert result.returncode == 0, result.stderr
    assert "untouched" in result.stdout
