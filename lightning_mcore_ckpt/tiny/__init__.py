"""Tiny models for tests, examples and laptops: a Megatron-Core GPT, a Megatron-Core hybrid model
(``HybridModel``: attention and MLP layers, Transformer-Engine-free) and a Hugging Face Qwen2.

All are built locally in seconds; nothing is downloaded. The GPT, its Lightning modules and
the token data are here; the hybrid model's layer spec is in ``hybrid``, the Hugging Face model
in ``hf``.

Example::

    from lightning_mcore_ckpt.tiny import tiny_gpt, tiny_hf_qwen2, tiny_hybrid

    model = tiny_gpt(hidden_dropout=0.1)        # after parallel state is initialised
    hybrid = tiny_hybrid("*-*-")                # the same, as a HybridModel
    hf_dir = tiny_hf_qwen2("/tmp/qwen2-tiny")   # config + safetensors + tokenizer
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from lightning_mcore_ckpt import _compat, _cpu
from lightning_mcore_ckpt.tiny.hf import TINY_SEQ_LEN, TINY_VOCAB, tiny_hf_model, tiny_hf_qwen2
from lightning_mcore_ckpt.tiny.hybrid import (
    TINY_HYBRID_PATTERN,
    check_layer_pattern,
    hybrid_local_stack_spec,
)
from lightning_mcore_ckpt.training.model_config import check_transformer_config

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

__all__ = [
    "TINY_HYBRID_PATTERN",
    "TINY_SEQ_LEN",
    "TINY_VOCAB",
    "HFGPTModule",
    "TinyGPTModule",
    "TinyHybridModule",
    "TokenDataModule",
    "TokenDataset",
    "hybrid_local_stack_spec",
    "megatron_ddp",
    "megatron_optimizer",
    "step_lr",
    "tiny_gpt",
    "tiny_gpt_config",
    "tiny_hf_model",
    "tiny_hf_qwen2",
    "tiny_hybrid",
]


def tiny_gpt_config(**overrides: Any) -> TransformerConfig:
    """A ``TransformerConfig`` for a 2-layer, 64-wide GPT, with the current parallel sizes.

    ``overrides`` replace any field, e.g. ``hidden_dropout=0.0`` or ``num_layers=4``.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    fields: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        use_cpu_initialization=_cpu.on_cpu(),
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        sequence_parallel=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def tiny_gpt(
    config: TransformerConfig | None = None,
    *,
    vocab_size: int = TINY_VOCAB,
    max_sequence_length: int = TINY_SEQ_LEN,
    **config_overrides: Any,
) -> GPTModel:
    """A Megatron-Core ``GPTModel`` from the local (Transformer-Engine-free) layer spec.

    Call after ``parallel_state`` is initialised (inside ``LightningModule.configure_model`` when
    training with :class:`~lightning_mcore_ckpt.MegatronStrategy`). The model holds this rank's
    tensor- and pipeline-parallel shard.

    Example::

        model = tiny_gpt(num_layers=4, hidden_dropout=0.0)
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = config if config is not None else tiny_gpt_config(**config_overrides)
    # MoE layers where the config has experts (num_moe_experts): Megatron-Core's SequentialMLP
    # of local experts, no grouped GEMM (a Transformer Engine kernel).
    layer = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, qk_layernorm=cfg.qk_layernorm)
    extra: dict[str, Any] = {}
    if getattr(cfg, "mtp_num_layers", None):  # multi-token prediction, from the same local layer
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        mtp = get_gpt_mtp_block_spec(cfg, layer, use_transformer_engine=False)
        extra["mtp_block_spec"] = _cpu.local_spec_norms(mtp, cfg)
    return GPTModel(
        config=cfg,
        transformer_layer_spec=_cpu.local_spec_norms(layer, cfg),
        **extra,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="rope",
    )


def tiny_hybrid(
    layer_pattern: str = TINY_HYBRID_PATTERN,
    config: TransformerConfig | None = None,
    *,
    vocab_size: int = TINY_VOCAB,
    max_sequence_length: int = TINY_SEQ_LEN,
    **config_overrides: Any,
) -> Any:
    """A Megatron-Core ``HybridModel`` (``MambaModel`` on megatron-core 0.16) of the tiny GPT's
    width, with the layers of ``layer_pattern`` from :func:`hybrid_local_stack_spec`.

    Call after ``parallel_state`` is initialised (in ``LightningModule.configure_model``); the
    layers are split evenly over the pipeline stages. ``config_overrides`` as for
    :func:`~lightning_mcore_ckpt.tiny.tiny_gpt_config` (``num_layers`` is the pattern's length).

    Example::

        model = tiny_hybrid("*-*-", hidden_dropout=0.0)
    """
    from megatron.core import parallel_state

    check_layer_pattern(layer_pattern)
    cfg = (
        config
        if config is not None
        else tiny_gpt_config(**{**config_overrides, "num_layers": len(layer_pattern)})
    )
    return _compat.hybrid_model(
        cfg,
        _cpu.local_spec_norms(hybrid_local_stack_spec(), cfg),
        layer_pattern,
        parallel_state.get_pipeline_model_parallel_world_size(),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="rope",
    )


class TokenDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``num_samples`` fixed random token sequences: ``(inputs, labels)`` shifted by one.

    Example::

        DataLoader(TokenDataset(64), batch_size=4, shuffle=True)
    """

    def __init__(self, num_samples: int, seq_len: int = TINY_SEQ_LEN, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, TINY_VOCAB, (num_samples, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.tokens[index]
        return row[:-1], row[1:]


OPTIMIZERS = ("adamw", "megatron", "distributed")
"""``TinyGPTModule(optimizer=...)``: torch AdamW; Megatron-Core's optimizer over Megatron DDP;
the same with Megatron's distributed optimizer (state sharded across data-parallel ranks)."""

_BF16: dict[str, Any] = {
    "bf16": True,
    "params_dtype": torch.bfloat16,
    "pipeline_dtype": torch.bfloat16,
}


def megatron_ddp(model: Any, *, distributed_optimizer: bool, bf16: bool = False) -> Any:
    """``model`` as Megatron-LM trains it: in ``Float16Module`` when its weights are bf16,
    inside Megatron-Core ``DistributedDataParallel`` (gradients in fp32 buffers, reduced over the
    data-parallel group; sharded with the distributed optimizer). Checkpoint keys do not change.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    if bf16:
        model = Float16Module(model.config, model)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer, grad_reduce_in_fp32=True
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def megatron_optimizer(
    model: Any, *, lr: float, weight_decay: float, distributed_optimizer: bool, bf16: bool = False
) -> Any:
    """Megatron-Core's Adam over the :func:`megatron_ddp` ``model`` (fp32 main parameters for
    bf16 weights; gradients clipped to norm 1)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=lr / 10,  # a decaying schedule's floor (OptimizerParamScheduler reads it)
        weight_decay=weight_decay,
        use_distributed_optimizer=distributed_optimizer,
        bf16=bf16,
        clip_grad=1.0,
    )
    return get_megatron_optimizer(config, [model])


def step_lr(optimizer: Any, step_size: int, gamma: float) -> Any:
    """``torch.optim.lr_scheduler.StepLR`` of a torch or Megatron-Core optimizer.

    A Megatron-Core optimizer is not a ``torch.optim.Optimizer``; its learning rates live in the
    parameter groups of the torch optimizers inside it (every inner optimizer's, for a
    ``ChainedOptimizer``), which its ``param_groups`` returns. The scheduler steps all of them and
    names the Megatron optimizer as its own, as Lightning expects of a scheduler returned with it
    (:func:`lightning_mcore_ckpt.training.schedules.torch_scheduler`).
    """
    from lightning_mcore_ckpt.training.schedules import torch_scheduler

    return torch_scheduler(
        optimizer, lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=step_size, gamma=gamma)
    )


def _datamodule_base() -> type:
    import lightning.pytorch as pl

    return pl.LightningDataModule


class TokenDataModule(_datamodule_base()):  # type: ignore[misc]
    """:class:`TokenDataset` batches from a resumable, shuffling ``StatefulDataLoader``.

    Example (a LightningCLI config)::

        data:
          class_path: lightning_mcore_ckpt.tiny.TokenDataModule
          init_args: {num_samples: 64, batch_size: 4}
    """

    def __init__(self, num_samples: int = 64, batch_size: int = 4, seed: int = 0) -> None:
        super().__init__()
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed

    def train_dataloader(self) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        generator = torch.Generator().manual_seed(self.seed)
        return StatefulDataLoader(
            TokenDataset(self.num_samples),
            batch_size=self.batch_size,
            shuffle=True,
            generator=generator,
        )


def _lightning_module_base() -> type:
    import lightning.pytorch as pl

    return pl.LightningModule


class TinyGPTModule(_lightning_module_base()):  # type: ignore[misc]
    """A LightningModule around :func:`tiny_gpt`: AdamW with a step LR schedule, dropout on.

    Records every training loss (``step_losses``) so that tests can compare runs bit for bit.
    ``transformer_config``: ``TransformerConfig`` fields set on the model, over the defaults
    (e.g. a mixture of experts: ``{"num_moe_experts": 4, "moe_router_topk": 2}``; see
    ``docs/moe.md``); a LightningCLI config sets it as a mapping under ``init_args``.
    With pipeline parallelism, each batch runs through
    :meth:`~lightning_mcore_ckpt.MegatronStrategy.forward_backward`, one micro-batch per sample.

    Example::

        trainer = L.Trainer(strategy=MegatronStrategy(tensor_model_parallel_size=2),
                            accelerator="cpu", devices=2, max_steps=10)
        trainer.fit(TinyGPTModule(), train_dataloaders=DataLoader(TokenDataset(64), batch_size=4))
    """

    def __init__(
        self,
        lr: float = 1e-3,
        dropout: float = 0.1,
        num_layers: int = 2,
        optimizer: str = "adamw",
        megatron_bf16: bool = False,
        transformer_config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"TinyGPTModule(optimizer={optimizer!r}): use one of {OPTIMIZERS}")
        if megatron_bf16 and optimizer == "adamw":
            raise ValueError(
                "TinyGPTModule(megatron_bf16=True) keeps fp32 main parameters in a Megatron-Core "
                "optimizer: pass optimizer='megatron' or 'distributed'"
            )
        self.save_hyperparameters()
        # Read from here, not hparams (a subclass's signature, as LightningCLI fills them).
        self.lr = lr
        self.dropout = dropout
        self.num_layers = num_layers
        self.optimizer_name = optimizer
        self.megatron_bf16 = megatron_bf16
        self.transformer_config = check_transformer_config(
            transformer_config, f"{type(self).__name__}(transformer_config=...)"
        )
        self.gpt: Any = None
        self.step_losses: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if self.gpt is not None:
            return
        strategy = self.trainer.strategy
        self.gpt = self._language_model(
            hidden_dropout=self.dropout,
            attention_dropout=self.dropout,
            num_layers=self.num_layers,
            sequence_parallel=getattr(strategy, "sequence_parallel", False),
            **(_BF16 if self.megatron_bf16 else {}),
            **self.transformer_config,
        )
        if self.optimizer_name != "adamw":
            self.gpt = megatron_ddp(
                self.gpt,
                distributed_optimizer=self.optimizer_name == "distributed",
                bf16=self.megatron_bf16,
            )

    def _language_model(self, **config: Any) -> Any:
        """The Megatron-Core model ``configure_model`` builds (``config``: TransformerConfig
        fields): :func:`tiny_gpt`."""
        return tiny_gpt(**config)

    def _net(self) -> Any:
        return self.gpt

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
        return self._net()(inputs, position_ids, None, labels=labels).mean()

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[batch, seq, vocab]`` (gathered over tensor parallelism)."""
        from megatron.core import tensor_parallel

        position_ids = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
        local = self._net()(inputs, position_ids, None)
        return tensor_parallel.gather_from_tensor_model_parallel_region(local)

    def _pipelined(self) -> bool:
        from megatron.core import parallel_state

        return bool(parallel_state.get_pipeline_model_parallel_world_size() > 1)

    def _forward_step(self, data: Any, model: Any) -> tuple[torch.Tensor, Any]:
        inputs, labels = next(data)
        position_ids = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
        output = model(inputs, position_ids, None, labels=labels)
        return output, lambda out: (out.mean(), {})

    def _pipeline_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], forward_only: bool
    ) -> torch.Tensor:
        # One micro-batch per sample through Megatron-Core's pipeline schedule.
        inputs, labels = batch
        loss: torch.Tensor = self.trainer.strategy.forward_backward(
            self._forward_step,
            iter(zip(inputs.split(1), labels.split(1), strict=True)),
            num_microbatches=inputs.shape[0],
            seq_length=inputs.shape[1],
            micro_batch_size=1,
            forward_only=forward_only,
        )
        return loss

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        loss = self._pipeline_step(batch, False) if self._pipelined() else self(*batch)
        self.step_losses.append(loss.detach().clone())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        loss = self._pipeline_step(batch, True) if self._pipelined() else self(*batch)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer: Any
        if self.optimizer_name == "adamw":
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        else:
            optimizer = megatron_optimizer(
                self.gpt,
                lr=self.lr,
                weight_decay=0.01,
                distributed_optimizer=self.optimizer_name == "distributed",
                bf16=self.megatron_bf16,
            )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": step_lr(optimizer, 2, 0.5), "interval": "step"},
        }


class TinyHybridModule(TinyGPTModule):
    """:class:`TinyGPTModule` training a Megatron-Core ``HybridModel`` (:func:`tiny_hybrid`):
    the layers of ``layer_pattern`` (``"*"`` attention, ``"-"`` MLP), Transformer-Engine-free.

    Megatron-Core 0.19 deprecates ``GPTModel`` in favour of ``HybridModel``; on megatron-core
    0.16 the same model is ``MambaModel``. The model is ``self.gpt``, as in the GPT module, so
    its checkpoint keys start with ``gpt.`` (``gpt.decoder.layers.<i>.``, one key per layer).
    The layers are split evenly over the pipeline stages: the pattern's length must divide by
    the pipeline-parallel size.

    Example::

        trainer.fit(TinyHybridModule(layer_pattern="*-*-"), train_dataloaders=loader)
    """

    def __init__(
        self,
        layer_pattern: str = TINY_HYBRID_PATTERN,
        lr: float = 1e-3,
        dropout: float = 0.1,
        optimizer: str = "adamw",
        megatron_bf16: bool = False,
        transformer_config: dict[str, Any] | None = None,
    ) -> None:
        check_layer_pattern(layer_pattern, "TinyHybridModule: layer_pattern")
        super().__init__(
            lr=lr,
            dropout=dropout,
            num_layers=len(layer_pattern),
            optimizer=optimizer,
            megatron_bf16=megatron_bf16,
            transformer_config=transformer_config,
        )
        self.layer_pattern = layer_pattern

    def _language_model(self, **config: Any) -> Any:
        config.pop("num_layers", None)  # the pattern's length
        return tiny_hybrid(self.layer_pattern, **config)


class HFGPTModule(TinyGPTModule):
    """:class:`TinyGPTModule` training the Megatron-Core GPT of a Hugging Face model's family.

    The model (``self.model``) is built from ``hf_model_path``'s config through mbridge, with
    random weights: start from the Hugging Face weights with
    ``MegatronStrategy(init_from=hf_model_path)``. ``transformer_config``: fields set over
    what the bridge maps from the Hugging Face config (e.g. the router's
    ``moe_router_load_balancing_type="aux_loss"``, which mbridge maps as ``"none"``). Its checkpoint keys start with ``model.``,
    the default prefix of ``lightning-mcore-ckpt import``.

    Example::

        trainer = L.Trainer(strategy=MegatronStrategy(init_from="hf_dir"), max_steps=10)
        trainer.fit(HFGPTModule("hf_dir"), train_dataloaders=loader)
    """

    def __init__(
        self,
        hf_model_path: str | os.PathLike[str],
        lr: float = 1e-3,
        dropout: float = 0.0,
        transformer_config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(lr=lr, dropout=dropout, transformer_config=transformer_config)
        self.save_hyperparameters()
        self.hf_model_path = hf_model_path
        self.model: Any = None

    def _net(self) -> Any:
        return self.model

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from lightning_mcore_ckpt.hf import HFBridge

        bridge = HFBridge(self.hf_model_path)
        config = bridge.transformer_config(
            hidden_dropout=self.dropout,
            attention_dropout=self.dropout,
            sequence_parallel=getattr(self.trainer.strategy, "sequence_parallel", False),
            **self.transformer_config,
        )
        self.model = bridge.gpt_model(config)
