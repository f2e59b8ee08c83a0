"""``MegatronStrategy``: Megatron-Core parallelism and dist-checkpointing inside a Lightning Trainer.

The strategy is Lightning's side: options, parallel state, the training-step hooks. Checkpoints
are read and written by :mod:`lightning_mcore_ckpt.engine`, whose save contract
(:class:`SaveOptions`, :class:`SaveRecord`, :class:`SaveListener`, :class:`CheckpointSaveError`)
is re-exported here.

Modules:

- ``strategy``: :class:`MegatronStrategy`, the whole class: Lightning's hooks, save, load and
  removal through the engine's writer and reader.
- ``config``: :class:`StrategyConfig`, every option (typed, documented, checked in one place);
  its fields are the strategy's keyword arguments.
- ``grads``: gradients under model parallelism: the pipeline schedule, their sync, clipping,
  Megatron optimizer steps (functions).
- ``model_setup``: the model at setup: its configs checked against the options, its precision
  converted (functions).
- ``dataloader``: training dataloaders made resumable (``ElasticSampler``).
- ``lightning_checkpoints``: Lightning's own ``ModelCheckpoint``: the paths it names, their
  removal, what the strategy refuses with it.
- ``roll_call``: after a failure, which nodes stopped answering (the note that names a silent
  node on every other rank's error).
"""

from __future__ import annotations

from lightning_mcore_ckpt.engine import (
    CONTENTS,
    LOADED_FROM_KEY,
    CheckpointSaveError,
    SaveListener,
    SaveOptions,
    SaveRecord,
)
from lightning_mcore_ckpt.format.layout import EXTRA_DIR, MODEL_DIR, OPTIM_DIR
from lightning_mcore_ckpt.strategy.config import StrategyConfig
from lightning_mcore_ckpt.strategy.strategy import MegatronStrategy

__all__ = [
    "CONTENTS",
    "EXTRA_DIR",
    "LOADED_FROM_KEY",
    "MODEL_DIR",
    "OPTIM_DIR",
    "CheckpointSaveError",
    "MegatronStrategy",
    "SaveListener",
    "SaveOptions",
    "SaveRecord",
    "StrategyConfig",
]
