"""The CPU runtime is real: stock Megatron-Core trains with dropout, saves at TP=2, loads at TP=1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(240)


def _tokens(seed: int, batch: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from lightning_mcore_ckpt.tiny import TINY_SEQ_LEN, TINY_VOCAB

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY_VOCAB, (batch, TINY_SEQ_LEN + 1), generator=g)
    position_ids = torch.arange(TINY_SEQ_LEN).unsqueeze(0).expand(batch, -1)
    return tokens[:, :-1], tokens[:, 1:], position_ids


def _train_tp2_and_save(rank: int, world_size: int, ckpt_dir: str) -> dict[str, torch.Tensor]:
    from megatron.core import dist_checkpointing

    from lightning_mcore_ckpt.testing import gather_sharded
    from lightning_mcore_ckpt.tiny import tiny_gpt
    from lightning_mcore_ckpt.training import parallel as _parallel

    _parallel.initialize(tensor_model_parallel_size=2, seed=1234, device_type="cpu")
    model = tiny_gpt(hidden_dropout=0.2, attention_dropout=0.2)
    model.train()
    inputs, labels, position_ids = _tokens(seed=0)

    # Dropout is real: the same batch twice gives different losses in training mode.
    first = model(inputs, position_ids, None, labels=labels).mean()
    second = model(inputs, position_ids, None, labels=labels).mean()
    assert not torch.equal(first, second), "dropout had no effect"

    first.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.1 * p.grad)

    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    full = gather_sharded(model.sharded_state_dict())
    _parallel.destroy()
    return full


def _load_tp1(rank: int, world_size: int, ckpt_dir: str) -> dict[str, torch.Tensor]:
    from megatron.core import dist_checkpointing

    from lightning_mcore_ckpt.testing import gather_sharded
    from lightning_mcore_ckpt.tiny import tiny_gpt
    from lightning_mcore_ckpt.training import parallel as _parallel

    _parallel.initialize(tensor_model_parallel_size=1, seed=999, device_type="cpu")
    model = tiny_gpt()
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir))
    full = gather_sharded(model.sharded_state_dict())
    inputs, labels, position_ids = _tokens(seed=1)
    model.eval()
    assert torch.isfinite(model(inputs, position_ids, None, labels=labels)).all()
    _parallel.destroy()
    return full


def test_tp2_checkpoint_with_dropout_loads_at_tp1_with_identical_weights(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    saved_rank0, saved_rank1 = run_distributed(_train_tp2_and_save, 2, str(ckpt), timeout=180)
    (loaded,) = run_distributed(_load_tp1, 1, str(ckpt), timeout=120)

    assert saved_rank0.keys() == saved_rank1.keys() == loaded.keys()
    assert len(loaded) > 5
    for key, tensor in saved_rank0.items():
        assert torch.equal(tensor, saved_rank1[key]), key
        assert torch.equal(tensor, loaded[key]), f"{key} differs after TP=2 -> TP=1 load"
    # Layers are stacked on a leading axis; the fused QKV weight is whole again after gathering.
    qkv = next(k for k in loaded if k.endswith("linear_qkv.weight"))
    assert tuple(loaded[qkv].shape) == (2, 3 * 64, 64)


def _with_cuda_present(**cell: object) -> object:
    """The resume matrix's job, in a process where the package sees a machine with CUDA (what
    it asks, ``_cpu.cuda_available()``, says so; torch itself is left alone, its CPU kernels
    ask too). A GPU machine failed exactly there: the adaptations were skipped, and Megatron-Core
    reached for a GPU from CPU ranks. Every call that would reach one fails here (there is none),
    so the run proves the CPU path never does."""
    import _jobs  # tests/resume: on sys.path for the resume-check tests as for this one

    from lightning_mcore_ckpt import _cpu

    _cpu.cuda_available = lambda: True  # type: ignore[assignment]
    return _jobs.build(**cell)  # type: ignore[arg-type]


def test_a_cpu_run_on_a_machine_with_cuda_takes_the_cpu_path_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    # The distributed optimizer over Megatron DDP reaches the most of Megatron-Core's CUDA code.
    import functools

    from lightning_mcore_ckpt import check_resume

    report = check_resume(
        functools.partial(
            _with_cuda_present,
            layout="tp2",
            async_save=True,
            optimizer="distributed",
            precision="megatron-bf16",
            steps_per_epoch=3,
        ),
        stop_at=2,
        max_steps=4,
        how="sigterm",
        world_size=2,
        workdir=tmp_path / "work",
        check_determinism=False,
    )
    assert report.exact, str(report)
