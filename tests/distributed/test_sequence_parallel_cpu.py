"""Sequence parallelism trains on CPU, so a mixture of experts trains with tensor parallelism.

Megatron-Core trains MoE layers at TP > 1 only with sequence parallelism, which the local layer
spec's torch norm refused; the CPU runtime's norm (``_cpu.local_spec_norms``) allows it and marks
its parameters ``sequence_parallel``, so their gradients are summed over the TP group.

Axes:

- model: a dense tiny GPT (TP=2) | the same as a ``HybridModel`` | a tiny Qwen2-MoE from Hugging Face weights (TP=2, EP=2,
  expert TP=1: 4 experts, 2 per process);
- sequence parallelism: off | on (the dense model: the same losses either way);
- gradient sync: the strategy's (AdamW) | Megatron DDP's ``finalize_model_grads`` (Megatron's
  optimizer);
- run: uninterrupted | stopped at a step and resumed from "last" (the MoE model: bit-identical);
- refused: an MoE model at TP=2 without sequence parallelism, at setup, before any step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt.testing import DistributedFailure, run_distributed

pytestmark = pytest.mark.timeout(600)

STEPS = 4
STOP_AT = 2
MOE: dict[str, Any] = dict(family="qwen2_moe", hidden_size=32, intermediate_size=256, num_experts=4)
LOSS_RTOL = 1e-5
"""Sequence parallelism sums the norms' gradients over TP ranks in another order than one rank
sums them over the whole sequence: the losses agree to float32 rounding, not bit for bit."""


def _sequence_parallel_params(module: Any) -> dict[str, torch.Tensor]:
    return {
        name: p.detach().clone()
        for name, p in module.named_parameters()
        if getattr(p, "sequence_parallel", False)
    }


def _dense(rank: int, world_size: int, model: str, optimizer: str) -> dict[str, Any]:
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule, TinyHybridModule

    out: dict[str, Any] = {}
    for sequence_parallel in (False, True):
        module_class = TinyHybridModule if model == "hybrid" else TinyGPTModule
        module = module_class(dropout=0.0, optimizer=optimizer)
        strategy = MegatronStrategy(
            tensor_model_parallel_size=2, sequence_parallel=sequence_parallel
        )
        trainer = make_trainer(STEPS, strategy, world_size)
        trainer.fit(module, train_dataloaders=loader(STEPS * 2, 2))
        out["on" if sequence_parallel else "off"] = {
            "losses": [float(loss) for loss in module.step_losses],
            "norms": _sequence_parallel_params(module),
        }
    return out


@pytest.mark.parametrize(
    ("model", "optimizer"),
    [("gpt", "adamw"), ("gpt", "megatron"), ("hybrid", "adamw")],
    ids=["gpt-adamw", "gpt-megatron_ddp", "hybrid-adamw"],
)
def test_dense_tp2_trains_with_sequence_parallelism_as_without(model: str, optimizer: str) -> None:
    ranks = run_distributed(_dense, 2, model, optimizer, timeout=540)
    off, on = ranks[0]["off"], ranks[0]["on"]

    assert len(on["losses"]) == STEPS
    torch.testing.assert_close(on["losses"], off["losses"], rtol=LOSS_RTOL, atol=0)
    assert on["losses"][-1] < on["losses"][0]  # it trained
    # Every layer norm (the final one too) is sequence-parallel, only with sequence parallelism.
    assert not off["norms"]
    names = sorted(on["norms"])
    assert any(".final_" in n for n in names), names
    assert sum("input_layernorm" in n for n in names) == 2 * 2, names  # weight, bias per layer
    # Each TP rank saw half of the sequence: only their gradients summed over TP keep the norms
    # identical on both ranks.
    for name, weight in on["norms"].items():
        assert torch.equal(weight, ranks[1]["on"]["norms"][name]), name


def _moe_run(
    world_size: int, src: str, dirpath: str, max_steps: int, ckpt_path: str | None
) -> dict[str, Any]:
    from _trainer import gathered_weights, loader, make_trainer

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import HFGPTModule

    strategy = MegatronStrategy(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
        init_from=src,
    )
    trainer = make_trainer(
        max_steps,
        strategy,
        world_size,
        callbacks=[MegatronCheckpoint(dirpath, every_n_train_steps=STOP_AT)],
        enable_checkpointing=True,
    )
    module = HFGPTModule(src, lr=1e-2)
    torch.manual_seed(0)  # the shuffling sampler's seed, alike in every run
    trainer.fit(module, train_dataloaders=loader(16, 2, shuffle=True), ckpt_path=ckpt_path)
    return {
        "losses": [float(loss) for loss in module.step_losses],
        "weights": gathered_weights(trainer),
    }


def _moe_resume(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    src = str(Path(tmp, "src"))
    full = _moe_run(world_size, src, f"{tmp}/full", STEPS, None)
    stopped = _moe_run(world_size, src, f"{tmp}/run", STOP_AT, "last")
    resumed = _moe_run(world_size, src, f"{tmp}/run", STEPS, "last")
    return {"full": full, "stopped": stopped, "resumed": resumed}


def test_moe_tp2_ep2_with_sequence_parallelism_trains_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    tiny_hf_model(tmp_path / "src", **MOE)
    ranks = run_distributed(_moe_resume, 2, str(tmp_path), timeout=540)
    run = ranks[0]

    full, stopped, resumed = run["full"], run["stopped"], run["resumed"]
    assert len(full["losses"]) == STEPS
    assert all(torch.isfinite(torch.tensor(full["losses"])))
    # It trained: the weights moved from the Hugging Face ones the stopped run started from.
    assert any(not torch.equal(w, full["weights"][k]) for k, w in stopped["weights"].items())
    assert stopped["losses"] == full["losses"][:STOP_AT]
    assert resumed["losses"] == full["losses"][STOP_AT:]  # bit for bit
    assert resumed["weights"].keys() == full["weights"].keys()
    for key, weight in full["weights"].items():
        assert torch.equal(resumed["weights"][key], weight), key


def _moe_without_sequence_parallelism(rank: int, world_size: int, src: str) -> None:
    import lightning.pytorch as pl
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import HFGPTModule

    class NoStep(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            raise AssertionError("a training step started")

    strategy = MegatronStrategy(
        tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1
    )
    trainer = make_trainer(STEPS, strategy, world_size, callbacks=[NoStep()])
    trainer.fit(HFGPTModule(src), train_dataloaders=loader(8, 2))


def test_moe_tp2_without_sequence_parallelism_is_refused_at_setup(tmp_path: Path) -> None:
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    src = tiny_hf_model(tmp_path / "src", **MOE)
    with pytest.raises(DistributedFailure) as failure:
        run_distributed(_moe_without_sequence_parallelism, 2, str(src), timeout=300)
    message = str(failure.value)
    assert "num_moe_experts=4" in message
    assert "MegatronStrategy(sequence_parallel=True)" in message
    assert "a training step started" not in message


def _qk_norms(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    module = TinyGPTModule(dropout=0.0, transformer_config={"qk_layernorm": True})
    trainer = make_trainer(3, MegatronStrategy(tensor_model_parallel_size=2), world_size)
    trainer.fit(module, train_dataloaders=loader(6, 2))
    return {
        name: p.detach().clone()
        for name, p in module.named_parameters()
        if "q_layernorm" in name or "k_layernorm" in name
    }


def test_query_and_key_norms_stay_identical_on_every_tp_rank_with_a_torch_optimizer() -> None:
    # qk_layernorm (Qwen3's): each TP rank's gradient of the query/key norms covers only its
    # heads; summed over TP, as Megatron-Core's finalize_model_grads does, they stay equal.
    ranks = run_distributed(_qk_norms, 2, timeout=300)
    assert len(ranks[0]) == 2 * 2 * 2, sorted(ranks[0])  # q and k norms, weight and bias, 2 layers
    for name, weight in ranks[0].items():
        assert torch.equal(weight, ranks[1][name]), name
