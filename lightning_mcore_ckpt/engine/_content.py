"""What a checkpoint holds, checked by value: every floating tensor finite.

A step can be whole (every byte as hashed) and still useless: a job that diverged, or a bad
node that computed NaNs, saves them faithfully, and a recovery that trusts it loops through the
same failure at every restart. :func:`non_finite` names the floating tensors of a payload (the
nested dicts and lists a save stages, or a file's loaded content) that hold a NaN or an
infinity; the fast tier checks its copies with it, at save and at recovery
(``FastTier(check_finite=True)``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["non_finite"]


def _tensors(value: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{name}.{key}" if name else str(key))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{name}[{i}]")


def non_finite(payload: Any, limit: int = 5) -> list[str]:
    """The names (dotted paths in ``payload``) of its floating-point tensors that hold a NaN or
    an infinity, at most ``limit`` of them (the first found, in order). Reads every element
    once (a sum), and again, in chunks, only where that sum is not finite.

    Example::

        non_finite({"w": torch.tensor([1.0, float("nan")])})  # ['w']
    """
    found = []
    for name, tensor in _tensors(payload, ""):
        if tensor.is_floating_point() and tensor.numel() and not _finite(tensor.detach()):
            found.append(name)
            if len(found) >= limit:
                break
    return found


def _finite(tensor: torch.Tensor) -> bool:
    # A sum is finite only when every element is (a NaN or an infinity propagates), and costs
    # one pass without a temporary; a sum that is not finite may be an overflow of finite
    # values: then each element is checked.
    if bool(torch.isfinite(tensor.sum())):
        return True
    flat = tensor.reshape(-1)
    step = 1 << 22
    return all(bool(torch.isfinite(flat[i : i + step]).all()) for i in range(0, flat.numel(), step))
