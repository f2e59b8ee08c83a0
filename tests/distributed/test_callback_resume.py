"""MegatronCheckpoint: a run stopped at step k (mid-epoch) resumes from "last" bit-identically.

Each test runs an uninterrupted reference and an interrupted run (stopped by ``max_steps``, then
resumed by a *new* Trainer with ``ckpt_path="last"``) in the same processes, with dropout on, a
shuffled ``StatefulDataLoader``, AdamW and a step LR schedule, and compares per-step losses and
final weights exactly.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

BATCH = 2
STEPS_PER_EPOCH = 5
STOP_AT = 3  # mid-epoch
TOTAL = 8  # crosses the epoch boundary after the resume


def _stateful_loader(num_samples: int, sampler: Any = None) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_mcore_ckpt.tiny import TokenDataset

    dataset = TokenDataset(num_samples)
    # As a training script's seed_everything() would: torchdata's RandomSampler draws its seed
    # from the global RNG when constructed, so the reference and the interrupted run must seed
    # alike. (The resumed run's order comes from the loader state, whatever this seed.)
    torch.manual_seed(0)
    if sampler is not None:
        return StatefulDataLoader(dataset, batch_size=BATCH, sampler=sampler(dataset))
    return StatefulDataLoader(dataset, batch_size=BATCH, shuffle=True)


def _run(
    world_size: int,
    tp: int,
    dirpath: str,
    max_steps: int,
    ckpt_path: str | None,
    every: int = STOP_AT,
    sampler: Any = None,
    dropout: float = 0.1,
    num_samples: int | None = None,
    **callback_kwargs: Any,
) -> tuple[Any, Any]:
    from _trainer import make_trainer

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    dp = world_size // tp
    module = TinyGPTModule(dropout=dropout)
    module.seen: list[torch.Tensor] = []  # type: ignore[misc]
    original = module.training_step

    def training_step(batch: Any, batch_idx: int) -> Any:
        module.seen.append(batch[0].clone())
        return original(batch, batch_idx)

    module.training_step = training_step  # type: ignore[method-assign]
    callback = MegatronCheckpoint(dirpath, every_n_train_steps=every, **callback_kwargs)
    trainer = make_trainer(
        max_steps,
        MegatronStrategy(tensor_model_parallel_size=tp),
        world_size,
        callbacks=[callback],
        enable_checkpointing=True,
    )
    trainer.fit(
        module,
        train_dataloaders=_stateful_loader(num_samples or STEPS_PER_EPOCH * BATCH * dp, sampler),
        ckpt_path=ckpt_path,
    )
    return module, trainer


def _exact_resume(rank: int, world_size: int, tmp: str, tp: int) -> dict[str, object]:
    import functools

    from _trainer import gathered_weights

    from lightning_mcore_ckpt import ElasticSampler

    # One data-parallel rank: torchdata's own shuffling sampler. Two: the package's sampler.
    sampler = (
        None if world_size == tp else functools.partial(ElasticSampler, micro_batch_size=BATCH)
    )
    full, full_trainer = _run(world_size, tp, f"{tmp}/full", TOTAL, None, sampler=sampler)
    # Nothing to resume yet: "last" starts from scratch.
    _, stopped = _run(world_size, tp, f"{tmp}/run", STOP_AT, "last", sampler=sampler)
    resumed, resumed_trainer = _run(world_size, tp, f"{tmp}/run", TOTAL, "last", sampler=sampler)
    return {
        "full": full.step_losses,
        "resumed": resumed.step_losses,
        "full_seen": full.seen,
        "resumed_seen": resumed.seen,
        "stopped_step": stopped.global_step,
        "full_weights": gathered_weights(full_trainer),
        "resumed_weights": gathered_weights(resumed_trainer),
        "files": sorted(p.name for p in Path(tmp, "run").iterdir()),
    }


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("world_size", "tp"), [(2, 2), (2, 1)], ids=["tp2", "dp2"])
def test_mid_epoch_stop_resumes_from_last_bit_identically(
    tmp_path: Path, world_size: int, tp: int
) -> None:
    # Room for a loaded machine: a hang is what the limit is for, not a slow run.
    results = run_distributed(_exact_resume, world_size, str(tmp_path), tp, timeout=540)
    for r in results:
        assert r["stopped_step"] == STOP_AT
        # Steps 3 (stop) and 6 (cadence) and 8 (end of fit) committed; the tracker names 8.
        assert r["files"] == [
            "global_step_3",
            "global_step_6",
            "global_step_8",
            "latest_checkpointed_iteration.txt",
        ]
        assert len(r["resumed"]) == TOTAL - STOP_AT
        for step, (a, b) in enumerate(zip(r["resumed"], r["full"][STOP_AT:], strict=True)):
            assert torch.equal(a, b), f"loss differs at step {STOP_AT + step + 1}"
        # Every rank saw exactly the batches the uninterrupted run saw next.
        for a, b in zip(r["resumed_seen"], r["full_seen"][STOP_AT:], strict=True):
            assert torch.equal(a, b)
        for key, tensor in r["full_weights"].items():
            assert torch.equal(tensor, r["resumed_weights"][key]), key
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    meta = (tmp_path / "run" / "global_step_3" / "metadata.json").read_text()
    assert '"global_step": 3' in meta


def _elastic(rank: int, world_size: int, tmp: str) -> dict[str, object]:
    import functools

    from lightning_mcore_ckpt import ElasticSampler

    sampler = functools.partial(ElasticSampler, micro_batch_size=BATCH, seed=7)
    samples = STEPS_PER_EPOCH * BATCH * 2  # the same dataset for both layouts
    if world_size == 2:
        module, _ = _run(2, 1, tmp, STOP_AT, None, sampler=sampler, num_samples=samples)
    else:
        module, _ = _run(1, 1, tmp, STOP_AT + 3, "last", sampler=sampler, num_samples=samples)
    return {"seen": module.seen}


def test_elastic_sampler_dp2_to_dp1_continues_at_the_next_global_sample(tmp_path: Path) -> None:
    from lightning_mcore_ckpt.tiny import TokenDataset

    before = run_distributed(_elastic, 2, str(tmp_path), timeout=200)
    after = run_distributed(_elastic, 1, str(tmp_path), timeout=200)[0]

    # Global order: the epoch's permutation, consumed micro-batch by micro-batch, rank by rank.
    dataset = TokenDataset(STEPS_PER_EPOCH * BATCH * 2)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(7)).tolist()
    expected = [dataset[i][0] for i in order]

    def rows(batches: list[torch.Tensor]) -> list[torch.Tensor]:
        return [row for b in batches for row in b]

    seen_before: list[torch.Tensor] = []
    for step in range(STOP_AT):
        for r in before:
            seen_before.extend(r["seen"][step])
    consumed = STOP_AT * BATCH * 2
    assert all(torch.equal(a, b) for a, b in zip(seen_before, expected[:consumed], strict=True))
    seen_after = rows(after["seen"])
    assert len(seen_after) == 3 * BATCH
    for a, b in zip(seen_after, expected[consumed : consumed + 3 * BATCH], strict=True):
        assert torch.equal(a, b)


def _own_sampler(dataset: Any) -> Any:
    # A sampler of the user's own (kept as it is: its per-rank position cannot be mapped).
    from torchdata.stateful_dataloader.sampler import RandomSampler

    class OwnSampler(RandomSampler):  # type: ignore[misc]
        pass

    return OwnSampler(dataset)


def _dp_change_refused(rank: int, world_size: int, tmp: str) -> str:
    if world_size == 2:
        _run(2, 1, tmp, STOP_AT, None, sampler=_own_sampler)
        return "saved"
    try:
        _run(1, 1, tmp, STOP_AT + 1, "last", sampler=_own_sampler)
    except ValueError as err:
        return str(err)
    return "no error"


def test_dp_change_without_elastic_sampler_is_refused(tmp_path: Path) -> None:
    run_distributed(_dp_change_refused, 2, str(tmp_path), timeout=200)
    message = run_distributed(_dp_change_refused, 1, str(tmp_path), timeout=200)[0]
    assert "data-parallel size 2" in message and "ElasticSampler" in message, message
    assert "restore_dataloader=False" in message


def _missing_rng_keys(rank: int, world_size: int, tmp: str) -> dict[str, object]:
    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("lightning_mcore_ckpt").addHandler(Capture())
    _run(world_size, 2, tmp, STOP_AT, None)
    torch.distributed.barrier()
    if rank == 0:  # an older format: no CUDA and no Megatron tracker streams
        for path in Path(tmp, f"global_step_{STOP_AT}", "extra").glob("rank_*.pt"):
            payload = torch.load(path, weights_only=False)
            payload["rng"].pop("megatron_tracker")
            payload["rng"].pop("torch_cuda", None)
            torch.save(payload, path)
        # ... whose commit listed no files, digests or seal (the files above changed).
        meta_path = Path(tmp, f"global_step_{STOP_AT}", "metadata.json")
        meta = json.loads(meta_path.read_text())
        for field in ("files", "hashes", "metadata_hash"):
            del meta[field]
        meta_path.write_text(json.dumps(meta))
    torch.distributed.barrier()
    module, trainer = _run(world_size, 2, tmp, STOP_AT + 2, "last")
    return {"records": records, "steps": len(module.step_losses), "end": trainer.global_step}


def test_extra_without_cuda_and_tracker_rng_warns_and_resumes(tmp_path: Path) -> None:
    for r in run_distributed(_missing_rng_keys, 2, str(tmp_path), timeout=200):
        assert r["steps"] == 2 and r["end"] == STOP_AT + 2
        assert any("has no megatron_tracker" in m for m in r["records"]), r["records"]
