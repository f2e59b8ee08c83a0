"""A tiny mixture of experts trained with Megatron-Core's distributed optimizer (run inside
each rank by the MoE resharding and missing-key tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

MOE = dict(family="qwen2_moe", hidden_size=32, intermediate_size=64, num_experts=4)
"""4 experts: 2 per process at EP=2."""
SAVED_STEPS = 2


def hf_source(tmp: str | Path) -> Path:
    """The tiny Qwen2-MoE the module's architecture is read from (written once per test)."""
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    path = Path(tmp, "src")
    return path if (path / "config.json").is_file() else tiny_hf_model(path, **MOE)


def moe_module(src: str | Path, *, expert_bias: bool = False) -> Any:
    """``HFGPTModule`` of ``src`` inside Megatron-Core DDP, trained by Megatron-Core's Adam with
    the distributed optimizer (a ``ChainedOptimizer`` of a dense and an expert optimizer at
    EP > 1, one optimizer at EP = 1). ``expert_bias``: the router keeps an ``expert_bias``
    buffer (sigmoid scores, as Megatron-Core requires for it)."""
    from lightning_mcore_ckpt.tiny import HFGPTModule, megatron_ddp, megatron_optimizer

    class MoEModule(HFGPTModule):  # type: ignore[misc]
        def configure_model(self) -> None:
            if self.model is not None:
                return
            from lightning_mcore_ckpt.hf import HFBridge

            bridge = HFBridge(self.hf_model_path)
            config = bridge.transformer_config(hidden_dropout=0.0, attention_dropout=0.0)
            if expert_bias:
                config.moe_router_score_function = "sigmoid"
                config.moe_router_enable_expert_bias = True
            self.model = megatron_ddp(bridge.gpt_model(config), distributed_optimizer=True)

        def configure_optimizers(self) -> Any:
            return megatron_optimizer(
                self.model, lr=1e-2, weight_decay=0.01, distributed_optimizer=True
            )

    return MoEModule(str(src), lr=1e-2)


def strategy(ep: int | str, sharding: str) -> Any:
    """``ep``: the expert-parallel size, or ``"tp2"``: tensor parallelism 2 (experts split by
    tensor, EP = 1), with the sequence parallelism Megatron-Core requires for MoE at TP > 1."""
    from lightning_mcore_ckpt import MegatronStrategy

    if ep == "tp2":
        return MegatronStrategy(
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            ckpt_optimizer_sharding=sharding,
        )
    return MegatronStrategy(expert_model_parallel_size=int(ep), ckpt_optimizer_sharding=sharding)


def train_and_save(
    rank: int, world_size: int, tmp: str, ep: int, sharding: str, expert_bias: bool = False
) -> dict[str, Any]:
    """Train ``SAVED_STEPS`` steps at ``ep`` on ``world_size`` processes and save the step
    ``tmp/global_step_<SAVED_STEPS>``; the gathered weights and optimizer state saved."""
    from _trainer import gathered_optimizer, gathered_weights, loader, make_trainer

    module = moe_module(hf_source(tmp), expert_bias=expert_bias)
    trainer = make_trainer(SAVED_STEPS, strategy(ep, sharding), world_size)
    trainer.fit(module, train_dataloaders=loader(16, 2, shuffle=True))
    saved = {
        "weights": gathered_weights(trainer),
        "optim": gathered_optimizer(trainer),
        "groups": optimizer_groups(trainer),
    }
    trainer.save_checkpoint(str(Path(tmp, f"global_step_{SAVED_STEPS}")))
    trainer.strategy.teardown()
    return saved


def live_tensors(trainer: Any) -> dict[str, torch.Tensor]:
    """Every tensor of this rank's model (parameters and buffers) and of its optimizers'
    state (Adam's moments and step, the distributed optimizer's main parameters), copied."""
    from megatron.core.optimizer import ChainedOptimizer

    module = trainer.strategy.lightning_module
    out = {
        f"module.{k}": v.detach().clone()
        for k, v in module.state_dict().items()
        if isinstance(v, torch.Tensor)
    }
    inner = []
    for opt in trainer.strategy._torch_optimizers():
        chained = opt.chained_optimizers if isinstance(opt, ChainedOptimizer) else [opt]
        inner.extend(getattr(o, "optimizer", o) for o in chained)  # a torch optimizer: itself
    for i, opt in enumerate(inner):
        for j, group in enumerate(opt.param_groups):
            for k, param in enumerate(group["params"]):
                out[f"optim{i}.group{j}.param{k}"] = param.detach().clone()
                for name, value in opt.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor):
                        out[f"optim{i}.group{j}.param{k}.{name}"] = value.detach().clone()
            out[f"optim{i}.group{j}.lr"] = torch.tensor(group["lr"])
    return out


def optimizer_groups(trainer: Any) -> dict[str, dict[str, Any]]:
    """What each parameter's group holds in the live distributed optimizer (its learning rate,
    betas, weight decay...) and Adam's ``step`` in its state, by the parameter's checkpoint
    key, gathered from every rank: the part of the optimizer state that is not a tensor of
    the parameter's shape."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    ssd = trainer.strategy.model_sharded_state_dict()
    keys = {
        id(sh.data): sh.key
        for sh in nested_values(ssd)
        if isinstance(getattr(sh, "data", None), torch.Tensor)
    }
    out: dict[str, dict[str, Any]] = {}
    for opt in trainer.strategy._torch_optimizers():
        chained = opt.chained_optimizers if isinstance(opt, ChainedOptimizer) else [opt]
        for inner in chained:
            for param, (index, order) in inner.model_param_group_index_map.items():
                group = inner.optimizer.param_groups[index]
                main = group["params"][order]
                out[keys[id(param)]] = {
                    "step": float(inner.optimizer.state[main]["step"]),
                    **{
                        k: v
                        for k, v in group.items()
                        if k != "params"
                        and k not in param_group_identifier_keys
                        and not k.startswith("pre_")
                    },
                }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    merged: dict[str, dict[str, Any]] = {}
    for part in gathered:
        merged.update(part)
    return merged


def resume(rank: int, world_size: int, tmp: str, ep: int | str, sharding: str) -> dict[str, Any]:
    """Resume the step of :func:`train_and_save` at ``ep`` on ``world_size`` processes and
    train one more step: what the load restored (gathered weights, optimizer tensors and
    groups, the step) and the losses after it."""
    import lightning.pytorch as pl
    from _trainer import gathered_optimizer, gathered_weights, loader, make_trainer

    seen: dict[str, Any] = {}

    class Capture(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            seen["weights"] = gathered_weights(trainer)
            seen["optim"] = gathered_optimizer(trainer)
            seen["groups"] = optimizer_groups(trainer)
            seen["start_step"] = trainer.global_step

    module = moe_module(hf_source(tmp))
    trainer = make_trainer(
        SAVED_STEPS + 1, strategy(ep, sharding), world_size, callbacks=[Capture()]
    )
    step = str(Path(tmp, f"global_step_{SAVED_STEPS}"))
    trainer.fit(module, train_dataloaders=loader(16, 2, shuffle=True), ckpt_path=step)
    seen["losses"] = [float(x) for x in module.step_losses]
    seen["end_step"] = trainer.global_step
    return seen


def refused_load(
    rank: int,
    world_size: int,
    tmp: str,
    step: str,
    ep: int | str,
    sharding: str,
    expert_bias: bool,
) -> dict[str, Any]:
    """Train a run at ``ep`` (so that its model and optimizer hold state), then load ``step``
    into it, which must fail: the error, and whether every live tensor is unchanged."""
    from _trainer import loader, make_trainer

    module = moe_module(hf_source(tmp), expert_bias=expert_bias)
    trainer = make_trainer(1, strategy(ep, sharding), world_size)
    trainer.fit(module, train_dataloaders=loader(8, 2))
    return load_refused(trainer, step)


def load_refused(trainer: Any, step: str) -> dict[str, Any]:
    """Load ``step`` into ``trainer``'s run (it has trained, so its model and optimizer hold
    state), which must fail: the error, and whether every live tensor is unchanged."""
    before = live_tensors(trainer)
    try:
        trainer.strategy.load_checkpoint(step)
    except ValueError as err:
        error = str(err)
    else:
        raise AssertionError(f"loading {step} did not fail")
    after = live_tensors(trainer)
    changed = sorted(k for k in before if k not in after or not torch.equal(before[k], after[k]))
    return {"error": error, "changed": changed, "tensors": len(before)}


def partial_load(rank: int, world_size: int, tmp: str, ep: int) -> dict[str, Any]:
    """Resume :func:`train_and_save`'s step (saved without an ``expert_bias``) into a model
    with one, ``strict_loading = False``: the weights loaded and the bias as initialised."""
    from _trainer import gathered_weights, loader, make_trainer

    module = moe_module(hf_source(tmp), expert_bias=True)
    module.strict_loading = False
    trainer = make_trainer(SAVED_STEPS, strategy(ep, "fully_reshardable"), world_size)
    step = str(Path(tmp, f"global_step_{SAVED_STEPS}"))
    # max_steps reached at the load: the loaded state, untrained.
    trainer.fit(module, train_dataloaders=loader(8, 2), ckpt_path=step)
    return {"weights": gathered_weights(trainer), "step": trainer.global_step}
