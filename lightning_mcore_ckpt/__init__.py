"""Megatron-Core distributed checkpointing for PyTorch Lightning.

``MegatronStrategy`` runs Megatron-Core tensor/pipeline/data parallelism inside a Lightning
``Trainer`` and writes reshardable Megatron-Core dist-checkpoints; ``MegatronCheckpoint`` decides
when to save, commits each step, keeps the right ones and resumes exactly from ``"last"``;
``HFExport`` adds a Hugging Face copy of the weights through mbridge.

Heavy dependencies (Megatron-Core, Lightning) are imported on first use of a public name, so
``import lightning_mcore_ckpt`` is instant and silent.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_mcore_ckpt._version import __version__

if TYPE_CHECKING:
    from lightning_mcore_ckpt.callback import MegatronCheckpoint
    from lightning_mcore_ckpt.engine import CheckpointSaveError, SaveOptions, SaveRecord
    from lightning_mcore_ckpt.errors import ConfigurationError
    from lightning_mcore_ckpt.fast import FastTier
    from lightning_mcore_ckpt.hf import HFExport
    from lightning_mcore_ckpt.resume_check import ResumeJob, ResumeReport, check_resume
    from lightning_mcore_ckpt.safety.safe_load import UnsafeCheckpointError
    from lightning_mcore_ckpt.strategy import MegatronStrategy
    from lightning_mcore_ckpt.training.sampler import ElasticSampler

__all__ = [
    "CheckpointSaveError",
    "ConfigurationError",
    "ElasticSampler",
    "FastTier",
    "HFExport",
    "MegatronCheckpoint",
    "MegatronStrategy",
    "ResumeJob",
    "ResumeReport",
    "SaveOptions",
    "SaveRecord",
    "UnsafeCheckpointError",
    "__version__",
    "check_resume",
]

_LAZY = {
    "CheckpointSaveError": "lightning_mcore_ckpt.engine",
    "ConfigurationError": "lightning_mcore_ckpt.errors",
    "ElasticSampler": "lightning_mcore_ckpt.training.sampler",
    "FastTier": "lightning_mcore_ckpt.fast",
    "HFExport": "lightning_mcore_ckpt.hf",
    "MegatronCheckpoint": "lightning_mcore_ckpt.callback",
    "MegatronStrategy": "lightning_mcore_ckpt.strategy",
    "ResumeJob": "lightning_mcore_ckpt.resume_check",
    "ResumeReport": "lightning_mcore_ckpt.resume_check",
    "SaveOptions": "lightning_mcore_ckpt.engine",
    "SaveRecord": "lightning_mcore_ckpt.engine",
    "UnsafeCheckpointError": "lightning_mcore_ckpt.safety.safe_load",
    "check_resume": "lightning_mcore_ckpt.resume_check",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_mcore_ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
