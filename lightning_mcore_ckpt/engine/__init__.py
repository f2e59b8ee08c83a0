"""Reading and writing lightning-mcore-ckpt step directories, independent of Lightning.

:class:`CheckpointWriter` writes ``model/``, ``optim/`` (Megatron-Core dist-checkpoints) and
``extra/`` (per rank), synchronously or in the background, and owns the one save in flight;
:class:`CheckpointReader` loads them into the current parallel layout. Both work on a
:class:`TrainingState`, this rank's view of the model and optimizers. ``MegatronStrategy``
delegates its ``save_checkpoint``, ``load_checkpoint`` and ``remove_checkpoint`` here.

Its modules:

- ``_records``: the engine's contract: ``SaveOptions``, ``SaveRecord``, ``SaveListener``, errors.
- ``_writer``: ``CheckpointWriter``, sync and async saves, the one save in flight; ``_requests``
  (the async request in flight), ``_shards`` (our shard writer's thread pool and background
  save thread), ``_staging`` (reused staging buffers), ``_plans`` (save plans kept while the
  state's structure holds), ``_agreeing_save_strategy`` (Megatron-Core's save strategy, rank 0's
  finalisation errors shared with every rank; ``_kept_conversions``: its torch sharded tensors
  kept with the plans), ``_extra`` (a rank's ``extra/rank_<r>.pt``),
  ``_dedup`` (frozen tensors written once), ``_durable`` (a save's metadata, the seal of a save
  made by hand).
- ``_reader``: ``CheckpointReader``, a load into the current parallel layout; ``_parallel_reader``
  (a step's shard files read in parallel, each record into its tensor).
- ``_rank_state``: one rank's whole state in one file (the fast tier's format): staged into
  reused host buffers, written, loaded back into the same layout.
- ``_state_dicts`` (``TrainingState``: this rank's sharded state dicts), ``_collectives`` (rank
  0's answer, an agreed failure), ``_param_groups`` (a distributed optimizer's parameter groups
  recorded by parameter at a save, mapped onto the live inner optimizers at a load: a step
  saved with expert parallelism loads into another expert-parallel size).
"""

from __future__ import annotations

from lightning_mcore_ckpt.engine._collectives import cpu_group
from lightning_mcore_ckpt.engine._content import non_finite
from lightning_mcore_ckpt.engine._dedup import frozen_storages
from lightning_mcore_ckpt.engine._durable import record_metadata
from lightning_mcore_ckpt.engine._extra import extra_payload
from lightning_mcore_ckpt.engine._rank_state import StagingCache
from lightning_mcore_ckpt.engine._rank_state import read as read_rank_state
from lightning_mcore_ckpt.engine._rank_state import stage as stage_rank_state
from lightning_mcore_ckpt.engine._rank_state import state_name as rank_state_name
from lightning_mcore_ckpt.engine._rank_state import write as write_payload
from lightning_mcore_ckpt.engine._reader import CheckpointReader, holds_weights_only
from lightning_mcore_ckpt.engine._records import (
    BLOCKING_PARTS,
    CONTENTS,
    LOADED_FROM_KEY,
    CheckpointSaveError,
    Content,
    OptimizerSharding,
    SaveListener,
    SaveOptions,
    SaveRecord,
    WriterKind,
    WrittenBy,
)
from lightning_mcore_ckpt.engine._state_dicts import (
    TrainingState,
    megatron_optimizer_metadata,
    module_sharded_state_dict,
    optimizer_sharded_state_dict,
    stateless_params,
)
from lightning_mcore_ckpt.engine._writer import CheckpointWriter

__all__ = [
    "BLOCKING_PARTS",
    "CONTENTS",
    "LOADED_FROM_KEY",
    "CheckpointReader",
    "CheckpointSaveError",
    "CheckpointWriter",
    "Content",
    "OptimizerSharding",
    "SaveListener",
    "SaveOptions",
    "SaveRecord",
    "StagingCache",
    "TrainingState",
    "WriterKind",
    "WrittenBy",
    "cpu_group",
    "extra_payload",
    "frozen_storages",
    "holds_weights_only",
    "megatron_optimizer_metadata",
    "module_sharded_state_dict",
    "non_finite",
    "optimizer_sharded_state_dict",
    "rank_state_name",
    "read_rank_state",
    "record_metadata",
    "stage_rank_state",
    "stateless_params",
    "write_payload",
]
