"""Frozen and never-stepped parameters: a run stopped at step k resumes bit-identically.

Fine-tuning often freezes part of the model and still hands *every* parameter to the optimizer:
the frozen ones (and trainable ones that never receive a gradient, such as an unused adapter)
simply get no optimizer state. The checkpoint holds state for exactly the parameters that have
it, and a resume must recreate state for exactly those. Each case compares an uninterrupted run
with a run stopped at step ``STOP_AT`` and resumed by a new Trainer from ``ckpt_path="last"``:
per-step losses, gathered weights and gathered optimizer state are bit-identical, every rank's
per-parameter state (``step`` included) matches, and the frozen parameters never change.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

BATCH = 2
STOP_AT = 3
TOTAL = 6
LORA_RANK = 4


def _module(mode: str, all_params: bool) -> Any:
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    class Module(TinyGPTModule):  # type: ignore[misc]
        """``"embedding"``: the input embedding is frozen. ``"lora"``: the whole GPT is frozen
        and a low-rank adapter on the embedding output trains; a second adapter is trainable
        but never used, so it never receives a gradient."""

        def configure_model(self) -> None:
            if self.gpt is not None:
                return
            super().configure_model()
            gpt: Any = self.gpt
            if mode == "embedding":
                gpt.embedding.word_embeddings.weight.requires_grad_(False)
                return
            gpt.requires_grad_(False)
            hidden = gpt.config.hidden_size
            g = torch.Generator().manual_seed(1)
            self.lora_a = torch.nn.Parameter(torch.randn(hidden, LORA_RANK, generator=g) * 0.1)
            self.lora_b = torch.nn.Parameter(torch.zeros(LORA_RANK, hidden))
            self.unused_adapter = torch.nn.Parameter(torch.zeros(LORA_RANK))
            gpt.embedding.register_forward_hook(
                lambda _m, _i, out: out + out @ self.lora_a @ self.lora_b
            )

        def on_train_start(self) -> None:
            self.frozen_at_start = {
                n: p.detach().clone() for n, p in self.named_parameters() if not p.requires_grad
            }

        def configure_optimizers(self) -> Any:
            params = [p for p in self.parameters() if all_params or p.requires_grad]
            optimizer = torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=0.01)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
            }

    return Module(dropout=0.1)


def _loader(dp: int) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_mcore_ckpt import ElasticSampler
    from lightning_mcore_ckpt.tiny import TokenDataset

    dataset = TokenDataset(TOTAL * BATCH * dp)
    torch.manual_seed(0)
    if dp == 1:
        return StatefulDataLoader(dataset, batch_size=BATCH, shuffle=True)
    sampler = functools.partial(ElasticSampler, micro_batch_size=BATCH)
    return StatefulDataLoader(dataset, batch_size=BATCH, sampler=sampler(dataset))


def _run(
    world_size: int, tp: int, mode: str, all_params: bool, dirpath: str, steps: int, ckpt: Any
) -> tuple[Any, Any]:
    from _trainer import make_trainer

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy

    module = _module(mode, all_params)
    trainer = make_trainer(
        steps,
        MegatronStrategy(tensor_model_parallel_size=tp),
        world_size,
        callbacks=[MegatronCheckpoint(dirpath, every_n_train_steps=STOP_AT)],
        enable_checkpointing=True,
    )
    trainer.fit(module, train_dataloaders=_loader(world_size // tp), ckpt_path=ckpt)
    return module, trainer


def _local_state(module: Any, trainer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's per-parameter optimizer state, by parameter name."""
    state = trainer.optimizers[0].state
    return {
        name: {k: torch.as_tensor(v).clone() for k, v in state[p].items()}
        for name, p in module.named_parameters()
        if p in state
    }


def _frozen_resume(
    rank: int, world_size: int, tmp: str, tp: int, mode: str, all_params: bool
) -> dict[str, object]:
    from _trainer import gathered_optimizer, gathered_weights

    run = functools.partial(_run, world_size, tp, mode, all_params)
    full, full_trainer = run(f"{tmp}/full", TOTAL, None)
    _, stopped = run(f"{tmp}/run", STOP_AT, None)
    resumed, resumed_trainer = run(f"{tmp}/run", TOTAL, "last")
    frozen = [n for n, p in full.named_parameters() if not p.requires_grad]
    return {
        "stopped_step": stopped.global_step,
        "full": full.step_losses,
        "resumed": resumed.step_losses,
        "full_weights": gathered_weights(full_trainer),
        "resumed_weights": gathered_weights(resumed_trainer),
        "full_optim": gathered_optimizer(full_trainer),
        "resumed_optim": gathered_optimizer(resumed_trainer),
        "full_state": _local_state(full, full_trainer),
        "resumed_state": _local_state(resumed, resumed_trainer),
        "frozen": frozen,
        "frozen_unchanged": all(
            torch.equal(p, full.frozen_at_start[n])
            for n, p in full.named_parameters()
            if n in frozen
        ),
        "trainable": [n for n, p in full.named_parameters() if p.requires_grad],
    }


@pytest.mark.parametrize(
    ("mode", "all_params", "world_size", "tp"),
    [
        ("embedding", True, 2, 2),
        ("embedding", False, 2, 1),
        ("lora", True, 2, 1),
        ("lora", False, 2, 2),
    ],
    ids=[
        "frozen-embedding-all-params-tp2",
        "frozen-embedding-trainable-only-dp2",
        "lora-all-params-dp2",
        "lora-trainable-only-tp2",
    ],
)
def test_frozen_params_resume_bit_identically(
    tmp_path: Path, mode: str, all_params: bool, world_size: int, tp: int
) -> None:
    results = run_distributed(
        _frozen_resume, world_size, str(tmp_path), tp, mode, all_params, timeout=280
    )
    for r in results:
        assert r["stopped_step"] == STOP_AT
        assert r["frozen"], "the case freezes nothing"
        assert r["frozen_unchanged"]
        assert len(r["resumed"]) == TOTAL - STOP_AT
        for step, (a, b) in enumerate(zip(r["resumed"], r["full"][STOP_AT:], strict=True)):
            assert torch.equal(a, b), f"loss differs at step {STOP_AT + step + 1}"
        assert r["full_weights"].keys() == r["resumed_weights"].keys()
        for key, tensor in r["full_weights"].items():
            assert torch.equal(tensor, r["resumed_weights"][key]), key
        assert r["full_optim"], "no optimizer state was gathered"
        assert r["full_optim"].keys() == r["resumed_optim"].keys()
        for key, tensor in r["full_optim"].items():
            assert torch.equal(tensor, r["resumed_optim"][key]), key
        # Exactly the parameters that were stepped have state, on every rank, step included.
        stepped = [n for n in r["trainable"] if n != "unused_adapter"]
        assert sorted(r["full_state"]) == sorted(stepped)
        assert r["resumed_state"].keys() == r["full_state"].keys()
        for name, state in r["full_state"].items():
            assert state.keys() == r["resumed_state"][name].keys(), name
            for k, value in state.items():
                assert torch.equal(value, r["resumed_state"][name][k]), f"{name}.{k}"
