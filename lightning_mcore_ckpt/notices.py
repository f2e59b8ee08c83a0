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
resume check's runs through the Python API, which call :func:`hide_known_notices` first thing
in their own processes. The demo and ``lightning-mcore-ckpt check-resume`` keep them instead,
with Lightning's banners (``GPU available: ...``, ``Initializing distributed: ...``, the
:data:`ROUTINE` warnings), in a log file they name at the end (:func:`log_known_notices`), so
that what the reader came for stands alone on the terminal. A script of yours may do either.

Example::

    from lightning_mcore_ckpt.notices import hide_known_notices

    hide_known_notices()  # first thing in your training script, before the imports below
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "KNOWN",
    "ROUTINE",
    "KnownNotice",
    "hide_known_notices",
    "known_notices_hidden",
    "log_known_notices",
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
    # Megatron-Core's own TransformerConfig default (0.19 names cuda_graph_modules, 0.16
    # cuda_graph_scope), and its models' deprecations.
    KnownNotice("megatron.core", "full scope is deprecated. Use empty cuda_graph_"),
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
    KnownNotice(  # megatron-core 0.16 calls the deprecated name
        _DCP,
        "`load_state_dict` is deprecated and will be removed in future versions",
        FutureWarning,
    ),
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

ROUTINE = (
    # A LightningModule with a validation_step trained without validation data (the demo's).
    KnownNotice("lightning", "You defined a `validation_step` but have no `val_dataloader`"),
)
"""Lightning's warnings about a run that are routine where a script of ours runs a job: kept
in the log by :func:`log_known_notices` (with Lightning's banners), shown everywhere else."""

_LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric")
"""The loggers of Lightning's banners (``GPU available: ...``, ``Initializing distributed``,
``Restoring states from ...``): records below WARNING go to the log of :func:`log_known_notices`."""


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


class _Log:
    """Where :func:`log_known_notices` writes, in this process (one file; a later call moves
    it)."""

    handler: logging.FileHandler | None = None
    shown_by: Any = None  # warnings.showwarning before ours: every other warning goes there
    notices: tuple[KnownNotice, ...] = ()

    @classmethod
    def write(cls, record: logging.LogRecord) -> None:
        if cls.handler is not None:
            cls.handler.handle(record)


class _ToLog(logging.Filter):
    """On a logger: its records that start with one of ``prefixes`` go to the log instead."""

    def __init__(self, prefixes: list[str]) -> None:
        super().__init__()
        self.prefixes = tuple(prefixes)

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(self.prefixes):
            return True
        _Log.write(record)
        return False


class _Below(logging.Filter):
    """On a handler of Lightning's: only what is worth a reader's attention (WARNING and up)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


def _is_known(message: str, category: type[Warning]) -> bool:
    text = message.casefold()
    return any(
        text.startswith(n.message.casefold()) and issubclass(category, n.category)
        for n in _Log.notices
    )


def _show_or_log(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """``warnings.showwarning`` while :func:`log_known_notices` routes: a known warning goes to
    the log, every other one where it went before."""
    if not _is_known(str(message), category):
        _Log.shown_by(message, category, filename, lineno, file, line)
        return
    text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
    record = logging.makeLogRecord(
        {"name": "py.warnings", "levelno": logging.WARNING, "levelname": "WARNING", "msg": text}
    )
    _Log.write(record)


def log_known_notices(path: str | os.PathLike[str], *, cpu: bool = False) -> Path:
    """From now on in this process, write the :data:`KNOWN` notices (``cpu``: also the advice
    that holds on GPUs only), Lightning's :data:`ROUTINE` warnings and its banners (the records
    of its loggers below WARNING: ``GPU available: ...``, ``Initializing distributed ...``) to
    the file ``path`` (appended; created with its directory), rather than stderr. Every other
    warning, every error and each notice of this package is shown as before. Returns ``path``.

    For the entry point of a process: a script's first lines; each process of a job calls it
    (Lightning's ranks are processes of their own), and they may share one file. It imports
    Lightning, whose import adds the handler that would print its banners on stderr. Where the
    root logger has handlers (logging configured before Lightning was imported), Lightning's
    records go there, as configured, and to this file too.

    Example::

        log = log_known_notices("out/run.log", cpu=True)  # first thing, before the imports
        ...
        print(f"Lightning's messages and the libraries' notices: {log}")
    """
    target = Path(path).absolute()
    before = _Log.handler
    if before is not None and Path(before.baseFilename) == target:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(target, encoding="utf-8")
    handler.setFormatter(
        logging.Formatter("%(asctime)s [pid %(process)d] %(name)s %(levelname)s: %(message)s")
    )
    _Log.handler, _Log.notices = handler, (*_chosen(cpu), *ROUTINE)
    if before is None:
        _route(cpu)
    for name in _LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        if before is not None:
            logger.removeHandler(before)
        logger.addHandler(handler)
    if before is not None:
        before.close()
    return target


def _route(cpu: bool) -> None:
    """The first :func:`log_known_notices` of a process: send what it names to ``_Log``."""
    _Log.shown_by, warnings.showwarning = warnings.showwarning, _show_or_log
    by_logger: dict[str, list[str]] = {}
    for notice in _chosen(cpu):
        if notice.logger:
            by_logger.setdefault(notice.source, []).append(notice.message)
    for name, prefixes in by_logger.items():
        logging.getLogger(name).addFilter(_ToLog(prefixes))
    import lightning.pytorch  # noqa: F401 - its import adds its handlers (to stderr)

    for name in _LIGHTNING_LOGGERS:
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(_Below())


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
