"""``MegatronCheckpoint``: Lightning's ``ModelCheckpoint`` for Megatron-Core steps.

- ``checkpoint``: the callback, whole (Lightning's seams: when, which, how);
- ``_config``: its options (``CheckpointConfig``, their ``Literal`` types) and their checks;
- ``timing``: ``SaveTiming``, where a save Lightning's triggers ask for may land;
- ``preemption``: ``Preemption``, the signals every rank agrees on;
- ``startup``: the checks and the locks when a run starts;
- ``nodes``: which ranks share a directory (one per job, or one per node);
- ``fast_tier``: ``FastTierRun``, the fast tier during one fit (its saves, their figures, the
  recovery of ``"last"``); ``fast_records``: ``FastRecords``, its record of saves and
  recoveries (``fast_tier.jsonl``), in the persistent tier;
- ``_loops``: Lightning's loop state at a save and a resume;
- ``bookkeeping``: Lightning's best/last bookkeeping for steps that commit later or fail;
- ``legacy_state``: the callback's state in a step of the previous release;
- ``_commit``: the commit of a step (write, seal, publish to each tier), retention, exports
  (``_intent``: what a save asks for; ``_export``: the Hugging Face export; ``_tier``: a
  ``dirpath``'s tiers and retention across them).
"""

from __future__ import annotations

from lightning_mcore_ckpt.callback._config import SAVE_CONTENTS, CheckpointConfig
from lightning_mcore_ckpt.callback.checkpoint import MegatronCheckpoint

__all__ = ["SAVE_CONTENTS", "CheckpointConfig", "MegatronCheckpoint"]
