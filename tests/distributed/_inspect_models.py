"""Models for the inspect tests: the same tiny GPT with one more parameter, under two names."""

from __future__ import annotations

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
