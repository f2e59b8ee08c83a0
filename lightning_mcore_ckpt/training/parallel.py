"""Process groups and Megatron-Core parallel state: the one place both are created and torn down."""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

from lightning_mcore_ckpt import _cpu

__all__ = ["backend_for", "destroy", "initialize"]

log = logging.getLogger(__name__)


def backend_for(device_type: str, requested: str | None) -> str:
    """The process group backend for ranks on ``device_type``: the one ``requested``, else
    ``nccl`` for CUDA devices and ``gloo`` for the CPU (whatever else the machine has).

    Raises ``ValueError`` for ``nccl`` with CPU devices, naming the fix.

    Example::

        backend_for("cpu", None)  # "gloo", also on a machine with GPUs
    """
    if requested == "nccl" and device_type == "cpu":
        raise ValueError(
            "MegatronStrategy(process_group_backend='nccl') with Trainer(accelerator='cpu'): "
            "NCCL only moves CUDA tensors. Use process_group_backend='gloo' (or leave it unset), "
            "or train on GPUs with accelerator='gpu'"
        )
    if requested is not None:
        return requested
    return "nccl" if device_type == "cuda" else "gloo"


def initialize(
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    seed: int = 1234,
    backend: str | None = None,
    timeout: datetime.timedelta = datetime.timedelta(minutes=30),
    device_type: str | None = None,
) -> None:
    """Join the default process group (from the launcher's environment) and set up Megatron-Core.

    Every rank calls this, in the same order, with the same sizes: it initialises
    ``torch.distributed`` when not already initialised (``RANK``/``WORLD_SIZE``/``MASTER_*``
    from the environment), then ``parallel_state.initialize_model_parallel`` and Megatron's RNG
    tracker (``model_parallel_cuda_manual_seed``), so that dropout in tensor-parallel regions is
    seeded per tensor-parallel rank exactly as Megatron-LM does it.

    ``device_type`` is what the ranks compute on (``"cpu"`` or ``"cuda"``; default: CUDA where
    the machine has it): it picks the backend (:func:`backend_for`) and whether the CPU runtime
    is installed.
    """
    from megatron.core import parallel_state

    if device_type is None:
        device_type = "cuda" if _cpu.cuda_available() else "cpu"
    _cpu.install(device_type)
    if not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend_for(device_type, backend), timeout=timeout)
    world = dist.get_world_size()
    model_parallel = (
        tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    )
    if world % model_parallel != 0:
        raise ValueError(
            f"world size {world} is not divisible by tensor_model_parallel_size "
            f"({tensor_model_parallel_size}) x pipeline_model_parallel_size "
            f"({pipeline_model_parallel_size}) x context_parallel_size ({context_parallel_size}) "
            f"= {model_parallel}; choose sizes whose product divides the number of processes"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        # Its groups' timeout, as the default group's (a timedelta of minutes: a float is exact).
        distributed_timeout_minutes=timeout.total_seconds() / 60,
    )
    seed_all(seed)
    log.debug(
        "rank %d: TP=%d PP=%d CP=%d EP=%d DP=%d",
        dist.get_rank(),
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
        parallel_state.get_data_parallel_world_size(),
    )


def seed_all(seed: int) -> None:
    """Seed Python, NumPy, torch (CPU and CUDA) and Megatron's RNG tracker for this rank.

    As in Megatron-LM, the seed is offset by ``100 x`` the pipeline stage, and the tracker's
    tensor-parallel stream differs per tensor-parallel rank.
    """
    import random

    import numpy as np
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    """Tear down Megatron-Core parallel state and the default process group, if present."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
