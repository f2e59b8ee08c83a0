"""What a save is asked to do and what it did: options, records, listeners, errors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, get_args, runtime_checkable

__all__ = [
    "BLOCKING_PARTS",
    "CONTENTS",
    "LOADED_FROM_KEY",
    "CheckpointSaveError",
    "Content",
    "OptimizerSharding",
    "SaveListener",
    "SaveOptions",
    "SaveRecord",
    "WriterKind",
    "WrittenBy",
]

BLOCKING_PARTS = (
    "before",
    "create_step",
    "model_state_dict",
    "optimizer_state_dict",
    "plans",
    "planning",
    "staging",
    "extra",
    "write_inline",
    "schedule",
    "finalize",
)
"""The parts of a save's blocking time, in order: ``before`` (from the start the caller gave,
e.g. the checkpoint hook's, to the save: building Lightning's checkpoint dict, the wait for the
save before), ``create_step`` (the step directory, agreed), ``model_state_dict`` and
``optimizer_state_dict`` (Megatron-Core's sharded state dicts; the optimizer's key agreement),
``plans`` (the refusal checks and the plans' fingerprint with its all-reduce), ``planning``
(Megatron-Core's planning, or its cached plans), ``staging`` (the state's copy into host
buffers, async), ``extra`` (this rank's ``extra/`` file, fsynced, agreed), ``write_inline`` (a
sync save's write and finalisation), ``schedule`` (handing an async write to its thread) and
``finalize`` (an async save's finalisation at a later step)."""

Content = Literal["model", "optimizer", "extra"]
"""A part of a step directory, as named in ``SaveOptions.contents``."""
CONTENTS: tuple[Content, ...] = get_args(Content)
"""What a step directory can hold: every :data:`Content`, in order."""
OptimizerSharding = Literal["dp_reshardable", "fully_reshardable"]
"""How a Megatron-Core distributed optimizer's state is saved (Megatron-LM's
``distrib_optim_sharding_type``; ``MegatronStrategy(ckpt_optimizer_sharding)``)."""
WriterKind = Literal["threads", "megatron"]
"""Who is asked to write the shard files (``MegatronStrategy(ckpt_writer)``): our thread pool,
or Megatron-Core's own async machinery."""
WrittenBy = Literal["threads", "mcore", "nvrx"]
"""Who wrote a save's shard files (``SaveRecord.writer``): our thread pool, Megatron-Core's
built-in writer or NVIDIA's resiliency extension."""
LOADED_FROM_KEY = "lightning_mcore_ckpt"
"""Key of the checkpoint dict ``load_checkpoint`` returns that says where it came from and the
parallel layout that saved it (callbacks read it in ``on_load_checkpoint``)."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint write failed (raised on every rank, naming the step directory).

    Example::

        try:
            trainer.fit(module, ckpt_path="last")
        except CheckpointSaveError as err:
            log.error("%s", err)  # names the step, the failing rank and the cause
    """


@dataclass(frozen=True, kw_only=True)
class SaveRecord:
    """What one save did, once it is durable on every rank (the same on every rank).

    Passed to ``SaveOptions.on_finalized`` and to every registered :class:`SaveListener` that
    owns the path.

    Example::

        def report(record: SaveRecord) -> None:
            print(record.path, record.contents, f"blocked {record.blocking_time_s:.2f}s")

        trainer.save_checkpoint(
            "checkpoints/global_step_100", storage_options=SaveOptions(on_finalized=[report])
        )
    """

    path: Path
    """The step directory."""
    contents: tuple[Content, ...]
    """What was written: a subset of ``("model", "optimizer", "extra")``."""
    asynchronous: bool
    """Whether the shards were written in the background."""
    writer: WrittenBy
    """Who wrote the shards: ``"threads"`` (ours), ``"mcore"`` or ``"nvrx"`` (Megatron-Core's)."""
    parallel_layout: dict[str, int]
    """The parallel sizes of the saving run."""
    blocking_time_s: float
    """How long training was blocked, on the slowest rank."""
    write_time_s: float
    """How long the shard writes lasted, on the slowest rank."""
    total_time_s: float
    """From the start of the save until it was durable everywhere, on the slowest rank."""
    finalized_at: float
    """``time.perf_counter()`` on this rank when the save became durable everywhere."""
    optimizer_sharding: OptimizerSharding | None = None
    """The sharding type a Megatron-Core distributed optimizer's state was saved with (``None``:
    no distributed optimizer in this save)."""
    distributed_optimizer_parts: list[int] | None = None
    """Per optimizer, how many inner distributed optimizers it holds (a ``ChainedOptimizer`` of
    a dense and an expert one at EP > 1: 2; ``None``: no distributed optimizer). Recorded with
    the parameters each inner optimizer's groups held (in ``optim/``), by which a step loads
    into another expert-parallel size."""
    max_staging_bytes: int | None = None
    """The host bytes the save could stage at once (``MegatronStrategy(ckpt_max_staging_bytes)``;
    ``None``: unbounded, every tensor at once)."""
    blocking_parts_s: dict[str, float] = field(default_factory=dict)
    """``blocking_time_s`` by part, each the slowest rank's (:data:`BLOCKING_PARTS`; parts
    that did not run are 0): where a save's fixed costs go."""
    hashes: dict[str, str] = field(default_factory=dict)
    """On rank 0 (the rank that commits): the digest of every file the ranks hashed while
    writing it, by path relative to the step (see :mod:`lightning_mcore_ckpt.format.integrity`);
    empty on the other ranks."""


@runtime_checkable
class SaveListener(Protocol):
    """Told, on every rank, how the saves of the paths it owns ended.

    Registered once with :meth:`MegatronStrategy.add_save_listener` (``MegatronCheckpoint``
    registers its committer), instead of handlers passed with each save. For a save whose path
    a listener owns, a failure goes to the listener instead of being raised.
    """

    def owns(self, path: Path) -> bool:
        """Whether saves to ``path`` are this listener's."""
        ...

    def saved(self, record: SaveRecord) -> None:
        """Every rank, in order: the save is durable on all ranks."""
        ...

    def failed(self, path: Path, error: CheckpointSaveError) -> None:
        """Every rank: the save to ``path`` failed (the same error everywhere)."""
        ...


@dataclass(kw_only=True)
class SaveOptions:
    """What :meth:`MegatronStrategy.save_checkpoint` writes, passed as ``storage_options``.

    Example::

        trainer.save_checkpoint(
            "checkpoints/global_step_100",
            storage_options=SaveOptions(contents=["model"], synchronous=True),
        )
    """

    contents: Sequence[Content] = CONTENTS
    """Subset of ``("model", "optimizer", "extra")`` to write."""
    on_finalized: list[Callable[[SaveRecord], None]] = field(default_factory=list)
    """Called on every rank, in order, once the whole save is durable on all ranks, with its
    :class:`SaveRecord`. For an async save this happens at finalisation."""
    synchronous: bool = False
    """Write synchronously even with ``ckpt_async_save=True`` (e.g. before a preempted exit)."""
    on_error: Callable[[CheckpointSaveError], None] | None = None
    """Called on every rank instead of raising when this save fails (sync: from
    ``save_checkpoint``; async: at finalisation). Default: a :class:`SaveListener` that owns
    the path, else raise."""
    started_at: float | None = None
    """``time.perf_counter()`` when the caller began this save's work on the training thread
    (its own preparation then counts as blocking time). Default: when ``save_checkpoint``
    starts."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.contents) - set(CONTENTS))
        if unknown:
            raise ValueError(
                f"SaveOptions(contents=...): unknown {unknown}; choose from {list(CONTENTS)}"
            )
