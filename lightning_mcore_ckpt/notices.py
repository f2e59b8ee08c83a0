"""Known notices of the libraries underneath, which tell a user of this package nothing, kept
out of the way where a command or a script of ours runs.

Each is a warning or a log record that a dependency prints about itself: Megatron-Core's
``GPTModel IS DEPRECATED`` at every model build, its fallbacks when Apex or Transformer Engine
is not installed, torchdata calling a deprecated ``torch.set_vital``, torch's distributed
checkpoint warning about its own ``ShardedTensor`` deprecation, and the like (:data:`KNOWN`,
each with where it comes from). Anything else — every error, every notice of this package,
every other warning — is shown as before.

Importing the package changes no warning filter and no logger. ``lightning-mcore-ckpt``'s
commands hide these notices while they run (:func:`known_notices_hidden`), and so do the
resume check's runs and the demo, which call :func:`hide_known_notices` first thing in their
own processes. A script of yours may do the same.

Example::

    from lightning_mcore_ckpt.notices import hide_known_notices

    hide_known_notices()  # first thing in your training script, before the imports below
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = [
    "KNOWN",
    "KnownNotice",
    "hide_known_notices",
    "known_notices_hidden",
    "python_warnings",
]


@dataclass(frozen=True)
class KnownNotice:
    """A notice of the library ``source``: a warning of ``category`` (or, with ``logger``, a
    record of the logger named ``source``) whose message starts with ``message`` (compared as
    Python's ``-W`` option compares: case aside).

    ``cpu_only``: advice that holds on GPUs only (hidden where the process trains on the CPU).

    Example::

        KnownNotice("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED", logger=True)
    """

    source: str
    message: str
    category: type[Warning] = UserWarning
    logger: bool = False
    cpu_only: bool = False


_DCP = "torch.distributed.checkpoint"
KNOWN = (
    # Megatron-Core and mbridge fall back to torch's implementations (and say so at import).
    KnownNotice("megatron.core", "Transformer Engine and Apex are not installed"),
    KnownNotice("megatron.core", "Apex is not installed"),
    KnownNotice("megatron.core", "absl.logging is not installed"),
    # Megatron-Core's own TransformerConfig default, and its models' deprecations.
    KnownNotice("megatron.core", "full scope is deprecated. Use empty cuda_graph_modules"),
    KnownNotice("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED", logger=True),
    # Megatron-Core's advice (CUDA_DEVICE_MAX_CONNECTIONS=1) for CUDA kernels: not on CPU ranks.
    KnownNotice(
        "megatron.core", "When using async grad allreduce it is recommended", cpu_only=True
    ),
    KnownNotice(
        "megatron.core", "When using sequence parallelism it is recommended", cpu_only=True
    ),
    # torchdata's StatefulDataLoader calls torch.set_vital, which torch deprecated.
    KnownNotice("torchdata", "'set_vital' is deprecated"),
    # torch's distributed checkpoint: its own ShardedTensor deprecation, Megatron-Core calling
    # its load() positionally, and a read on one process (export, diff: as intended).
    KnownNotice(
        _DCP, "Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning
    ),
    KnownNotice(_DCP, "The argument order of load has been changed"),
    KnownNotice(_DCP, "torch.distributed is disabled"),
    # Lightning's pytree helper uses what torch deprecated (isinstance(treespec, LeafSpec)).
    KnownNotice("lightning", "`isinstance(treespec", FutureWarning),
    # torch finds a CUDA toolkit but no CUDA runtime (a CPU machine with CUDA installed).
    KnownNotice("torch.utils.cpp_extension", "No CUDA runtime is found", logger=True),
    # Lightning's tips for its cloud products (its rank-zero logger: Fabric's or Lightning's).
    KnownNotice(
        "lightning.pytorch.utilities.rank_zero", "\N{ELECTRIC LIGHT BULB} Tip", logger=True
    ),
    KnownNotice("lightning.fabric.utilities.rank_zero", "\N{ELECTRIC LIGHT BULB} Tip", logger=True),
)
"""Every notice kept out of the way, with the library that prints it."""


class _Drop(logging.Filter):
    def __init__(self, prefixes: list[str]) -> None:
        super().__init__()
        self.prefixes = tuple(prefixes)

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def _chosen(cpu: bool) -> list[KnownNotice]:
    return [n for n in KNOWN if cpu or not n.cpu_only]


def _install(cpu: bool) -> list[tuple[logging.Logger, logging.Filter]]:
    by_logger: dict[str, list[str]] = {}
    for notice in _chosen(cpu):
        if notice.logger:
            by_logger.setdefault(notice.source, []).append(notice.message)
        else:
            message = re.escape(notice.message)
            warnings.filterwarnings("ignore", message=message, category=notice.category)
    added: list[tuple[logging.Logger, logging.Filter]] = []
    for name, prefixes in by_logger.items():
        logger, drop = logging.getLogger(name), _Drop(prefixes)
        logger.addFilter(drop)
        added.append((logger, drop))
    return added


def python_warnings(*, cpu: bool = False) -> str:
    """The known warnings as a ``PYTHONWARNINGS`` value: for the processes a command starts,
    whose imports warn before any code of theirs runs.

    Example::

        env = {**os.environ, "PYTHONWARNINGS": python_warnings()}
    """
    return ",".join(
        f"ignore:{n.message}:{n.category.__name__}" for n in _chosen(cpu) if not n.logger
    )


def hide_known_notices(*, cpu: bool = False) -> None:
    """Hide the :data:`KNOWN` notices in this process from now on (``cpu``: also the advice
    that holds on GPUs only). For the entry point of a process: a script's first lines.

    Example::

        hide_known_notices(cpu=True)  # a CPU run: no advice for CUDA kernels either
    """
    _install(cpu)


@contextmanager
def known_notices_hidden(*, cpu: bool = False) -> Iterator[None]:
    """Hide the :data:`KNOWN` notices while the block runs; the warning filters and loggers
    are as they were afterwards.

    Example::

        with known_notices_hidden():
            export_checkpoint(step, hf_dir, out)
    """
    with warnings.catch_warnings():
        added = _install(cpu)
        try:
            yield
        finally:
            for logger, drop in added:
                logger.removeFilter(drop)
