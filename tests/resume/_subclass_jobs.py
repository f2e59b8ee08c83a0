"""Users' modules for the resume check's config tests (named by class_path in a LightningCLI
config, imported by every rank of every run)."""

from __future__ import annotations

from typing import Any

from lightning_mcore_ckpt.tiny import TinyGPTModule


class NarrowGPTModule(TinyGPTModule):
    """A user's subclass that forwards only some of the base's constructor arguments.

    LightningCLI fills ``hparams`` with the arguments of the class the config names (these two),
    so the base's own ``num_layers``, ``optimizer`` and ``megatron_bf16`` are not in them.
    """

    def __init__(self, lr: float = 1e-3, dropout: float = 0.1) -> None:
        super().__init__(lr=lr, dropout=dropout)


class FailingGPTModule(TinyGPTModule):
    """A job with a bug of its own: it raises on rank ``fail_rank`` in every run when
    ``fail_in="every_run"`` (the first run to fail is the uninterrupted one), or only when a
    checkpoint is loaded when ``fail_in="resume"`` (the resumed run)."""

    def __init__(self, fail_in: str = "every_run", fail_rank: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_in = fail_in
        self.fail_rank = fail_rank

    def _fail(self, where: str) -> None:
        if self.trainer.global_rank == self.fail_rank:
            raise KeyError(f"tokenizer_path (FailingGPTModule's own bug, in {where})")

    def configure_model(self) -> None:
        if self.fail_in == "every_run":
            self._fail("configure_model")
        super().configure_model()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.fail_in == "resume":
            self._fail("on_load_checkpoint")
        super().on_load_checkpoint(checkpoint)


class RouterStateGPTModule(TinyGPTModule):
    """A mixture of experts whose module adds router state of its own and forgets to save it:
    a per-expert scale of each router's probabilities, kept in a non-persistent buffer (no
    checkpoint holds it), moved after every optimizer step. A resumed run starts it afresh."""

    def configure_model(self) -> None:
        import torch
        from megatron.core.transformer.moe.router import TopKRouter

        super().configure_model()
        for module in self.modules():
            if isinstance(module, TopKRouter) and not hasattr(module, "user_scale"):
                experts = module.config.num_moe_experts
                module.register_buffer("user_scale", torch.ones(experts), persistent=False)
                module.register_forward_hook(_scale_probs)

    def on_train_batch_end(self, *args: Any) -> None:
        for module in self.modules():
            scale = getattr(module, "user_scale", None)
            if scale is not None:
                scale.mul_(1.05)


def _scale_probs(module: Any, inputs: Any, output: Any) -> Any:
    probs, routing_map = output
    return probs * module.user_scale.to(probs.dtype), routing_map
