"""Reading and writing lightning-mcore-ckpt step directories, independent of Lightning.

:class:`CheckpointWriter` writes ``model/``, ``optim/`` (Megatron-Core dist-checkpoints) and
``extra/`` (per rank), synchronously or in the background, and owns the one save in flight;
:class:`CheckpointReader` loads them into the current parallel layout. Both work on a
:class:`TrainingState`, this rank's view of the model and optimizers. ``MegatronStrategy``
delegates its ``save_checkpoint``, ``load_checkpoint`` and ``remove_checkpoint`` here.
"""

from __future__ import annotations

from lightning_mcore_ckpt.engine._collectives import cpu_group
from lightning_mcore_ckpt.engine._dedup import frozen_storages
from lightning_mcore_ckpt.engine._durable import commit_step, record_metadata
from lightning_mcore_ckpt.engine._reader import CheckpointReader, holds_weights_only
from lightning_mcore_ckpt.engine._records import (
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
    "TrainingState",
    "WriterKind",
    "WrittenBy",
    "commit_step",
    "cpu_group",
    "frozen_storages",
    "holds_weights_only",
    "megatron_optimizer_metadata",
    "module_sharded_state_dict",
    "optimizer_sharded_state_dict",
    "record_metadata",
    "stateless_params",
]
