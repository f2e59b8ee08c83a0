"""A critic: the Megatron-Core GPT of a Hugging Face family with a one-output value head."""

from __future__ import annotations

from typing import Any

import torch

from lightning_mcore_ckpt.tiny import HFGPTModule


class HFValueModule(HFGPTModule):
    """Regresses every token's value on a target made from its label (mean squared error)."""

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from lightning_mcore_ckpt.hf import HFBridge

        bridge = HFBridge(self.hparams.hf_model_path, head="value")
        config = bridge.transformer_config(
            hidden_dropout=0.0,
            attention_dropout=0.0,
            sequence_parallel=getattr(self.trainer.strategy, "sequence_parallel", False),
        )
        self.model = bridge.gpt_model(config)

    @staticmethod
    def _loss(values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return ((values.squeeze(-1) - labels.float() / 64 + 1) ** 2).mean()

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._loss(self.values(inputs), labels)

    def values(self, inputs: torch.Tensor) -> torch.Tensor:
        """``[batch, seq, 1]`` (replicated over tensor parallelism: no gather)."""
        position_ids = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
        out: torch.Tensor = self._net()(inputs, position_ids, None)
        return out

    def _forward_step(self, data: Any, model: Any) -> tuple[torch.Tensor, Any]:
        inputs, labels = next(data)
        position_ids = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
        output = model(inputs, position_ids, None)
        return output, lambda out: (self._loss(out, labels), {})
