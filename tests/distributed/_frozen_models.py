"""A tiny GPT whose base is frozen: only the output layer trains (a fine-tune of a head)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_mcore_ckpt.tiny import TinyGPTModule


class FrozenBase(TinyGPTModule):  # type: ignore[misc]
    def __init__(self, touch_frozen_at: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.touch_frozen_at = touch_frozen_at

    def configure_model(self) -> None:
        super().configure_model()
        for name, p in self.gpt.named_parameters():
            if "output_layer" not in name:
                p.requires_grad_(False)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)

    def on_train_batch_end(self, *args: Any) -> None:
        # A frozen weight changed behind autograd's back (through .data: no version bump).
        if self.trainer.global_step == self.touch_frozen_at:
            self.gpt.embedding.word_embeddings.weight.data[0, 0] += 1.0
