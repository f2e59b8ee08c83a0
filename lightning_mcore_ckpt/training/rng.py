"""Per-rank RNG state: Python, NumPy, torch CPU, every CUDA device, Megatron's RNG tracker.

Implements ``torch.distributed.checkpoint.stateful.Stateful``. The state carries a ``version``;
loading a state that lacks a key (an older format, or one saved without CUDA) warns and restores
what is there instead of raising ``KeyError``.

Version 2 holds only tensors, ints, floats and strings, so that it loads with
``torch.load(weights_only=True)`` and no NumPy type allowed: NumPy's Mersenne Twister state is a
``{"bit_generator", "key", "pos", "has_gauss", "gauss"}`` dict with its key as an int64 tensor
(version 1 held NumPy's own tuple, with the key as an array; it still loads).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from lightning_mcore_ckpt import _cpu

__all__ = ["RNG_STATE_VERSION", "RNGState"]

log = logging.getLogger(__name__)

RNG_STATE_VERSION = 2


def _numpy_state() -> dict[str, Any]:
    state = np.random.get_state(legacy=False)
    return {
        "bit_generator": state["bit_generator"],
        "key": torch.from_numpy(state["state"]["key"].astype(np.int64)),
        "pos": int(state["state"]["pos"]),
        "has_gauss": int(state["has_gauss"]),
        "gauss": float(state["gauss"]),
    }


def _set_numpy_state(state: Any) -> None:
    if isinstance(state, dict):  # version 2
        key = state["key"].numpy().astype(np.uint32)
        state = (state["bit_generator"], key, state["pos"], state["has_gauss"], state["gauss"])
    np.random.set_state(state)


class RNGState:
    """The RNG streams of this process, saved and restored as one ``Stateful``.

    Example::

        state = RNGState().state_dict()     # at save time, on every rank
        RNGState().load_state_dict(state)   # at resume, on the same rank
    """

    def state_dict(self) -> dict[str, Any]:
        """Capture every RNG stream of this process."""
        from megatron.core import tensor_parallel

        state: dict[str, Any] = {
            "version": RNG_STATE_VERSION,
            "python": random.getstate(),
            "numpy": _numpy_state(),
            "torch_cpu": torch.get_rng_state(),
        }
        if not _cpu.on_cpu():  # a CPU run on a GPU machine leaves the GPUs alone
            state["torch_cuda"] = torch.cuda.get_rng_state_all()
        tracker = tensor_parallel.get_cuda_rng_tracker()
        if getattr(tracker, "states_", None):
            state["megatron_tracker"] = {k: v.clone() for k, v in tracker.get_states().items()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the streams present in ``state_dict``; warn about the ones that are missing."""
        from megatron.core import tensor_parallel

        version = state_dict.get("version")
        if version is not None and version > RNG_STATE_VERSION:
            raise ValueError(
                f"RNG state has version {version}, newer than this package understands "
                f"({RNG_STATE_VERSION}); upgrade lightning-mcore-ckpt to resume this checkpoint"
            )
        missing = []
        if "python" in state_dict:
            random.setstate(state_dict["python"])
        else:
            missing.append("python")
        if "numpy" in state_dict:
            _set_numpy_state(state_dict["numpy"])
        else:
            missing.append("numpy")
        if "torch_cpu" in state_dict:
            torch.set_rng_state(state_dict["torch_cpu"])
        else:
            missing.append("torch_cpu")
        if not _cpu.on_cpu():
            cuda = state_dict.get("torch_cuda")
            if cuda is not None and len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
            else:
                missing.append("torch_cuda")
        if "megatron_tracker" in state_dict:
            tensor_parallel.get_cuda_rng_tracker().set_states(
                {k: v.clone() for k, v in state_dict["megatron_tracker"].items()}
            )
        else:
            missing.append("megatron_tracker")
        if missing:
            log.warning(
                "RNG state in the checkpoint has no %s; those streams keep their current "
                "(seeded) state, so dropout and sampling after resume may differ from an "
                "uninterrupted run",
                ", ".join(missing),
            )
