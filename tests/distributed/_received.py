"""What a rank receives in torch.distributed's collectives, recorded (run inside each rank by
the tests that check that it does not grow with the ranks or the tensors)."""

from __future__ import annotations

import inspect
import pickle
from collections.abc import Callable
from typing import Any

OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list")
TENSOR_COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "gather", "reduce")


def _pickled(obj: Any) -> int:
    return len(pickle.dumps(obj))


def _tensor_bytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def record_received(
    calls: list[tuple[str, int]], recording: Callable[[], bool] = lambda: True
) -> None:
    """Wrap ``torch.distributed``'s collectives (as Megatron-Core, torch DCP and this package
    call them: ``torch.distributed.<name>``): while ``recording()``, each call's name and the
    bytes this rank received (objects pickled; another rank's part of a gather, a broadcast
    from another) go to ``calls``."""
    import torch.distributed as dist

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            if not recording():
                return result
            arguments = signature.bind(*args, **kwargs).arguments
            me = dist.get_rank()
            received = 0
            if name == "all_gather_object":
                parts = arguments["object_list"]
                received = sum(_pickled(p) for i, p in enumerate(parts) if i != me)
            elif name == "gather_object":
                parts = arguments.get("object_gather_list") or []
                received = sum(_pickled(p) for i, p in enumerate(parts) if i != me)
            elif name == "broadcast_object_list":
                if arguments.get("src", 0) != me:
                    received = _pickled(arguments["object_list"])
            elif name in ("all_reduce", "all_gather"):
                received = _tensor_bytes(arguments.get("tensor_list") or arguments["tensor"])
            elif name == "broadcast" and arguments.get("src", 0) != me:
                received = _tensor_bytes(arguments["tensor"])
            calls.append((name, received))
            return result

        return recorded

    for name in (*OBJECT_COLLECTIVES, *TENSOR_COLLECTIVES):
        setattr(dist, name, wrap(name, getattr(dist, name)))


def assert_other_ranks_receive_alike(results: dict[int, list[dict[str, Any]]]) -> None:
    """Every rank other than 0, at every world of ``results`` (``{world: [per rank: {"received":
    bytes, ...}]}``), received the same bytes, and some."""
    receipts = {
        (world, rank): result["received"]
        for world, ranks in results.items()
        for rank, result in enumerate(ranks)
        if rank
    }
    assert len(set(receipts.values())) == 1, receipts
    assert next(iter(receipts.values())) > 0
