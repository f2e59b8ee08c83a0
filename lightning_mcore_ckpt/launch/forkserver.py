"""What the server process that forks :func:`~lightning_mcore_ckpt.testing.run_distributed`'s ranks
imports first: torch, Lightning and Megatron-Core, without ever initialising CUDA.

Why a forkserver, and why it must not touch CUDA
------------------------------------------------
Each rank is forked from a server process that has already imported torch, Lightning and
Megatron-Core, so it starts in a fraction of a second instead of re-importing them. A process
forked from one that has initialised CUDA cannot use CUDA: torch refuses with "Cannot
re-initialize CUDA in forked subprocess". Torch counts even a query as initialising: its
``torch._C._cuda_getDeviceCount`` (behind ``torch.cuda.is_available()`` and ``device_count()``)
marks every later fork as bad, also on a machine without a GPU. Megatron-Core asks
``torch.cuda.is_available()`` while it is imported (``dist_checkpointing``'s Transformer Engine
check, and ``torch.utils.cpp_extension`` through ``tensor_parallel``); Lightning sets
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` when it is imported, which makes that question go to NVML
instead, but Megatron-Core was imported first. A rank that trained on a GPU then failed at once.

The choice: keep the forkserver (a CUDA rank starts as fast as a CPU one) and make the process
that forks ranks never initialise CUDA, by construction:

1. ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` is set before anything is imported, so that
   ``torch.cuda.is_available()`` asks NVML (the driver's management library), which does not
   initialise CUDA.
2. While the libraries are imported, a CUDA device count that NVML cannot give (no NVML: a
   machine without the driver; a MIG device named by UUID) is asked in a short-lived child
   process forked for the question, so the answer is the real one and this process stays clean.
3. Anything that still initialises CUDA here (``torch._C._cuda_init``, e.g. a library that
   creates a CUDA tensor while it is imported) is recorded with its stack in
   :data:`CUDA_INITIALISED_BY`; a rank that then fails to use CUDA says so
   (:mod:`lightning_mcore_ckpt.launch.local`).

Spawning CUDA ranks instead would cost every rank the imports (seconds each, at every start):
the forkserver stays, for CPU and CUDA ranks alike.

Importing this module outside a forkserver does the same imports; it is not meant to be.
"""

from __future__ import annotations

import gc
import os
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# Before torch is imported: torch.cuda.is_available() then asks NVML, not CUDA.
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"

import torch  # after the environment variable above

from lightning_mcore_ckpt.launch._child import ask_a_child
from lightning_mcore_ckpt.notices import known_notices_hidden

__all__ = ["CUDA_INITIALISED_BY", "PRELOADED", "answered_counts", "no_cuda_initialisation"]

# The libraries the ranks use, in the order they are imported here. Lightning before
# Megatron-Core, as Lightning's own import would set the NVML check (set above anyway). Then
# what a rank of a training job imports next (the model, the checkpoint engine, this package's
# strategy, callback and resume check, the tiny models of its demo): imported once here rather
# than by every rank (about a second of CPU each, more where this package's bytecode is not
# cached).
_MODULES = (
    "lightning.pytorch",
    "megatron.core",
    "lightning_mcore_ckpt.launch.local",
    "torchdata.stateful_dataloader",
    "megatron.core.models.gpt",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "lightning_mcore_ckpt.strategy",
    "lightning_mcore_ckpt.callback",
    "lightning_mcore_ckpt.resume_check",
    "lightning_mcore_ckpt.tiny",
    # Imported inside the functions that build a model, its optimizer and its first save: each
    # rank would import them at its start.
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.mimo.model.base",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "lightning_mcore_ckpt.hf",
    "lightning_mcore_ckpt.training.schedules",
)

CUDA_INITIALISED_BY: list[str] = []
"""The stack of every call that initialised CUDA in this process while it imported the
libraries (empty: every rank forked from it can use CUDA)."""

PRELOADED: list[str] = []
"""The modules this process imported for its ranks."""

PRELOAD_FAILED: dict[str, str] = {}
"""Each module of ``_MODULES`` this process could not import, with why (the traceback of the
``ImportError``): a rank imports it itself, later, and says nothing of it otherwise."""

_counts: dict[str | None, int] = {}


def answered_counts() -> dict[str | None, int]:
    """The CUDA device counts asked of a child process, by ``CUDA_VISIBLE_DEVICES``."""
    return dict(_counts)


def _count_in_a_child(count: Callable[[], int]) -> int | None:
    """``count()`` called in a forked child process; ``None`` if the child gave no answer."""
    answered, text = ask_a_child(lambda: str(int(count())))
    return int(text) if answered and text else None


@contextmanager
def no_cuda_initialisation() -> Iterator[None]:
    """Within: a CUDA device count is asked in a child process, and a CUDA initialisation is
    recorded in :data:`CUDA_INITIALISED_BY` (and still done: what was imported behaves as it
    would anywhere else, and a rank that needs CUDA then says why it cannot have it)."""
    c = torch._C
    if not hasattr(c, "_cuda_getDeviceCount"):  # torch built without CUDA
        yield
        return
    count, init = c._cuda_getDeviceCount, c._cuda_init

    def device_count() -> int:
        key = os.environ.get("CUDA_VISIBLE_DEVICES")
        if key not in _counts:
            answer = _count_in_a_child(count)
            if answer is None:  # no answer from the child: ask here, and say so
                CUDA_INITIALISED_BY.append("".join(traceback.format_stack()[:-1]))
                answer = int(count())
            _counts[key] = answer
        return _counts[key]

    def cuda_init(*args: Any, **kwargs: Any) -> Any:
        CUDA_INITIALISED_BY.append("".join(traceback.format_stack()[:-1]))
        return init(*args, **kwargs)

    c._cuda_getDeviceCount, c._cuda_init = device_count, cuda_init
    try:
        yield
    finally:
        c._cuda_getDeviceCount, c._cuda_init = count, init


def _preload() -> None:
    # What the libraries say about themselves as they are imported (Megatron-Core's fallbacks,
    # torch's "No CUDA runtime is found": lightning_mcore_ckpt.notices) is said once per server,
    # before any rank runs, where no rank's log would keep it: hidden while they are imported.
    # The filters are as before afterwards, so the ranks forked from here start as usual.
    with no_cuda_initialisation(), known_notices_hidden():
        for name in _MODULES:
            try:
                __import__(name)
            except ImportError:  # as multiprocessing's own preload: a rank imports it itself
                PRELOAD_FAILED[name] = traceback.format_exc()
                continue
            PRELOADED.append(name)
    if torch.cuda.is_initialized() and not CUDA_INITIALISED_BY:
        CUDA_INITIALISED_BY.append("CUDA was initialised before this module was imported")
    # What was imported lives as long as the ranks forked from here: out of the garbage
    # collector's sight (Python's advice for processes that fork without exec). A rank's
    # collection then walks only its own objects, not the libraries' millions (Megatron-Core
    # collects at every save and load of a distributed optimizer's state), and leaves their
    # pages shared with this process instead of copying them.
    gc.collect()
    gc.freeze()


_preload()
