"""Every difference between the library versions we support, in one place.

Supported: megatron-core 0.16.1 (Python 3.11 and 3.12) through 0.19.x (Python 3.12; every release
since 0.17 needs Python >= 3.12), transformers 4.51+ and 5.x, mbridge 0.15. Each branch names
the version and the API that changed; the rest of the package calls these helpers and never
checks a version itself.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import threading
from collections.abc import Iterator
from importlib import metadata
from typing import Any

log = logging.getLogger(__name__)

BUILTIN = "mcore"
"""Megatron-Core's own async writer (forked/threaded writers, files through the local FS)."""
NVRX = "nvrx"
"""NVIDIA's resiliency extension writer (persistent worker; an optional extra)."""
THREADS = "threads"
"""Our own writer: Megatron-Core's plans, written by a persistent thread pool of each rank."""
WRITERS = (THREADS, "megatron")
"""The values of ``MegatronStrategy(ckpt_writer=...)``: ``"megatron"`` is :func:`async_strategy`."""


def package_version(name: str) -> str | None:
    """The installed version of the distribution ``name``, or ``None``."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str]:
    """The versions that write a step (recorded in its ``metadata.json``)."""
    return dict(_versions())


_OPTIONAL = (
    ("transformers", "transformers"),
    ("mbridge", "mbridge"),
    ("nvidia_resiliency_ext", "nvidia-resiliency-ext"),
)
"""The optional libraries of :func:`versions`, by key and distribution: where installed."""


def _optional_versions() -> dict[str, str]:
    return {key: v for key, dist in _OPTIONAL if (v := package_version(dist)) is not None}


@functools.cache
def _versions() -> dict[str, str]:
    # Read once: a process keeps the modules it imported, whatever is installed later.
    import lightning
    import megatron.core
    import torch

    from lightning_mcore_ckpt import _version

    found = {
        "lightning_mcore_ckpt": _version.__version__,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "megatron_core": getattr(megatron.core, "__version__", None)
        or package_version("megatron-core")
        or "unknown",
    }
    found.update(_optional_versions())
    return found


_MODULES = {"torch": "torch", "lightning": "lightning", "megatron_core": "megatron.core"}
"""The libraries of :func:`versions` read from their modules, by their key there."""


def installed_versions() -> dict[str, str]:
    """The versions of :func:`versions` without importing a library to read its version: from
    the module where this process has imported it, else from its installed distribution (which
    may lack the module's local build label: torch ``2.13.0`` for ``2.13.0+cu130``). For
    commands that compare a step's versions with this installation's and load no library.

    Example::

        installed_versions()["megatron_core"]  # "0.19.2"; "0.19.2+fe4e048" once imported
    """
    if all(module in sys.modules for module in _MODULES.values()):
        return versions()
    from lightning_mcore_ckpt import _version

    found = {"lightning_mcore_ckpt": _version.__version__}
    for key, module in _MODULES.items():
        loaded = getattr(sys.modules.get(module), "__version__", None)
        found[key] = loaded or package_version(module.replace(".", "-")) or "unknown"
    found.update(_optional_versions())
    return found


def _mcore_at_least(version: str) -> bool:
    from packaging.version import Version

    installed = installed_versions()["megatron_core"]
    return Version(installed).release >= Version(version).release


@functools.cache
def _save_takes_async_strategy() -> bool:
    # megatron-core 0.19: dist_checkpointing.save() gained ``async_strategy`` ("nvrx" by default,
    # which imports nvidia-resiliency-ext >= 0.6; "mcore" is the built-in writer, now logged as
    # deprecated). 0.16 has no such parameter: the built-in writer is the only one.
    from megatron.core import dist_checkpointing

    return "async_strategy" in inspect.signature(dist_checkpointing.save).parameters


@functools.cache
def async_strategy() -> str:
    """The writer our saves use: NVRx where a compatible one is installed, else the built-in.

    Chosen once per process and logged once; every save records it in its metadata.
    """
    choice = BUILTIN
    reason = "the only writer of this megatron-core version"
    if _save_takes_async_strategy():
        from megatron.core.dist_checkpointing.strategies import nvrx

        from lightning_mcore_ckpt import _cpu

        try:
            usable = nvrx.has_nvrx_async_support()
        except AssertionError:  # installed, older than megatron-core's NVRX_MIN_VERSION
            usable = False
        if usable and not _cpu.on_cpu():
            choice, reason = NVRX, "a compatible nvidia-resiliency-ext is installed"
        elif usable:
            # NVRx's queue and worker put their tensors on torch.cuda.current_device().
            reason = "nvidia-resiliency-ext needs CUDA (this process trains on the CPU)"
        else:
            found = package_version("nvidia-resiliency-ext")
            reason = (
                "nvidia-resiliency-ext is not installed"
                if found is None
                else f"nvidia-resiliency-ext {found} is older than megatron-core needs "
                f"({nvrx.NVRX_MIN_VERSION})"
            )
    log.info("lightning-mcore-ckpt: checkpoint writer %r (%s)", choice, reason)
    return choice


def save_kwargs(writer: str = "megatron") -> dict[str, Any]:
    """Keyword arguments for ``dist_checkpointing.save`` that select :func:`async_strategy`
    (``writer="threads"``: Megatron-Core's built-in requests, which our writer runs)."""
    if not _save_takes_async_strategy():
        return {}
    return {"async_strategy": BUILTIN if writer == THREADS else async_strategy()}


def builtin_request_class() -> type:
    """Megatron-Core's own ``AsyncRequest`` (0.16 and 0.19)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    return AsyncRequest


def async_classes() -> tuple[type, type]:
    """``(AsyncCallsQueue, AsyncRequest)`` of the writer :func:`async_strategy` chose.

    A request must run on the queue of the same implementation: NVRx's requests carry NVRx's
    writer and results queue.
    """
    if _save_takes_async_strategy():
        # megatron-core 0.19: get_async_strategy() returns the classes of either writer.
        from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

        _, modules = get_async_strategy(async_strategy())
        return modules["AsyncCallsQueue"], modules["AsyncRequest"]
    from megatron.core.dist_checkpointing.strategies.async_utils import (
        AsyncCallsQueue,
        AsyncRequest,
    )

    return AsyncCallsQueue, AsyncRequest


def forget_staged_tensors() -> None:
    """Make NVRx's writer send every tensor again with its next request, and let go of the
    tensors earlier requests staged.

    With plans kept (``cached_metadata``), Megatron-Core asks NVRx's writer to cache a save's
    structure: once a request for a structure is *planned*, the writer's later requests for it
    carry only a key, and staging (``preload_fn``) looks the tensors up under that key, where the
    first request's staging kept them. NVRx stages in its worker process; we stage on the
    training thread (:func:`~lightning_mcore_ckpt.engine._requests.combine_async_requests`), so
    that cache is this process's and holds the model's and optimizer's tensors. A request planned
    and then dropped unstaged (the first save planned ahead, a save that failed between planning
    and staging) leaves the key known and its tensors nowhere, and the next save's staging fails
    ("Worker cache miss for key"). Called after any such drop and when the writer closes; does
    nothing where NVRx's writer was never imported.
    """
    prefix = "nvidia_resiliency_ext.checkpointing.async_ckpt."
    writer = getattr(sys.modules.get(prefix + "filesystem_async"), "FileSystemWriterAsync", None)
    caller = getattr(sys.modules.get(prefix + "core"), "PersistentAsyncCaller", None)
    for cleanup in (
        getattr(writer, "cleanup_tensor_caches", None),  # the keys known, the shm buffers
        getattr(caller, "cleanup_worker_data_cache", None),  # the tensors kept under them
    ):
        if cleanup is not None:
            cleanup()


def drain_write_results() -> int:
    """Empty the writers' process-wide results queues; how many stale results were dropped.

    Megatron-Core's writers (built-in and NVRx) report each dist-checkpoint's write results
    through one queue per process, and each finaliser takes the next item. A save that failed
    before its finalisers ran leaves its items there: the next save's finalisers would take
    them, and its ``.metadata`` would index another save's bytes. Called before every save,
    when nothing is in flight.
    """
    import queue as queue_module

    dropped = 0
    modules = ["megatron.core.dist_checkpointing.strategies.filesystem_async"]
    modules.append("nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async")
    for name in modules:
        module = sys.modules.get(name)  # a writer never imported has nothing queued
        results = getattr(module, "_results_queue", None)
        while results is not None:
            try:
                results.get_nowait()
            except queue_module.Empty:
                break
            dropped += 1
    return dropped


class _ErrorKeepingQueue:
    """A writer's results queue that passes on the original write error.

    Only ``put`` is used by the writer; an exception put there is replaced by the first
    ``OSError`` a write raised (it carries errno, message and file).
    """

    def __init__(self, queue: Any, errors: list[BaseException]) -> None:
        self._queue = queue
        self._errors = errors

    def put(self, item: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(item, BaseException) and self._errors:
            item = self._errors[0]
        self._queue.put(item, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


_patch_lock = threading.Lock()


@contextlib.contextmanager
def write_errors_keep_their_cause(args: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    """Run Megatron-Core's built-in shard writer so that a failed write keeps its ``OSError``.

    ``args`` are the writer function's arguments; yields them with its results queue wrapped.

    The ``OSError`` of a failed write is given the shard file's name (a failed ``write()``
    names none). megatron-core 0.16 then passes that error on to the finaliser, which raises
    ``RuntimeError("Worker failure: ...") from`` it. megatron-core 0.19 writes with threads and
    replaces a worker's error by ``RuntimeError("An error is caught while starting worker 0,
    error: <class 'OSError'>")`` with no cause; the wrapped results queue puts the original
    error back in its place, so the finaliser chains it as on 0.16. Only our own writer call is
    affected (the writer function is restored when it returns).
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    writer = filesystem_async.FileSystemWriterAsync
    original = writer.__dict__["write_preloaded_data"]
    errors: list[BaseException] = []

    signature = inspect.signature(original.__func__)

    def name_the_file(output: Any, write_bucket: Any) -> None:
        error = output[1] if isinstance(output, tuple) and len(output) == 2 else None
        if isinstance(error, OSError):
            if error.filename is None:
                error.filename = str(write_bucket[0])
            errors.append(error)

    class _Naming:
        # The worker's own results queue (0.16 reports through it, not by returning).
        def __init__(self, queue: Any, write_bucket: Any) -> None:
            self._queue, self._bucket = queue, write_bucket

        def put(self, item: Any, *args: Any, **kwargs: Any) -> None:
            name_the_file(item, self._bucket)
            self._queue.put(item, *args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._queue, name)

    def write_preloaded_data(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bucket = bound.arguments["write_bucket"]
        if bound.arguments.get("results_queue") is not None:
            bound.arguments["results_queue"] = _Naming(bound.arguments["results_queue"], bucket)
        out = original.__func__(*bound.args, **bound.kwargs)
        name_the_file(out, bucket)
        return out

    # 0.16 and 0.19 look at the writer's signature to decide which keywords to pass.
    write_preloaded_data.__signature__ = signature  # type: ignore[attr-defined]

    results_queue = filesystem_async._results_queue
    wrapped = tuple(
        _ErrorKeepingQueue(a, errors) if a is results_queue and a is not None else a for a in args
    )
    with _patch_lock:
        writer.write_preloaded_data = staticmethod(write_preloaded_data)  # type: ignore[method-assign]
        try:
            yield wrapped
        finally:
            writer.write_preloaded_data = original  # type: ignore[method-assign]


class _RopeNamesView:
    """A transformers 5 config seen with the RoPE attribute names of transformers 4.

    Everything else (methods included) is the wrapped config's own.
    """

    def __init__(self, config: Any) -> None:
        object.__setattr__(self, "_config", config)
        params = dict(getattr(config, "rope_parameters", None) or {})
        object.__setattr__(self, "rope_theta", params.get("rope_theta"))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        default = scaling.get("rope_type", "default") == "default"
        object.__setattr__(self, "rope_scaling", None if default else scaling)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._config, name, value)

    def __contains__(self, name: str) -> bool:
        return name in ("rope_theta", "rope_scaling") or name in self._config


def mbridge_hf_config(config: Any) -> Any:
    """The Hugging Face config to hand to mbridge.

    transformers 5 folded ``rope_theta`` and ``rope_scaling`` into ``rope_parameters``; mbridge
    0.15 (the newest) still reads ``hf_config.rope_theta`` and ``rope_scaling`` when it builds the
    Megatron-Core model. Under transformers 5 mbridge gets a view with those names, read from
    ``rope_parameters``; the config itself is not changed (what is exported is the config as
    transformers writes it). Under transformers 4 the config is passed as it is.
    """
    if hasattr(config, "rope_theta") or getattr(config, "rope_parameters", None) is None:
        return config
    return _RopeNamesView(config)


def check_readable(step: Any, subdirs: tuple[str, ...] = ("model", "optim")) -> None:
    """Refuse, naming both versions, a step this megatron-core version cannot read.

    megatron-core 0.17 moved a checkpoint's common (non-sharded) state from ``common.pt`` into
    the torch_dist files (a ``common_state`` sharded object); 0.17+ still read ``common.pt``, so a
    step written by 0.16 loads everywhere, but 0.16 reads only ``common.pt`` and cannot load a
    step written by 0.17 or newer.
    """
    from pathlib import Path

    if _mcore_at_least("0.17"):
        return  # reads both layouts
    step = Path(step)
    for sub in subdirs:
        directory = step / sub
        if not (directory / ".metadata").is_file() or (directory / "common.pt").is_file():
            continue
        from lightning_mcore_ckpt.format import markers

        written = ((markers.read_metadata(step) or {}).get("versions") or {}).get("megatron_core")
        raise ValueError(
            f"{step} was written by megatron-core {written or '0.17 or newer'}, whose format "
            f"megatron-core {installed_versions()['megatron_core']} cannot read ({sub}/ keeps "
            "its common "
            "state inside the torch_dist files, not in common.pt). Load it with megatron-core "
            ">= 0.17 (Python >= 3.12), where every step written by 0.16 also loads."
        )


def hybrid_model_class() -> type:
    """Megatron-Core's hybrid language model (a stack of layers of one kind each, from a pattern
    such as ``"*-*-"``): ``HybridModel`` since megatron-core 0.17, where ``MambaModel`` became a
    deprecated subclass of it; ``MambaModel`` in 0.16, the same model under its older name."""
    try:
        from megatron.core.models.hybrid.hybrid_model import HybridModel
    except ImportError:  # megatron-core 0.16
        from megatron.core.models.mamba.mamba_model import MambaModel

        return MambaModel
    return HybridModel


def hybrid_stack_classes() -> tuple[type, type]:
    """``(stack, submodules)`` of :func:`hybrid_model_class`'s decoder: ``HybridStack`` and
    ``HybridStackSubmodules`` since 0.17; ``MambaStack`` and ``MambaStackSubmodules`` in 0.16."""
    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    except ImportError:  # megatron-core 0.16
        from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules

        return MambaStack, MambaStackSubmodules
    return HybridStack, HybridStackSubmodules


def hybrid_model(
    config: Any, stack_spec: Any, layer_pattern: str, pipeline_stages: int, **kwargs: Any
) -> Any:
    """:func:`hybrid_model_class` with the layers of ``layer_pattern`` (Megatron-Core's
    symbols, e.g. ``"*-*-"``: attention, MLP) split evenly over ``pipeline_stages``.

    megatron-core 0.17+ takes ``hybrid_stack_spec`` and ``hybrid_layer_pattern``, whose stage
    boundaries are marked with ``"|"`` (a pattern without them is split at run time, with a
    deprecation warning); 0.16 takes ``mamba_stack_spec`` and ``hybrid_override_pattern``
    without boundaries and splits the layers evenly itself. Either way the checkpoint keys are
    the same (``decoder.layers.<global index>.``), so a step reshards across pipeline sizes.
    """
    model_class = hybrid_model_class()
    if model_class.__name__ == "MambaModel":  # megatron-core 0.16
        return model_class(
            config=config,
            mamba_stack_spec=stack_spec,
            hybrid_override_pattern=layer_pattern,
            **kwargs,
        )
    if pipeline_stages > 1 and len(layer_pattern) % pipeline_stages == 0:
        size = len(layer_pattern) // pipeline_stages
        layer_pattern = "|".join(
            layer_pattern[i : i + size] for i in range(0, len(layer_pattern), size)
        )
    return model_class(
        config=config, hybrid_stack_spec=stack_spec, hybrid_layer_pattern=layer_pattern, **kwargs
    )


def update_router_expert_bias(chunks: list[Any], config: Any) -> None:
    """Megatron-Core's update of the routers' ``expert_bias`` (aux-loss-free balancing) for a
    global batch, as its ``finalize_model_grads`` does after the gradients (0.16 reduces the
    token counts over the tensor-and-data-parallel group itself; 0.19 takes the group), then
    the counts reset (:func:`reset_router_token_counts`)."""
    import importlib

    from megatron.core import parallel_state

    # The module (the package's attribute of that name is the function).
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    update = finalize._update_router_expert_bias
    if "tp_dp_cp_group" in inspect.signature(update).parameters:
        group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        update(chunks, config, tp_dp_cp_group=group)
    else:
        update(chunks, config)
    reset_router_token_counts(chunks)


def reset_router_token_counts(chunks: list[Any]) -> None:
    """Zero each router's ``local_tokens_per_expert`` after the expert-bias update, so that the
    next update counts the next global batch only. Megatron-LM's newer ``finalize_model_grads``
    does so (``reset_model_temporary_tensors``); megatron-core 0.16 to 0.19 never reset them, so
    each update weighs every token since the process started, and a resumed run (whose counts
    start at zero: they are not checkpointed) would update the bias differently."""
    import torch

    for chunk in chunks:
        for module in chunk.modules():
            counts = getattr(module, "local_tokens_per_expert", None)
            if isinstance(counts, torch.Tensor) and hasattr(module, "expert_bias"):
                counts.zero_()
