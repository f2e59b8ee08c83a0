"""Make stock Megatron-Core run on CPU with a gloo process group.

This package is the only place that adapts third-party code to the CPU (differences between
library versions live in :mod:`.._compat`), and it changes nothing in a process that trains on
CUDA devices: :func:`install` adapts only a process whose devices are CPUs (``accelerator="cpu"``,
on any machine), so GPU runs always take the stock NCCL/CUDA code paths.

Without CUDA, Megatron-Core (0.16 to 0.19) fails in a handful of places that are not about
computation at all. Each adaptation is the smallest that makes the stock code path run:

* **``torch.cuda`` as "the device"** (:mod:`._device`). A listed set of Megatron modules
  (tensor-parallel layers and mappings, rotary embeddings, the GPT model, attention, the
  transformer layer, the pipeline schedules, the dist-checkpointing save finaliser and async
  queue, Megatron DDP and its gradient buffers, the mixed-precision and distributed optimizers,
  the grad scaler, gradient clipping, ``megatron.core.utils``) use ``torch.cuda.current_device()``
  or the literal ``"cuda"`` as a tensor device, call ``torch.cuda.synchronize()``, order work
  on CUDA streams, and seed or read the default CUDA generator. Inside those modules only,
  ``torch`` is a stand-in whose ``cuda`` is the CPU: current device ``cpu``, no-op synchronize
  and streams, RNG calls on ``torch.default_generator``, and tensor factories that put a
  ``"cuda"`` tensor on the CPU. The global ``torch.cuda`` is not touched.
* **CUDA RNG tracker.** Megatron's named "CUDA" RNG states (data-parallel, tensor-parallel,
  expert) are backed by the CPU generator, which is what dropout draws from on CPU: dropout is
  real, seeded per tensor-parallel rank exactly as on GPU, and checkpointed.
* **Legacy type strings.** The mixed-precision and distributed optimizers sort parameters by
  ``param.type() == "torch.cuda.FloatTensor"`` and gradient clipping asserts it: inside those
  functions, on the thread running them, a CPU tensor reports its CUDA type string.
* **Tied embeddings across pipeline stages.** The first and last stages' copies are made equal
  by an all-reduce of ``weight.data.cuda()``: inside that setup, on its thread, ``.cuda()`` of a
  CPU tensor is the tensor itself.
* **Causal mask and global memory buffer** (:mod:`._patches`) allocate on the CPU.
* **Async staging.** Staging for an async save is ``tensor.to("cpu")``, which is no copy for a
  CPU tensor, so training could mutate what the background writer is about to write. On CPU,
  staging copies, which is what the device-to-host copy does on GPU.
* **Shard writers' results queue.** Megatron-Core starts the Manager behind it with "spawn",
  which re-imports the main script's modules in the child (seconds at every process's first
  save) to keep CUDA state out of it; on CPU it is forked.
* **Mixed precision.** Megatron-Core's tensor-parallel linear functions declare their autocast
  behaviour for ``"cuda"`` only, so under CPU autocast (``precision="bf16-mixed"``) their
  backward would multiply a bf16 gradient by an fp32 weight. On CPU they are declared for
  ``"cpu"``: the backward runs under the autocast state of the forward, as on GPU.
* **Uneven gathers.** Expert tensor parallelism gathers and reduce-scatters each rank's routed
  tokens in uneven splits, which gloo refuses: on CPU they are padded and trimmed (gather), or
  summed whole and sliced (reduce-scatter).
* **MoE router on megatron-core 0.16.** Its router reads ``te_general_gemm``, a name that
  version binds only when Transformer Engine imports: it is bound to ``None`` here, as 0.17+
  does, and the router takes its plain-torch matmul.
* **Compiled helpers** (:mod:`._eager`). Megatron-Core compiles a few small helpers with
  ``torch.compile`` (``jit_fuser``: the MoE router's expert-bias update, fused activations...),
  which on the CPU means C++ built by the system's compiler at every process's first step:
  seconds of CPU each, and a failure where no compiler is installed. On CPU they run as the
  functions they wrap; what a user compiles is untouched.
* **Model configs.** :func:`transformer_config_overrides` turns off the fused kernels (CUDA
  only) and asks for CPU initialisation in configs built from a Hugging Face model.
* **Sequence parallelism** (:mod:`._norm`). The local layer spec's torch norm
  (``WrappedTorchNorm``) refuses it, and Megatron-Core refuses to train a mixture of experts
  with tensor parallelism without it. The builders of the local specs (the tiny GPT and hybrid
  models, ``HFBridge.gpt_model``) pass their spec through :func:`local_spec_norms`: the same
  torch norm, whose parameters are marked ``sequence_parallel`` as Apex's and Transformer
  Engine's are, so their gradients are summed over the tensor-parallel group.

What is *not* made to work here, and is avoided by the callers instead:
``FullyParallelLoadStrategyWrapper`` (its exchange allocates on the literal ``"cuda"``; on CPU the
strategy loads plainly, see :func:`parallel_load_supported`), and the fully reshardable
distributed-optimizer format's default gather (``Tensor.cuda()``): on CPU it is gathered over
the gloo group instead (:func:`optimizer_metadata_overrides`).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from lightning_mcore_ckpt._cpu import _device, _eager, _norm, _patches

__all__ = [
    "cuda_available",
    "install",
    "installed",
    "local_spec_norms",
    "on_cpu",
    "optimizer_metadata_overrides",
    "parallel_load_supported",
    "transformer_config_overrides",
]

_lock = threading.Lock()
_installed = False


def cuda_available() -> bool:
    """Whether this machine has a CUDA device torch can use."""
    return torch.cuda.is_available()


def installed() -> bool:
    """Whether the CPU adaptations are active in this process."""
    return _installed


def on_cpu() -> bool:
    """Whether this process runs Megatron-Core on the CPU: the adaptations are active, or (before
    :func:`install` was asked) the machine has no CUDA."""
    return _installed or not cuda_available()


def parallel_load_supported() -> bool:
    """Whether ``FullyParallelLoadStrategyWrapper`` can run here (it needs CUDA)."""
    return not on_cpu()


def transformer_config_overrides() -> dict[str, Any]:
    """``TransformerConfig`` fields a CPU run needs (none on CUDA): no fused CUDA kernels."""
    if not on_cpu():
        return {}
    return {
        "use_cpu_initialization": True,
        "masked_softmax_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
    }


def local_spec_norms(spec: Any, config: Any) -> Any:
    """A local (Transformer-Engine-free) layer spec whose norms allow sequence parallelism,
    when this process runs on the CPU; ``spec`` itself on CUDA.

    Every ``WrappedTorchNorm`` in ``spec`` becomes the same torch norm with its parameters
    marked ``sequence_parallel = config.sequence_parallel``. A spec of one transformer layer
    (what ``GPTModel`` takes: its block adds a final norm of Megatron-Core's global choice) comes
    back as the block's submodules: that layer for each layer of this pipeline stage, and the
    final norm. ``spec`` is not changed.

    Example::

        spec = _cpu.local_spec_norms(get_gpt_layer_local_spec(), config)
        model = GPTModel(config=config, transformer_layer_spec=spec, ...)
    """
    if not on_cpu():
        return spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import BaseTransformerLayer

    spec = _norm.replace_norms(spec)
    module = getattr(spec, "module", None) if isinstance(spec, ModuleSpec) else None
    if isinstance(module, type) and issubclass(module, BaseTransformerLayer):
        return TransformerBlockSubmodules(
            layer_specs=[spec] * _layers_of_this_stage(config), layer_norm=_norm.TorchNorm
        )
    return spec


def _layers_of_this_stage(config: Any) -> int:
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    if not parallel_state.model_parallel_is_initialized():
        return int(config.num_layers)
    return int(get_num_layers_to_build(config))


def optimizer_metadata_overrides() -> dict[str, Any]:
    """Sharded-state-dict metadata a distributed optimizer needs here (none on CUDA): the
    fully reshardable format gathered over the gloo group (its default gather moves tensors to
    the CUDA device with ``Tensor.cuda()``, which no stand-in reaches)."""
    if not on_cpu():
        return {}
    return {"distrib_optim_fully_reshardable_mem_efficient": True}


def install(device_type: str | None = None) -> bool:
    """Install the CPU adaptations once per process, when it trains on the CPU.

    ``device_type`` is the type of the devices this process trains on (the strategy passes its
    root device's, ``"cpu"`` for ``Trainer(accelerator="cpu")``, also on a machine with GPUs);
    ``None``: the CPU when the machine has no CUDA. For ``"cuda"`` nothing is changed: GPU runs
    use the stock code paths. Returns ``True`` when the adaptations are active after the call.
    Safe to call any number of times, from any thread.
    """
    global _installed
    if device_type is None:
        device_type = "cuda" if cuda_available() else "cpu"
    if device_type != "cpu":
        return _installed
    with _lock:
        if not _installed:
            _device.patch_modules()
            _device.patch_tensor_type_checks()
            _patches.patch_memory_buffer()
            _patches.patch_dist_checkpointing()
            _patches.patch_autocast()
            _patches.patch_moe_split_sizes()
            _patches.patch_moe_router_gemm()
            _patches.patch_uneven_gathers()
            _eager.run_compiled_helpers_eagerly()
            _installed = True
    return True
