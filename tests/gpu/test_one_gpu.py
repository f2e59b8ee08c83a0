"""GPU tier on one GPU: what the product runs, checked where it runs (CUDA, NCCL, world size 1).

Skipped without CUDA. Exact resume (losses, RNG with the CUDA streams, data, weights, optimizer
state at every step) through SIGTERM (a preemption) and a hard kill, across the optimizer
(torch AdamW; Megatron's distributed optimizer over Megatron DDP, both sharding types), the
precision (fp32; Lightning's ``bf16-mixed`` and ``bf16-true``; Megatron's own bf16 with fp32 main
parameters) and sync/async saves; an async save's staging (pinned host memory, a snapshot);
the Hugging Face export of a bf16 model. Two ranks cannot share one GPU under NCCL (it refuses
two ranks on one device): the 2-process GPU tests are in the 2-GPU files of this directory.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt import check_resume, layout
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# (optimizer, precision, async save, sharding of the distributed optimizer)
CELLS = [
    ("distributed", "megatron-bf16", True, "dp_reshardable"),
    ("distributed", "32", False, "fully_reshardable"),
    ("distributed", "bf16-mixed", True, "fully_reshardable"),
    ("megatron", "megatron-bf16", False, "dp_reshardable"),
    ("adamw", "bf16-mixed", True, "dp_reshardable"),
    ("adamw", "bf16-true", False, "dp_reshardable"),
    ("adamw", "32", True, "dp_reshardable"),
]


@pytest.mark.parametrize("cell", CELLS, ids=["-".join(map(str, c)) for c in CELLS])
def test_one_gpu_resumes_exactly(tmp_path: Path, cell: tuple[Any, ...]) -> None:
    import _jobs

    optimizer, precision, async_save, sharding = cell
    report = check_resume(
        functools.partial(
            _jobs.build,
            layout="1",
            accelerator="gpu",
            optimizer=optimizer,
            precision=precision,
            async_save=async_save,
            optimizer_sharding=sharding,
            steps_per_epoch=4,
        ),
        stop_at=3,
        max_steps=6,
        how=("sigterm", "kill"),
        world_size=1,
        workdir=tmp_path / "work",
        check_determinism=False,
    )
    assert report.exact, str(report)
    step = tmp_path / "work" / "sigterm" / "checkpoints" / "global_step_3"
    metadata = layout.read_metadata(step)
    assert metadata is not None
    assert metadata.get("optimizer_sharding") == (sharding if optimizer == "distributed" else None)
    assert "torch_cuda" not in str(metadata)  # RNG lives in extra/, per rank


def _staged_async_save(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.engine._shards import StagingBuffers
    from lightning_mcore_ckpt.testing import gather_sharded
    from lightning_mcore_ckpt.tiny import TinyGPTModule, TokenDataset

    # Our writer stages in this process, into its reused buffers: look at what it staged.
    # (Megatron-Core's own writer, ckpt_writer="megatron", stages through preload_tensors.)
    stock = StagingBuffers.stage
    staged: list[torch.Tensor] = []

    def stage(self: Any, name: str, buckets: Any, snapshot: bool) -> Any:
        result = stock(self, name, buckets, snapshot)
        staged.extend(t for _, _, (_, tensors) in result for _, t in tensors)
        return result

    StagingBuffers.stage = stage  # type: ignore[method-assign]
    step_dir = Path(tmp) / "global_step_2"
    trainer = pl.Trainer(
        strategy=MegatronStrategy(ckpt_async_save=True),
        accelerator="gpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    module = TinyGPTModule(dropout=0.0)
    trainer.fit(module, StatefulDataLoader(TokenDataset(8), batch_size=2))
    before = gather_sharded(trainer.strategy.model_sharded_state_dict())
    trainer.save_checkpoint(step_dir)
    with torch.no_grad():  # training goes on while the background write runs
        for p in module.parameters():
            p.add_(1.0)
    trainer.strategy.teardown()
    return {
        "writer": layout.read_metadata(step_dir)["writer"],  # type: ignore[index]
        "staged": len(staged),
        "pinned": sum(t.is_pinned() for t in staged),
        "on_cpu": all(t.device.type == "cpu" for t in staged),
        "before": before,
    }


def test_an_async_save_stages_into_pinned_host_memory_and_writes_the_snapshot(
    tmp_path: Path,
) -> None:
    import torch.distributed.checkpoint as dcp

    from lightning_mcore_ckpt import _compat

    out = run_distributed(_staged_async_save, 1, str(tmp_path), timeout=500)[0]
    step = tmp_path / "global_step_2"
    assert layout.verify_step(step) == []
    assert out["writer"] == _compat.THREADS, out
    assert out["staged"] > 0 and out["on_cpu"]
    assert out["pinned"] == out["staged"], out
    # What was written is the state at the save, not the weights changed after it.
    before = out["before"]
    saved = {key: torch.empty_like(tensor) for key, tensor in before.items()}
    dcp.load(saved, checkpoint_id=str(step / "model"), no_dist=True)
    for key, tensor in before.items():
        assert torch.equal(saved[key], tensor), key


def _export_bf16(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_mcore_ckpt import HFExport, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import HFGPTModule, TokenDataset

    src = str(Path(tmp, "src"))
    trainer = pl.Trainer(
        strategy=MegatronStrategy(init_from=src),
        accelerator="gpu",
        devices=1,
        max_steps=2,
        precision="bf16-true",
        logger=False,
        enable_progress_bar=False,
        callbacks=[MegatronCheckpoint(Path(tmp, "ckpt"), hf_export=HFExport(src))],
    )
    module = HFGPTModule(src, lr=1e-2)
    trainer.fit(module, StatefulDataLoader(TokenDataset(8), batch_size=2))
    trainer.strategy.teardown()
    probe = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = module.logits(probe.cuda()).float().cpu()
    return {"logits": logits, "probe": probe, "dtype": str(next(module.parameters()).dtype)}


def test_a_bf16_model_exports_to_hugging_face_in_bf16(tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from lightning_mcore_ckpt.tiny import tiny_hf_model

    tiny_hf_model(tmp_path / "src", "qwen2")
    out = run_distributed(_export_bf16, 1, str(tmp_path), timeout=500)[0]
    assert out["dtype"] == "torch.bfloat16"
    exported = tmp_path / "ckpt" / "global_step_2" / "huggingface"
    for file in exported.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}, file
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).to(torch.bfloat16)
    with torch.no_grad():
        hf = model(out["probe"]).logits.float()
    # bf16 kernels differ between Megatron-Core on the GPU and transformers on the CPU.
    torch.testing.assert_close(out["logits"], hf, rtol=0, atol=5e-2)
