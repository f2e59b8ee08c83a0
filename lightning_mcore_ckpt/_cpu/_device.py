"""``torch.cuda`` as Megatron-Core sees it on CPU: the stand-in ``torch`` of the listed modules,
its RNG, streams and tensor factories, and the legacy CUDA type strings the optimizers check."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import threading
import types
from typing import Any

import torch

__all__ = ["patch_modules", "patch_tensor_type_checks"]

# --- torch.cuda as seen by Megatron-Core ------------------------------------------------------

# Megatron-Core modules that use ``torch.cuda`` as "the device" (``current_device()`` as a tensor
# device, ``synchronize()``, the default CUDA generator). Inside these modules only, ``torch`` is
# :class:`_TorchWithCpuCuda`; every other attribute of ``torch`` is the real one.
_MODULES_ON_CPU = (
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.module",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.multi_token_prediction",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.utils",
)


def _cpu_get_rng_state(
    device: Any = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    return torch.default_generator.get_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.default_generator.set_state(new_state)


class _CpuCuda(types.SimpleNamespace):
    """Stands in for ``torch.cuda`` inside Megatron modules: the device and its RNG are the CPU's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    get_rng_state = staticmethod(_cpu_get_rng_state)
    set_rng_state = staticmethod(_cpu_set_rng_state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    # Megatron DDP overlaps its gradient reductions on a side stream; on CPU there is one.
    @staticmethod
    def current_stream(device: Any = None) -> _CpuStream:
        return _CpuStream()

    @staticmethod
    def default_stream(device: Any = None) -> _CpuStream:
        return _CpuStream()

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> _CpuStream:
        return _CpuStream()

    @staticmethod
    def stream(stream: Any) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    @staticmethod
    def empty_cache() -> None:
        return None


class _CpuStream:
    """The CPU's only "stream": work is ordered already, waits and records are no-ops."""

    def wait_stream(self, stream: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, event: Any = None) -> _CpuStream:
        return self  # an "event" whose synchronize() returns at once (MoE token dispatch)


class _TorchWithCpuCuda(types.ModuleType):
    """``torch`` as seen by one Megatron module, with ``torch.cuda`` replaced by :class:`_CpuCuda`."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    # The pipeline schedules allocate their token counter on the literal device "cuda".
    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device=_on_cpu(device), **kwargs)

    @staticmethod
    def empty(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.empty(*args, device=_on_cpu(device), **kwargs)

    # The optimizers, the grad scaler and gradient clipping keep flags and norms on "cuda".
    @staticmethod
    def tensor(data: Any, *, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(data, device=_on_cpu(device), **kwargs)

    @staticmethod
    def ones(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.ones(*args, device=_on_cpu(device), **kwargs)

    @staticmethod
    def arange(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.arange(*args, device=_on_cpu(device), **kwargs)


def _on_cpu(device: Any) -> Any:
    if device is not None and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _DropCpuRngChangedWarning(logging.Filter):
    # The tracker warns when the CPU RNG changes inside a "CUDA" RNG fork; on CPU the two are
    # the same generator by design, so that warning would fire on every dropout.
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def patch_modules() -> None:
    cpu_torch = _TorchWithCpuCuda()
    for name in _MODULES_ON_CPU:
        module = importlib.import_module(name)
        module.torch = cpu_torch  # type: ignore[attr-defined]

    from megatron.core.tensor_parallel import random as mcore_random

    # The tracker swaps named states in and out of "the CUDA generator": on CPU, the CPU one.
    mcore_random._get_cuda_rng_state = _cpu_get_rng_state
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state
    logging.getLogger(mcore_random.__name__).addFilter(_DropCpuRngChangedWarning())

    # The default causal mask is built on the literal device "cuda".
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    @functools.lru_cache(maxsize=32)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    transformer_utils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask  # type: ignore[attr-defined]


# --- "torch.cuda.FloatTensor" type checks -----------------------------------------------------

# Megatron-Core's mixed-precision and distributed optimizers sort parameters by the legacy type
# string (``param.type() == "torch.cuda.FloatTensor"``) and gradient clipping asserts it. Inside
# these functions only, and only on the thread running them, a CPU tensor reports the CUDA type
# string of its dtype; everywhere else ``Tensor.type`` is unchanged.
_TYPE_CHECKING_FUNCTIONS = (
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "__init__"),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params", "__init__"),
    ("megatron.core.optimizer.clip_grads", None, "clip_grad_by_total_norm_fp32"),
    ("megatron.core.optimizer.optimizer", None, "clip_grad_by_total_norm_fp32"),
    # Tied embeddings across pipeline stages: the copies are all-reduced after `.cuda()`.
    (
        "megatron.core.models.common.language_module.language_module",
        "LanguageModule",
        "setup_embeddings_and_output_layer",
    ),
)

_as_cuda = threading.local()


def _reporting_cuda_types(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_as_cuda, "depth", 0)
        _as_cuda.depth = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _as_cuda.depth = depth

    return wrapper


def patch_tensor_type_checks() -> None:
    stock_type = torch.Tensor.type

    @functools.wraps(stock_type)
    def tensor_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = stock_type(self, *args, **kwargs)
        if args or kwargs or not getattr(_as_cuda, "depth", 0) or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = tensor_type  # type: ignore[method-assign,assignment]
    stock_cuda = torch.Tensor.cuda

    @functools.wraps(stock_cuda)
    def tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if getattr(_as_cuda, "depth", 0) and self.device.type == "cpu":
            return self  # "the device" is the CPU inside these functions
        return stock_cuda(self, *args, **kwargs)

    torch.Tensor.cuda = tensor_cuda  # type: ignore[method-assign,assignment]
    for module_name, owner_name, name in _TYPE_CHECKING_FUNCTIONS:
        module = importlib.import_module(module_name)
        owner = getattr(module, owner_name) if owner_name else module
        setattr(owner, name, _reporting_cuda_types(getattr(owner, name)))
