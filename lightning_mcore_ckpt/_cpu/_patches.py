"""Megatron-Core's global memory buffer, async staging, shard writers' results queue,
autocast declarations and MoE split sizes, adapted to the CPU."""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "patch_autocast",
    "patch_dist_checkpointing",
    "patch_memory_buffer",
    "patch_moe_router_gemm",
    "patch_moe_split_sizes",
    "patch_uneven_gathers",
]

# --- global memory buffer --------------------------------------------------------------------


def patch_memory_buffer() -> None:
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


def patch_dist_checkpointing() -> None:
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


def patch_autocast() -> None:
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


def patch_moe_split_sizes() -> None:
    """MoE all-to-all token dispatch passes its split sizes to ``all_to_all_single`` as host
    arrays, which Megatron-Core makes them only by copying CUDA tensors to the host
    (``maybe_move_tensor_to_cpu(as_numpy=True)`` returns a CPU tensor unchanged, and a tensor
    is no valid split-size list). On CPU the copy is made here."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(
        tensor: Any, as_numpy: bool = False, record_stream: bool = False
    ) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.detach().numpy().copy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    for module in (moe_utils, token_dispatcher):
        if hasattr(module, "maybe_move_tensor_to_cpu"):
            module.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def patch_moe_router_gemm() -> None:
    """Megatron-Core 0.16 binds ``te_general_gemm`` in ``moe_utils`` only when Transformer Engine
    imports, and its router reads the name unconditionally (``NameError`` at the first forward
    of any MoE model). 0.17+ binds it to ``None`` without Transformer Engine: so is it here, and
    the router takes its plain-torch matmul."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def patch_uneven_gathers() -> None:
    """Expert tensor parallelism gathers and reduce-scatters the routed tokens along the first
    dimension in uneven splits (each rank routes its own number of tokens to the experts):
    ``all_gather`` into a list of unequal tensors and ``reduce_scatter`` of one, which NCCL
    runs and gloo refuses ("invalid tensor size"). On CPU, an uneven gather pads every rank's
    part to the largest and trims; an uneven reduce-scatter sums the whole tensor over the
    group and keeps this rank's rows. Even splits take Megatron-Core's own path."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = (
        mappings._gather_along_first_dim,
        mappings._reduce_scatter_along_first_dim,
    )

    def gather_along_first_dim(
        input_: torch.Tensor, group: Any, output_split_sizes: Any = None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if output_split_sizes is None or group.size() == 1 or len(set(output_split_sizes)) == 1:
            return gather(input_, group, output_split_sizes, *args, **kwargs)
        largest = max(output_split_sizes)
        padded = input_.new_zeros((largest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, output_split_sizes, strict=True)])

    def reduce_scatter_along_first_dim(
        input_: torch.Tensor, group: Any, input_split_sizes: Any = None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if input_split_sizes is None or group.size() == 1 or len(set(input_split_sizes)) == 1:
            return reduce_scatter(input_, group, input_split_sizes, *args, **kwargs)
        summed = input_.contiguous().clone()
        dist.all_reduce(summed, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return summed[start : start + input_split_sizes[group.rank()]].clone()

    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim
