"""``MegatronStrategy``: Megatron-Core parallelism and dist-checkpointing inside a Lightning Trainer.

The strategy is Lightning's side: options (:class:`StrategyConfig`), parallel state, the
training-step hooks. Checkpoints are read and written by :mod:`lightning_mcore_ckpt.engine`,
whose save contract (:class:`SaveOptions`, :class:`SaveRecord`, :class:`SaveListener`,
:class:`CheckpointSaveError`) is re-exported here.
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
from lightning_mcore_ckpt.strategy._config import StrategyConfig
from lightning_mcore_ckpt.strategy._strategy import MegatronStrategy

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
