"""The fast tier's content check (``FastTier(check_finite=True)``): a rank state holding a NaN
or an infinity is never counted at save, and never resumed at recovery.

One node, 2 ranks, ``replicas=0``, a fast save at every step (the persistent tier's cadence
far off). Axes: where the NaN comes from (training made a weight NaN before a fast save; a
copy whose NaN was staged, hashed and sealed at save time, written by a run without the check)
x the check on or off (off: the NaN step counts and is resumed, which the check exists to
prevent). The next holder of a copy is the same code path as for a copy whose hash does not
match its seal (``tests/nodes/test_fast_tier.py``); here the next older step serves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.fast import files
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)


def _fit(
    rank: int,
    world_size: int,
    tmp: str,
    check: bool,
    max_steps: int,
    nan_at: int | None,
    resume: bool,
) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import FastTier, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    seen: dict[str, Any] = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            seen["start"] = trainer.global_step

        def on_train_batch_start(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
            if trainer.global_step == nan_at:  # after the fast save of step nan_at
                with torch.no_grad():
                    next(module.parameters()).view(-1)[0] = float("nan")

    fast = FastTier(
        f"{tmp}/fast", every_n_train_steps=1, replicas=0, max_to_keep=2, check_finite=check
    )
    # No persistent step (its cadence far off, none at the end): "last" is the fast tier's.
    checkpoint = MegatronCheckpoint(
        f"{tmp}/ckpt", every_n_train_steps=100, save_last=False, fast_tier=fast
    )
    trainer = make_trainer(
        max_steps,
        MegatronStrategy(),
        world_size,
        callbacks=[Probe(), checkpoint],
        enable_checkpointing=True,
    )
    trainer.fit(TinyGPTModule(), train_dataloaders=loader(64), ckpt_path="last" if resume else None)
    return seen


def _complete(tmp: Path) -> list[int]:
    root = tmp / "fast"
    return [s for s in files.steps(root) if files.is_complete(files.step_dir(root, s))]


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_a_fast_save_holding_a_nan_is_not_counted(tmp_path: Path, check: bool) -> None:
    run_distributed(_fit, 2, str(tmp_path), check, 5, 2, False)
    # Fast saves at steps 1-4 (the last step of a fit is not fast-saved). Step 2's state was
    # finite; steps 3 and 4 hold the NaN put into a weight after step 2.
    assert _complete(tmp_path) == ([1, 2] if check else [3, 4])
    if check:
        log = [json.loads(line) for line in (tmp_path / "ckpt" / "fast_tier.jsonl").open()]
        failed = [r for r in log if r.get("kind") == "fast_save" and r.get("step") == 3]
        assert failed and "non-finite values in" in json.dumps(failed[0]), failed


def _poison(step: Path, rank: int) -> None:
    """Put a NaN into rank ``rank``'s state file of ``step`` and seal it again, as a save that
    staged the NaN would have: its bytes match their digest."""
    import torch

    from lightning_mcore_ckpt.format import integrity

    state_name, extra_name = files.files_of(rank)
    payload = torch.load(step / state_name, weights_only=False)
    tensors = [v for v in _walk(payload) if torch.is_tensor(v) and v.is_floating_point()]
    tensors[0].view(-1)[0] = float("nan")
    torch.save(payload, step / state_name)
    seal = files.read_seal(step, rank)
    assert seal is not None
    sealed = {
        name: ((step / name).stat().st_size, integrity.hash_file(step / name))
        for name in (state_name, extra_name)
    }
    files.write_seal(step, rank, seal["world_size"], sealed, seal["parallel_layout"])
    assert files.verify(step, rank) is None  # whole and "unchanged": only its values are bad


def _walk(value: Any) -> Any:
    if isinstance(value, dict):
        for item in value.values():
            yield from _walk(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _walk(item)
    else:
        yield value


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_a_sealed_copy_holding_a_nan_is_passed_over_for_the_older_step(
    tmp_path: Path, check: bool
) -> None:
    run_distributed(_fit, 2, str(tmp_path), False, 5, None, False)
    assert _complete(tmp_path) == [3, 4]
    _poison(files.step_dir(tmp_path / "fast", 4), 1)
    resumed = run_distributed(_fit, 2, str(tmp_path), check, 6, None, True)
    assert [r["start"] for r in resumed] == ([3, 3] if check else [4, 4])
    if check:
        log = [json.loads(line) for line in (tmp_path / "ckpt" / "fast_tier.jsonl").open()]
        (recovery,) = [r for r in log if r.get("kind") == "recovery"]
        assert "non-finite values in" in json.dumps(recovery), recovery
