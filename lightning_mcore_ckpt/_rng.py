"""Per-rank RNG state: Python, NumPy, torch CPU, every CUDA device, Megatron's RNG tracker.

Implements ``torch.distributed.checkpoint.stateful.Stateful``. The state carries a ``version``;
loading a state that lacks a key (an older format, or one saved without CUDA) warns and restores
what is there instead of raising ``KeyError``.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

__all__ = ["RNG_STATE_VERSION", "RNGState"]

log = logging.getLogger(__name__)

RNG_STATE_VERSION = 1


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
            "numpy": np.random.get_state(),
            "torch_cpu": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
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
            np.random.set_state(state_dict["numpy"])
        else:
            missing.append("numpy")
        if "torch_cpu" in state_dict:
            torch.set_rng_state(state_dict["torch_cpu"])
        else:
            missing.append("torch_cpu")
        if torch.cuda.is_available():
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
