"""Jobs for the resume check: a tiny GPT configurable along every axis of the matrix.

``build(**cell)`` (bound with ``functools.partial``) returns a :class:`ResumeJob`; it runs on
every rank of every run of :func:`check_resume`.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_mcore_ckpt.tiny import TinyGPTModule, TinyHybridModule, TokenDataset, step_lr

BATCH = 2


class JobModule(TinyGPTModule):
    """TinyGPTModule with the matrix's optimizer, scheduler and frozen-parameter options.

    ``unsaved_state``: the loss is scaled by a count of training steps kept in an attribute that
    no checkpoint holds (the user-side mistake the resume check is meant to find).
    """

    def __init__(
        self,
        frozen: str = "none",
        scheduler: str = "step",
        unsaved_state: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.frozen = frozen
        self.scheduler_interval = scheduler
        self.unsaved_state = unsaved_state
        self.calls = 0
        self.adapter: Any = None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        if self.unsaved_state:
            self.calls += 1
            loss = loss * (1.0 + 0.01 * self.calls)
        return loss

    def configure_model(self) -> None:
        super().configure_model()
        if self.frozen == "none" or self.adapter is not None:
            return
        if self.frozen in ("all_params", "trainable_only"):
            # The input embedding and the attention of the first transformer layer (the first
            # pipeline stage holds both, and keeps its MLP training). Megatron-Core stores the
            # layers as one stacked tensor, so the layer stack is then partly frozen: layer 0's
            # attention frozen, layer 1's training.
            embedding = getattr(self.gpt, "embedding", None)
            if embedding is not None:
                embedding.word_embeddings.weight.requires_grad_(False)
                for p in self.gpt.decoder.layers[0].self_attention.parameters():
                    p.requires_grad_(False)
        elif self.frozen == "lora":
            for p in self.gpt.parameters():
                p.requires_grad_(False)
            hidden = self.gpt.config.hidden_size
            # A LoRA-style low-rank update of the output, the only trainable weights. One
            # logical parameter, replicated: the same initial values on every rank.
            g = torch.Generator().manual_seed(7)
            self.adapter = torch.nn.ParameterDict(
                {
                    "a": torch.nn.Parameter(torch.randn(hidden, 2, generator=g) * 0.02),
                    "b": torch.nn.Parameter(torch.zeros(2, hidden)),
                }
            )

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = super().forward(inputs, labels)
        if self.adapter is not None:
            loss = (
                loss
                + (self.adapter["a"] @ self.adapter["b"]).pow(2).sum()
                + 0.1 * (self.adapter["a"].sum() * self.adapter["b"].sum())
            )
        return loss

    def configure_optimizers(self) -> Any:
        if self.frozen in ("trainable_only", "lora"):
            params = [p for p in self.parameters() if p.requires_grad]
        else:
            params = list(self.parameters())
        optimizer: Any
        if self.hparams.optimizer == "adamw":
            optimizer = torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=0.01)
        else:
            # Megatron DDP holds only the trainable parameters: "trainable_only" is implied.
            optimizer = super().configure_optimizers()["optimizer"]
        if self.scheduler_interval == "warmup_cosine":
            return {
                "optimizer": optimizer,
                "lr_scheduler": {
                    "scheduler": _warmup_cosine(optimizer, self.lr),
                    "interval": "step",
                },
            }
        step_size = 2 if self.scheduler_interval == "step" else 1
        scheduler = step_lr(optimizer, step_size=step_size, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": self.scheduler_interval},
        }


def _warmup_cosine(optimizer: Any, lr: float) -> Any:
    """Megatron-Core's OptimizerParamScheduler over every inner optimizer: 2 steps of linear
    warmup, then cosine decay to a tenth, and weight decay growing linearly (a Megatron-LM
    user's schedule)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from lightning_mcore_ckpt.training.schedules import MegatronParamScheduler

    schedule = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=lr,
        min_lr=lr / 10,
        lr_warmup_steps=2,
        lr_decay_steps=8,
        lr_decay_style="cosine",
        start_wd=0.0,
        end_wd=0.02,
        wd_incr_steps=8,
        wd_incr_style="linear",
    )
    return MegatronParamScheduler(schedule)


class HybridJobModule(JobModule, TinyHybridModule):  # type: ignore[misc]
    """The same job training Megatron-Core's HybridModel (attention and MLP layers, ``"*-*-"``)."""


MODELS = {"gpt": JobModule, "hybrid": HybridJobModule}

MOE = {
    "num_moe_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 64,
    "moe_token_dispatcher_type": "alltoall",
    # As MoE models are published (Qwen, DeepSeek, Mixtral); Megatron-Core also builds
    # expert-tensor-parallel and shared experts without biases only.
    "add_bias_linear": False,
}
"""A mixture of experts in every layer: 4 experts, 2 routed per token."""

ROUTERS: dict[str, dict[str, Any]] = {
    # The auxiliary load-balancing loss (added to the router's gradient by Megatron-Core).
    "aux_loss": {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 1e-2},
    # Aux-loss-free balancing: an fp32 expert_bias buffer, updated after each global batch
    # outside the optimizer (Megatron-Core accepts it with the sigmoid score function only).
    "expert_bias": {
        "moe_router_enable_expert_bias": True,
        "moe_router_score_function": "sigmoid",
        "moe_router_load_balancing_type": "none",
        "moe_router_bias_update_rate": 1e-2,
    },
    # A shared expert beside the routed ones (Megatron-Core builds it without biases).
    "shared_expert": {
        "moe_shared_expert_intermediate_size": 64,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": 1e-2,
    },
    # Token dropping: each expert takes at most its capacity, the lowest-probability tokens
    # are dropped.
    "capacity": {
        "moe_expert_capacity_factor": 1.0,
        "moe_token_drop_policy": "probs",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": 1e-2,
    },
    # A multi-token-prediction layer (DeepSeek-V3's): predicts the token after next from the
    # last layer's output; Megatron-Core adds its loss to the main one.
    "mtp": {
        "mtp_num_layers": 1,
        "mtp_loss_scaling_factor": 0.1,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": 1e-2,
    },
}
"""The router features users turn on, each as ``TransformerConfig`` fields."""


def _strategy_class(broken: str) -> Any:
    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.training.optim import init_state

    class BrokenRestore(MegatronStrategy):
        """Restores a checkpoint with one piece deliberately left out."""

        def _load_extra(self, directory: Any, **kwargs: Any) -> dict[str, Any]:
            state = super()._load_extra(directory, **kwargs)
            if broken == "rng":
                torch.manual_seed(12345)
                self._rng_at_load = None
            if broken == "off_by_one":
                optim = state["loops"]["fit_loop"][
                    "epoch_loop.automatic_optimization.optim_progress"
                ]
                optim["optimizer"]["step"]["total"]["completed"] -= 1
            if broken == "dataloader":
                state["loops"]["fit_loop"]["state_dict"]["combined_loader"] = []
            return state

        def _load_optimizers(self, directory: Any, **kwargs: Any) -> None:
            if broken == "optimizer":
                for opt in self._torch_optimizers():
                    init_state(opt)
                return
            super()._load_optimizers(directory, **kwargs)

    return MegatronStrategy if broken == "none" else BrokenRestore


def _loader(kind: str, num_samples: int, clock_seed: bool = False) -> Any:
    from torch.utils.data import DataLoader
    from torchdata.stateful_dataloader import StatefulDataLoader

    dataset = TokenDataset(num_samples)
    # Without a generator of its own, the shuffle is drawn from the global (seeded) RNG.
    generator = None if clock_seed else torch.Generator().manual_seed(1)
    if kind == "plain":
        # As users write it: its shuffle comes from the global RNG, which checkpoints hold.
        return DataLoader(dataset, batch_size=BATCH, shuffle=True)
    workers = 2 if kind == "stateful2" else 0
    return StatefulDataLoader(
        dataset, batch_size=BATCH, shuffle=True, generator=generator, num_workers=workers
    )


class _SlowBatches(pl.Callback):
    """Makes every training batch last at least ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.monotonic()

    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(max(0.0, self.seconds - (time.monotonic() - self._start)))


def build(
    layout: str = "dp2",
    cadence: str = "steps",
    accumulate: int = 1,
    frozen: str = "none",
    async_save: bool = False,
    data: str = "stateful0",
    scheduler: str = "step",
    precision: str = "32",
    optimizer: str = "adamw",
    optimizer_sharding: str = "dp_reshardable",
    accelerator: str = "cpu",
    steps_per_epoch: int = 4,
    every: int = 2,
    broken: str = "none",
    unsaved_state: bool = False,
    clock_seed: bool = False,
    model: str = "gpt",
    ep: int = 1,
    etp: int | None = None,
    router: str | None = None,
    sequence_parallel: bool = False,
    fast_tier: bool = False,
) -> Any:
    """The matrix's job. ``fast_tier``: the checkpoint callback also saves a fast step after
    every step (one node: the node's own copies), and its persistent cadence (``"steps"``) is
    moved past the run's end, so that a resume can only come from the fast tier."""
    import tempfile

    from lightning_mcore_ckpt import FastTier, MegatronCheckpoint, ResumeJob

    # A job seeded from the clock seeds everything from it, the strategy's seed (Megatron's RNG
    # tracker: the initial weights, dropout) too: its runs differ from the first batch on, not
    # only where two clock-seeded shuffles happen to differ (the first batches of 8 samples
    # coincide once in 56 runs).
    clock = time.time_ns() % 2**31
    pl.seed_everything(clock if clock_seed else 0, verbose=False)
    world = 1 if layout == "1" else 2
    tp = 2 if layout == "tp2" else 1
    pp = 2 if layout == "pp2" else 1
    # MoE with tensor parallelism needs sequence parallelism (Megatron-Core refuses it otherwise).
    sequence_parallel = sequence_parallel or (router is not None and tp > 1)
    dp = world // (tp * pp)
    num_samples = steps_per_epoch * accumulate * BATCH * dp
    callback_kwargs: dict[str, Any] = {}
    callbacks: list[Any] = []
    trainer_kwargs: dict[str, Any] = {}
    if cadence == "steps":
        callback_kwargs["every_n_train_steps"] = every
    elif cadence == "epochs":
        callback_kwargs["every_n_epochs"] = 1
    elif cadence == "epochs_train_end":
        # With validation, which would otherwise move the save to validation end.
        callback_kwargs.update(every_n_epochs=1, save_on_train_epoch_end=True)
        trainer_kwargs.update(limit_val_batches=2, check_val_every_n_epoch=1)
    elif cadence == "time":
        # Every batch outlasts the interval, so the time cadence fires at every optimizer step
        # whatever the machine's speed (a step that ran faster than the interval would leave
        # nothing saved before the interruption).
        callback_kwargs["train_time_interval"] = datetime.timedelta(seconds=0.2)
        callbacks.append(_SlowBatches(0.25))
    elif cadence == "topk":
        callback_kwargs.update(monitor="val_loss", save_top_k=2, every_n_epochs=1)
        trainer_kwargs.update(limit_val_batches=2, check_val_every_n_epoch=1)
    else:
        raise ValueError(cadence)
    if fast_tier:
        if cadence != "steps":
            raise ValueError(f"fast_tier with cadence {cadence!r}: the fast tier saves by steps")
        callback_kwargs.update(
            every_n_train_steps=1000,
            save_last=False,
            # check_resume points it at each run's node-local directory before fit.
            fast_tier=FastTier(
                f"{tempfile.gettempdir()}/lmc-job-fast-placeholder",
                every_n_train_steps=1,
                replicas=0,
            ),
        )
    if optimizer == "distributed_full":  # the distributed optimizer, saved fully reshardable
        optimizer, optimizer_sharding = "distributed", "fully_reshardable"
    strategy = _strategy_class(broken)(
        seed=clock if clock_seed else 1234,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=sequence_parallel,
        ckpt_async_save=async_save,
        ckpt_optimizer_sharding=optimizer_sharding,
    )
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator=accelerator,
        devices=world,
        max_steps=100,
        accumulate_grad_batches=accumulate,
        precision="32" if precision == "megatron-bf16" else precision,
        # check_resume points the callback at each run's own directory before fit: this
        # placeholder, outside the checkout, is never written.
        callbacks=[
            *callbacks,
            MegatronCheckpoint(f"{tempfile.gettempdir()}/lmc-job-placeholder", **callback_kwargs),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    module = MODELS[model](
        frozen=frozen,
        scheduler=scheduler,
        unsaved_state=unsaved_state,
        dropout=0.1,
        optimizer=optimizer,
        megatron_bf16=precision == "megatron-bf16",
        transformer_config=None if router is None else {**MOE, **ROUTERS[router]},
    )
    val = _loader("stateful0", 4) if "limit_val_batches" in trainer_kwargs else None
    if data == "datamodule":
        from lightning_mcore_ckpt.tiny import TokenDataModule

        class DataModule(TokenDataModule):  # type: ignore[misc]
            def val_dataloader(self) -> Any:
                return val if val is not None else []

        dm = DataModule(num_samples=num_samples, batch_size=BATCH, seed=1)
        return ResumeJob(trainer, module, datamodule=dm)
    return ResumeJob(
        trainer,
        module,
        train_dataloaders=_loader(data, num_samples, clock_seed),
        val_dataloaders=val,
    )
