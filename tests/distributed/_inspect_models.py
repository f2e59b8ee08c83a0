"""Models for the inspect tests: the same tiny GPT with one more parameter, under two names,
and steps of tiny GPTs of any shape written without training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lightning_mcore_ckpt.tiny import TinyGPTModule


class WithScale(TinyGPTModule):  # type: ignore[misc]
    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.scale = torch.nn.Parameter(torch.ones(4))


class WithGain(TinyGPTModule):  # type: ignore[misc]
    """``WithScale`` after a refactoring renamed ``scale`` to ``gain``."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.gain = torch.nn.Parameter(torch.ones(4))


def write_step(step: Path, **config: Any) -> Path:
    """A weights-only step of a tiny GPT with ``config``'s overrides (``num_layers=4``...),
    saved from this one process (global shapes do not depend on the layout): no training."""
    from megatron.core import dist_checkpointing

    from lightning_mcore_ckpt.format import layout, markers
    from lightning_mcore_ckpt.hf._import import (
        megatron_environ_writes_undone,
        single_process_parallel_state,
    )
    from lightning_mcore_ckpt.tiny import tiny_gpt

    with single_process_parallel_state(), megatron_environ_writes_undone():
        model = tiny_gpt(**config)
        (step / layout.MODEL_DIR).mkdir(parents=True)
        dist_checkpointing.save(
            model.sharded_state_dict(prefix="gpt."), str(step / layout.MODEL_DIR)
        )
    metadata = {
        "format_version": layout.METADATA_FORMAT_VERSION,
        "global_step": 0,
        "epoch": 0,
        "contents": ["model"],
    }
    (step / markers.METADATA_FILE).write_text(json.dumps(metadata))
    return step
