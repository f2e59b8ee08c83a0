"""Make stock Megatron-Core run on CPU with a gloo process group.

This is the only module in the package that adapts third-party code to the CPU (differences
between library versions live in :mod:`._compat`), and it changes nothing when CUDA is
available: :func:`install` returns ``False`` at once on a CUDA machine, so GPU users always run
the stock NCCL/CUDA code paths.

Without CUDA, Megatron-Core (0.16 to 0.19) fails in a handful of places that are not about
computation at all. Each adaptation below is the smallest that makes the stock code path run:

* **``torch.cuda`` as "the device".** A listed set of Megatron modules (``_MODULES_ON_CPU``:
  tensor-parallel layers and mappings, rotary embeddings, the GPT model, attention, the
  transformer layer, the dist-checkpointing save finaliser and async-call queue, the pipeline
  schedules and their point-to-point communication) use ``torch.cuda.current_device()`` or the
  literal ``"cuda"`` as a tensor device, call ``torch.cuda.synchronize()``, and seed or read the
  default CUDA generator. Inside those modules only, ``torch`` is a stand-in whose ``cuda`` is the
  CPU: current device ``cpu``, a no-op synchronize, RNG calls that read and write
  ``torch.default_generator``, and ``zeros``/``empty`` that put a ``"cuda"`` tensor on the CPU.
  The global ``torch.cuda`` is not touched.
* **CUDA RNG tracker.** Megatron keeps named "CUDA" RNG states (data-parallel, tensor-parallel,
  expert) and swaps them in around dropout; its private get/set helpers are backed by the CPU
  generator, which is what dropout draws from on CPU. Dropout is then real, seeded per
  tensor-parallel rank exactly as on GPU, and its state can be checkpointed and restored.
* **Causal mask and global memory buffer.** ``get_default_causal_mask`` builds on the literal
  device ``"cuda"`` and ``GlobalMemoryBuffer.get_tensor`` (sequence-parallel gathers) allocates on
  the CUDA device; on CPU both allocate on the CPU.
* **Async staging.** Staging for an async save is ``tensor.to("cpu")``, which is no copy for a CPU
  tensor, so training could mutate what the background writer is about to write. On CPU,
  staging copies, which is what the device-to-host copy does on GPU.

* **Shard writers' results queue.** Megatron-Core starts the Manager behind it with "spawn",
  which re-imports the main script's modules in the child (seconds at every process's first
  save) to keep CUDA state out of it; on CPU it is forked.
* **Mixed precision.** Megatron-Core's tensor-parallel linear functions declare their autocast
  behaviour for ``"cuda"`` only (``torch.amp.custom_fwd(device_type="cuda")``), so under CPU
  autocast (``precision="bf16-mixed"``) their backward runs without it and multiplies a bf16
  gradient by an fp32 weight. On CPU they are declared for ``"cpu"``: the backward runs under
  the autocast state of the forward, as it does on GPU.
* **Model configs.** :func:`transformer_config_overrides` turns off the fused kernels (CUDA
  only) and asks for CPU initialisation in configs built from a Hugging Face model.

What is *not* made to work here, and is avoided by the callers instead: Megatron's own optimizers
(they allocate on ``"cuda"``; use torch optimizers on CPU) and
``FullyParallelLoadStrategyWrapper`` (its exchange allocates on the literal ``"cuda"``; on CPU the
strategy loads plainly, see :func:`parallel_load_supported`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import threading
import types
from typing import Any

import torch

__all__ = [
    "cuda_available",
    "install",
    "installed",
    "parallel_load_supported",
    "transformer_config_overrides",
]

_lock = threading.Lock()
_installed = False


def cuda_available() -> bool:
    """Whether this process runs the GPU path (stock Megatron-Core, no adaptation)."""
    return torch.cuda.is_available()


def installed() -> bool:
    """Whether the CPU adaptations are active in this process."""
    return _installed


def parallel_load_supported() -> bool:
    """Whether ``FullyParallelLoadStrategyWrapper`` can run here (it needs CUDA)."""
    return cuda_available()


def transformer_config_overrides() -> dict[str, Any]:
    """``TransformerConfig`` fields a CPU run needs (none with CUDA): no fused CUDA kernels."""
    if cuda_available():
        return {}
    return {
        "use_cpu_initialization": True,
        "masked_softmax_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "sequence_parallel": False,
    }


def install() -> bool:
    """Install the CPU adaptations once per process; a no-op when CUDA is available.

    Returns ``True`` when the adaptations are active after the call. Safe to call any number of
    times, from any thread.
    """
    global _installed
    if cuda_available():
        return False
    with _lock:
        if not _installed:
            _patch_modules()
            _patch_memory_buffer()
            _patch_dist_checkpointing()
            _patch_autocast()
            _patch_tensor_type_checks()
            _installed = True
    return True


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

    def record_event(self, event: Any = None) -> None:
        return None


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


def _patch_modules() -> None:
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


# --- global memory buffer --------------------------------------------------------------------


def _patch_memory_buffer() -> None:
    from megatron.core import utils as mcore_utils

    original = mcore_utils.GlobalMemoryBuffer.get_tensor

    def get_tensor(
        self: Any, tensor_shape: Any, dtype: torch.dtype, name: str, mem_alloc_context: Any = None
    ) -> torch.Tensor:
        required = 1
        for dim in tensor_shape:
            required *= int(dim)
        key = (name, dtype)
        buf = self.buffer.get(key)
        if buf is None or buf.numel() < required:
            self.buffer[key] = torch.empty(required, dtype=dtype, device="cpu", requires_grad=False)
        return self.buffer[key][0:required].view(*tensor_shape)

    get_tensor.__wrapped__ = original  # type: ignore[attr-defined]
    mcore_utils.GlobalMemoryBuffer.get_tensor = get_tensor  # type: ignore[method-assign]


# --- dist-checkpointing ----------------------------------------------------------------------


def _patch_dist_checkpointing() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    writer = filesystem_async.FileSystemWriterAsync
    original = writer.preload_tensors

    def preload_tensors(write_buckets: list[Any], non_blocking: bool = True) -> list[Any]:
        # Staging must be a snapshot: a CPU tensor's .to("cpu") is the tensor itself.
        staged = []
        for file_name, storage_key, (bytes_data, tensor_data) in write_buckets:
            copied = [(item, tensor.detach().to("cpu", copy=True)) for item, tensor in tensor_data]
            staged.append((file_name, storage_key, (bytes_data, copied)))
        return staged

    preload_tensors.__wrapped__ = original  # type: ignore[attr-defined]
    writer.preload_tensors = staticmethod(preload_tensors)  # type: ignore[method-assign,assignment]

    # The shard writers report through a queue of a Manager process started with "spawn"
    # (megatron-core 0.16: _get_write_results_queue(); 0.19: get_write_results_queue(mp_mode=
    # "spawn")). A spawned process re-imports the main script's modules: torch, Megatron-Core,
    # Lightning, seconds at the first save of every process. Its "spawn" keeps CUDA state out of
    # the child; without CUDA there is none, so the Manager is forked.
    import multiprocessing as mp

    for name in ("_get_write_results_queue", "get_write_results_queue"):
        stock = getattr(filesystem_async, name, None)
        if stock is None:
            continue

        def forked_queue(*args: Any, **kwargs: Any) -> Any:
            with filesystem_async._disable_gc():
                if filesystem_async._results_queue is None:
                    filesystem_async._results_queue = mp.get_context("fork").Manager().Queue()
            return filesystem_async._results_queue

        forked_queue.__wrapped__ = stock  # type: ignore[attr-defined]
        setattr(filesystem_async, name, forked_queue)


# --- autocast of Megatron-Core's autograd functions ----------------------------------------------

_AUTOCAST_FUNCTIONS = (
    "LinearWithFrozenWeight",
    "LinearWithGradAccumulationAndAsyncCommunication",
)


def _patch_autocast() -> None:
    from megatron.core.tensor_parallel import layers

    for name in _AUTOCAST_FUNCTIONS:
        fn = getattr(layers, name, None)
        if fn is None:
            continue
        forward = getattr(fn.forward, "__wrapped__", None)
        backward = getattr(fn.backward, "__wrapped__", None)
        if forward is None or backward is None:
            continue  # not decorated as expected: leave it as it is
        fn.forward = staticmethod(torch.amp.custom_fwd(forward, device_type="cpu"))
        fn.backward = staticmethod(torch.amp.custom_bwd(backward, device_type="cpu"))


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


def _patch_tensor_type_checks() -> None:
    stock_type = torch.Tensor.type

    @functools.wraps(stock_type)
    def tensor_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = stock_type(self, *args, **kwargs)
        if args or kwargs or not getattr(_as_cuda, "depth", 0) or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = tensor_type  # type: ignore[method-assign,assignment]
    for module_name, owner_name, name in _TYPE_CHECKING_FUNCTIONS:
        module = importlib.import_module(module_name)
        owner = getattr(module, owner_name) if owner_name else module
        setattr(owner, name, _reporting_cuda_types(getattr(owner, name)))
