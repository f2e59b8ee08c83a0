"""Promise 14: loading a checkpoint you did not write runs no code from it.

Real Trainer runs through MegatronStrategy: a step is saved, a file of it is crafted to run
``touch <marker>`` when unpickled (as an attacker would make it), and ``fit(ckpt_path=step)``
must refuse it on every rank, naming the file, before anything of it is unpickled. Only
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (the user trusting the checkpoint) loads it, and only
then does it run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt import _compat
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

STEPS = 2
"""The last step saved (each step up to it is); a resume from it trains to twice that."""


@dataclasses.dataclass
class TrainConfig:
    """A hyperparameter type of the user's (not on torch's allowlist)."""

    warmup: int = 10


def _fit(world_size: int, tmp: str, ckpt_path: str | None = None, **options: Any) -> Any:
    """Train to ``STEPS`` saving every step on the way, or resume from ``ckpt_path``.

    ``options``: ``module`` (the LightningModule), ``weights_only`` (passed to ``fit``),
    ``async_save`` (the strategy's ``ckpt_async_save``).
    """
    import lightning.pytorch as pl
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    class Save(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            if ckpt_path is None:
                trainer.save_checkpoint(str(Path(tmp, f"global_step_{trainer.global_step}")))

    module = options.get("module") or TinyGPTModule(dropout=0.1)
    steps = 2 * STEPS if ckpt_path else STEPS
    strategy = MegatronStrategy(ckpt_async_save=options.get("async_save", False))
    trainer = make_trainer(steps, strategy, world_size, callbacks=[Save()])
    trainer.fit(
        module,
        train_dataloaders=loader(4 * STEPS * world_size, 2),
        ckpt_path=ckpt_path,
        weights_only=options.get("weights_only"),
    )
    return trainer


@contextlib.contextmanager
def _trusted_by_user() -> Iterator[None]:
    """Meanwhile, the user trusts every checkpoint as a whole. Lightning 2.6 does not pass
    fit's weights_only to a strategy that restores after setup: torch's own switch is the one
    that reaches the load."""
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        del os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"]


def _warnings() -> list[str]:
    """Collects this package's warnings (the test reads them from the rank's return value)."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logging.getLogger("lightning_mcore_ckpt").addHandler(handler)
    return seen


def _crafted_extra_file(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from _crafted import globals_in, relist, touching

    from lightning_mcore_ckpt.safety.safe_load import UnsafeCheckpointError

    step, marker = Path(tmp, f"global_step_{STEPS}"), Path(tmp, "ran")
    _fit(world_size, tmp)
    dist.barrier()
    written = {}
    if rank == 0:
        for path in sorted((step / "extra").glob("rank_*.pt")):
            payload = torch.load(path, weights_only=True)
            written[path.name] = (payload["version"], sorted(globals_in(path)))
        target = step / "extra" / "rank_00001.pt"
        payload = torch.load(target, weights_only=True)
        payload["lightning"]["crafted"] = touching(marker)
        torch.save(payload, target)
        relist(step)
    dist.barrier()
    refused = {}
    for weights_only in (None, True):
        try:
            _fit(world_size, tmp, str(step), weights_only=weights_only)
        except UnsafeCheckpointError as err:
            refused[str(weights_only)] = str(err)
    dist.barrier()
    ran_before_trusting = marker.exists()
    with _trusted_by_user():
        trainer = _fit(world_size, tmp, str(step))
    dist.barrier()
    return {
        "written": written,
        "refused": refused,
        "ran_before_trusting": ran_before_trusting,
        "ran_when_trusted": marker.exists(),
        "trusted_reached": trainer.global_step,
    }


def test_a_crafted_extra_file_is_refused_on_every_rank_and_runs_nothing(tmp_path: Path) -> None:
    results = run_distributed(_crafted_extra_file, 2, str(tmp_path), timeout=280)
    written = results[0]["written"]
    assert sorted(written) == ["rank_00000.pt", "rank_00001.pt"]
    for version, found in written.values():
        # Format 2: our own state needs nothing beyond torch's allowlist (no NumPy).
        assert version == 2 and not [g for g in found if g.startswith("numpy")], found
    for rank, result in enumerate(results):
        assert sorted(result["refused"]) == ["None", "True"], f"rank {rank} loaded it"
        for message in result["refused"].values():
            assert "extra/rank_00001.pt: it would import posix.system" in message
            assert "Nothing of it was unpickled" in message
        if rank == 0:
            assert "(found on rank 1)" in result["refused"]["None"]
        assert not result["ran_before_trusting"]
        # Trusted by the user: loaded as torch loads any pickle.
        assert result["ran_when_trusted"] and result["trusted_reached"] == 2 * STEPS


def _crafted_optimizer_state(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    from _crafted import touching

    from lightning_mcore_ckpt.safety.safe_load import UnsafeCheckpointError
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    step, marker = Path(tmp, f"global_step_{STEPS}"), Path(tmp, "ran")

    class Crafted(TinyGPTModule):  # type: ignore[misc, valid-type]
        def configure_optimizers(self) -> Any:
            config = super().configure_optimizers()
            # Megatron-Core pickles parameter groups into optim/ (the common state).
            config["optimizer"].param_groups[0]["crafted"] = touching(marker)
            return config

    seen = _warnings()
    _fit(world_size, tmp, module=Crafted(dropout=0.1))
    ran_at_save = marker.exists()
    try:
        _fit(world_size, tmp, str(step))
        refused = ""
    except UnsafeCheckpointError as err:
        refused = str(err)
    return {"warnings": seen, "refused": refused, "ran": ran_at_save or marker.exists()}


def test_a_crafted_object_in_the_optimizer_state_warns_at_save_and_is_refused(
    tmp_path: Path,
) -> None:
    (result,) = run_distributed(_crafted_optimizer_state, 1, str(tmp_path), timeout=280)
    where = "optim['optimizer_0']['param_groups'][0]['crafted'] (posix.system)"
    assert [w for w in result["warnings"] if where in w], result["warnings"]
    optim = tmp_path / f"global_step_{STEPS}" / "optim"
    if _compat._mcore_at_least("0.17"):  # the common state is an object in the shards
        assert f"refusing to load {optim}: its objects 'common_state/" in result["refused"]
        assert "(posix.system) would import globals" in result["refused"]
    else:  # megatron-core 0.16 writes it to common.pt
        assert (
            f"refusing to load {optim}/common.pt: it would import posix.system"
            in (result["refused"])
        )
    assert not result["ran"]


def _user_type_in_hparams(rank: int, world_size: int, tmp: str, async_save: bool) -> dict[str, Any]:
    import torch

    from lightning_mcore_ckpt.safety.safe_load import UnsafeCheckpointError
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    step = str(Path(tmp, f"global_step_{STEPS}"))

    class Configured(TinyGPTModule):  # type: ignore[misc, valid-type]
        def __init__(self, config: TrainConfig, dropout: float = 0.1) -> None:
            super().__init__(dropout=dropout)
            self.save_hyperparameters()

    seen = _warnings()
    _fit(world_size, tmp, module=Configured(TrainConfig()), async_save=async_save)
    try:
        _fit(world_size, tmp, step, module=Configured(TrainConfig()))
        refused = ""
    except UnsafeCheckpointError as err:
        refused = str(err)
    with torch.serialization.safe_globals([TrainConfig]):
        resumed = _fit(world_size, tmp, step, module=Configured(TrainConfig()))
    return {"warnings": seen, "refused": refused, "resumed_to": resumed.global_step}


@pytest.mark.parametrize("mode", ["sync", "async"])  # async: extra/ checked after its write
def test_a_user_type_in_hparams_warns_at_save_is_refused_with_the_fix_and_loads_once_allowed(
    tmp_path: Path, mode: str
) -> None:
    (result,) = run_distributed(
        _user_type_in_hparams, 1, str(tmp_path), mode == "async", timeout=280
    )
    name = f"{TrainConfig.__module__}.TrainConfig"
    where = f"extra['lightning']['hyper_parameters']['config'] ({name})"
    warned = [w for w in result["warnings"] if where in w]
    assert len(warned) == 1, result["warnings"]  # once, though both saves hold it
    assert f"add_safe_globals([{name}])" in warned[0]
    assert f"it would import {name}" in result["refused"]
    assert f"add_safe_globals([{name}])" in result["refused"]
    assert result["resumed_to"] == 2 * STEPS


def _replaced_after_the_check(rank: int, world_size: int, tmp: str, what: str) -> dict[str, Any]:
    """A step that passes every check, then has a file of its ``model/`` replaced by a crafted
    one (``what``: its index, or its object records; the step relisted, as a whole crafted step
    would be) by rank 0 right after every rank made its last check of it, before Megatron-Core
    loads it: the window between a check and the load that follows."""
    import torch.distributed as dist
    from _crafted import crafted_index, relist, replace_objects, touching

    from lightning_mcore_ckpt.engine._reader import CheckpointReader
    from lightning_mcore_ckpt.safety.safe_load import UnsafeCheckpointError

    step, marker = Path(tmp, f"global_step_{STEPS}"), Path(tmp, "ran")
    _fit(world_size, tmp)
    check_shapes = CheckpointReader.check_shapes
    replaced: list[str] = []

    def check_then_replace(self: Any, model_dir: Path, *args: Any, **kwargs: Any) -> Any:
        checked = check_shapes(self, model_dir, *args, **kwargs)
        dist.barrier()  # every rank checked the genuine files
        if rank == 0 and not replaced:
            if what == "index":
                crafted_index(model_dir, marker)
                replaced.append(".metadata")
            else:
                prefix = "gpt.decoder.layers.self_attention.linear_proj._extra_state"
                replaced.extend(replace_objects(model_dir, prefix, touching(marker)))
            relist(step)
        dist.barrier()
        return checked

    CheckpointReader.check_shapes = check_then_replace  # type: ignore[method-assign]
    refused = ""
    try:
        _fit(world_size, tmp, str(step))
    except UnsafeCheckpointError as err:
        refused = str(err)
    finally:
        CheckpointReader.check_shapes = check_shapes  # type: ignore[method-assign]
    dist.barrier()
    ran_before_trusting = marker.exists()
    dist.barrier()
    # The replaced file really runs code where the user trusts the checkpoint whole.
    with _trusted_by_user(), contextlib.suppress(BaseException):  # what it returns is no state
        _fit(world_size, tmp, str(step))
    dist.barrier()
    return {
        "replaced": replaced,
        "refused": refused,
        "ran_before_trusting": ran_before_trusting,
        "ran_when_trusted": marker.exists(),
    }


@pytest.mark.parametrize("what", ["index", "objects"])
def test_a_file_replaced_between_the_check_and_the_load_is_refused_on_every_rank(
    tmp_path: Path, what: str
) -> None:
    results = run_distributed(_replaced_after_the_check, 2, str(tmp_path), what, timeout=280)
    assert results[0]["replaced"], results[0]
    model = tmp_path / f"global_step_{STEPS}" / "model"
    for rank, result in enumerate(results):
        if what == "index":
            assert (
                f"refusing to load {model}/.metadata: this torch.distributed" in (result["refused"])
            ), (rank, result["refused"])
        else:
            assert (
                f"refusing to load {model} (object 'gpt.decoder.layers." in (result["refused"])
            ), (rank, result["refused"])
        assert "posix.system" in result["refused"], (rank, result["refused"])
        assert not result["ran_before_trusting"], rank
        assert result["ran_when_trusted"], rank


def _crafted_index(rank: int, world_size: int, tmp: str, sub: str, optimizer: str) -> str:
    """Train (``optimizer``: TinyGPTModule's: torch AdamW, Megatron-Core's, its distributed one), then rank 0 replaces
    ``sub``'s index of the last step with one that runs code (the step relisted, as a whole
    crafted step would be); every rank resumes from it: what it raised."""
    import torch.distributed as dist
    from _crafted import crafted_index, relist

    from lightning_mcore_ckpt.safety.safe_load import UnsafeCheckpointError
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    step, marker = Path(tmp, f"global_step_{STEPS}"), Path(tmp, "ran")
    _fit(world_size, tmp, module=TinyGPTModule(dropout=0.1, optimizer=optimizer))
    dist.barrier()
    if rank == 0:
        crafted_index(step / sub, marker)
        relist(step)
    dist.barrier()
    try:
        _fit(world_size, tmp, str(step), module=TinyGPTModule(dropout=0.1, optimizer=optimizer))
    except UnsafeCheckpointError as err:
        return str(err)
    finally:
        dist.barrier()
        assert not marker.exists(), f"rank {rank}: the crafted index ran"
    return ""


@pytest.mark.parametrize("optimizer", ["adamw", "megatron", "distributed"])
@pytest.mark.parametrize("sub", ["model", "optim"])
def test_a_crafted_index_is_refused_before_anything_reads_it_whatever_the_optimizer(
    tmp_path: Path, sub: str, optimizer: str
) -> None:
    # Every reader of a step's index before its load (the optimizer layout's checks read the
    # optimizer's content metadata through Megatron-Core) reads it through the checked unpickler.
    results = run_distributed(_crafted_index, 2, str(tmp_path), sub, optimizer, timeout=280)
    index = tmp_path / f"global_step_{STEPS}" / sub / ".metadata"
    for rank, refused in enumerate(results):
        assert f"refusing to load {index}: this torch.distributed" in refused, (rank, refused)
        assert "posix.system" in refused, (rank, refused)
