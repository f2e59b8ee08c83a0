"""``MegatronCheckpoint``: Lightning's ``ModelCheckpoint`` for Megatron-Core steps.

- ``_config``: its options and their checks; ``_checkpoint``: the callback (Lightning's
  seams); ``_state``: its state (key, what a step carries, pickling); ``_commit``: the commit
  of a step, retention, exports; ``_preemption``: signals; ``_loops``: Lightning's loop state
  at a save and a resume; ``_setup``: checks at start.
"""

from __future__ import annotations

from lightning_mcore_ckpt.callback._checkpoint import MegatronCheckpoint
from lightning_mcore_ckpt.callback._config import SAVE_CONTENTS, CheckpointConfig

__all__ = ["SAVE_CONTENTS", "CheckpointConfig", "MegatronCheckpoint"]
