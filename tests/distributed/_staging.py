"""Staging observed inside ``fit``, shared by the CPU tests and the GPU tier (run in each rank).

The same functions run with ``accelerator="cpu"`` (``tests/distributed/test_staging_in_fit.py``,
in CI) and ``accelerator="gpu"`` (``tests/gpu/test_one_gpu.py``, on a GPU machine): what they
record is observed while the Trainer trains, before Lightning's teardown moves the module and
the optimizer state to the CPU. :func:`check_staging` holds what each device must show.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import torch

SAVE_AT = 2
"""The step whose async save is observed."""


# --- host memory -----------------------------------------------------------------------------


def _status_bytes(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert match is not None, field
    return int(match.group(1)) * 1024


class PeakRSS:
    """Peak resident memory of this process above its level when entered.

    The kernel's own high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) where
    Linux allows it: every page touched counts, however briefly. Elsewhere, sampled every
    millisecond by a thread, as ``benchmarks/workloads.PeakRSS`` does (a peak shorter than that
    can be missed).
    """

    def __init__(self) -> None:
        self.base = self.peak = 0
        self._exact = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRSS:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self._exact = True
        except OSError:
            self._thread = threading.Thread(target=self._sample, daemon=True)
        self.base = self.peak = self._rss()
        if self._thread is not None:
            self._thread.start()
        return self

    def _rss(self) -> int:
        import psutil

        return int(psutil.Process().memory_info().rss)

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self._rss())
        if self._exact:
            self.peak = max(self.peak, _status_bytes("VmHWM"))

    @property
    def extra(self) -> int:
        return self.peak - self.base


# --- what was staged, and from where ---------------------------------------------------------


class StagingSpy:
    """Records every tensor a save copies to the host, through either staging (unbounded:
    ``StagingBuffers``; bounded: ``StagingSession``): where its source was, where the copy is,
    whether the copy is pinned, and the source's value at the copy (the state at the save)."""

    def __init__(self) -> None:
        from lightning_mcore_ckpt.engine import _staging

        self.staged: list[dict[str, Any]] = []
        self._module = _staging
        self._stock = _staging.copy_to_host
        _staging.copy_to_host = self._copy  # type: ignore[assignment]

    def _copy(self, buffer: torch.Tensor, source: torch.Tensor, non_blocking: bool) -> None:
        self._stock(buffer, source, non_blocking)
        if source.device.type == "cuda":
            torch.cuda.synchronize()
        self.staged.append(
            {
                "source": source.device.type,
                "copy": buffer.device.type,
                "pinned": bool(buffer.is_pinned()),
                "equal": bool(torch.equal(buffer, source.cpu())),
            }
        )

    def summary(self) -> dict[str, Any]:
        return {
            "staged": len(self.staged),
            "sources": sorted({s["source"] for s in self.staged}),
            "copies": sorted({s["copy"] for s in self.staged}),
            "pinned": sum(s["pinned"] for s in self.staged),
            "copied_exactly": all(s["equal"] for s in self.staged),
        }


def observe_async_save(
    rank: int,
    world_size: int,
    root: str,
    accelerator: str,
    max_staging_bytes: int | None = None,
    async_save: bool = True,
) -> dict[str, Any]:
    """Train with ``MegatronCheckpoint(every_n_train_steps=SAVE_AT)`` and look at its save of
    step ``SAVE_AT`` from inside ``fit``: what it staged (:class:`StagingSpy`), the device the
    module trained on, the weights at the save; then, async, change every weight while the
    background write is held (it is let go at the next batch start, after the change), so that
    a write of anything but the snapshot shows."""
    import lightning.pytorch as pl
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.engine import _extra, _shards
    from lightning_mcore_ckpt.testing import gather_sharded
    from lightning_mcore_ckpt.tiny import TinyGPTModule, TokenDataset

    spy = StagingSpy()
    seen: dict[str, Any] = {}
    held = threading.Event()
    stock_write = _shards.ShardWriter.write

    def held_write(self: Any, jobs: Any, write_timer: Any, *side: Any) -> None:
        # The background write of the observed save waits until the weights were changed.
        if async_save and not held.is_set():
            assert held.wait(120), "the write was never let go"
        stock_write(self, jobs, write_timer, *side)

    _shards.ShardWriter.write = held_write  # type: ignore[method-assign]
    extra_writes: list[str] = []  # every extra/ file written (inline or in the background)
    stock_extra = _extra.write_extra_file

    def counted_extra(target: Path, data: bytes) -> None:
        extra_writes.append(str(target))
        stock_extra(target, data)

    _extra.write_extra_file = counted_extra

    class Observe(pl.Callback):
        # Lightning runs checkpoint callbacks last: this sees each step before it is saved.
        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
            if trainer.global_step == SAVE_AT:
                seen["trained_on"] = next(module.parameters()).device.type
                seen["before"] = gather_sharded(trainer.strategy.model_sharded_state_dict())
                seen["rng_at_save"] = torch.get_rng_state()
                assert spy.staged == [], spy.staged  # the save of this step is the first
                seen["allocations_before_save"] = _allocations(trainer.strategy._writer.shards)

        def on_train_batch_start(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
            if trainer.global_step == SAVE_AT:
                seen.update(spy.summary())
                allocations = _allocations(trainer.strategy._writer.shards)
                seen["allocated_by_save"] = allocations - seen.pop("allocations_before_save")
                seen["pending"] = trainer.strategy._writer.pending_path is not None
                # This rank's extra/ file: written by the background write too (async).
                extra = Path(root, "ckpt", f"global_step_{SAVE_AT}", "extra")
                seen["extra_before_write"] = (extra / f"rank_{rank:05d}.pt").exists()
                with torch.no_grad():  # training goes on while the background write runs
                    for param in module.parameters():
                        param.add_(1.0)
                torch.rand(16)  # the RNG moves on too
                held.set()

    strategy = MegatronStrategy(
        ckpt_async_save=async_save, ckpt_max_staging_bytes=max_staging_bytes
    )
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator=accelerator,
        devices=world_size,
        max_steps=SAVE_AT + 1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            MegatronCheckpoint(Path(root, "ckpt"), every_n_train_steps=SAVE_AT),
            Observe(),
        ],
    )
    if not async_save:
        held.set()
    trainer.fit(TinyGPTModule(dropout=0.0), StatefulDataLoader(TokenDataset(16), batch_size=2))
    extra = Path(root, "ckpt", f"global_step_{SAVE_AT}", "extra", f"rank_{rank:05d}.pt")
    saved = torch.load(extra, weights_only=True)
    seen["extra_writes"] = [t for t in extra_writes if f"global_step_{SAVE_AT}" in t]
    seen["extra_rng_is_the_snapshot"] = torch.equal(
        saved["rng"]["torch_cpu"], seen.pop("rng_at_save")
    )
    return seen


def _allocations(shards: Any) -> int:
    """The staging allocations of our writer so far (buffers, or the bounded ring)."""
    return (shards.staging if shards.bounded is None else shards.bounded).allocations


def check_staging(out: dict[str, Any], accelerator: str, async_save: bool = True) -> None:
    """What the save of :func:`observe_async_save` must have staged, on ``accelerator``."""
    device = "cuda" if accelerator == "gpu" else "cpu"
    out = {key: value for key, value in out.items() if key != "before"}  # shown on failure
    assert out["trained_on"] == device, out
    # extra/ holds the RNG as it was at the save, though the RNG moved on during the write.
    assert out["extra_rng_is_the_snapshot"], out
    # Written once, sync or async (a sync save wrote it inline and again with the shards).
    assert len(out["extra_writes"]) == 1, out
    if async_save:
        assert out["pending"], out  # the write was still in flight when the weights changed
        # Our writer's async save writes extra/ in the background, with the shards.
        assert not out["extra_before_write"], out
    else:
        assert out["extra_before_write"], out
    if device == "cpu" and not async_save:
        # A sync save of CPU tensors writes them where they are: nothing to copy.
        assert out["staged"] == 0, out
        return
    # Every tensor of the save was copied to the host, from where it trained, exactly.
    assert out["staged"] > 0, out
    assert out["sources"] == [device], out
    assert out["copies"] == ["cpu"], out
    assert out["copied_exactly"], out
    # Pinned host memory for device tensors (the fast, asynchronous copy); pageable for CPU.
    assert out["pinned"] == (out["staged"] if device == "cuda" else 0), out
    # This first save staged into memory allocated when it was planned ahead, after the first
    # optimizer step (pinned memory takes about 0.6 s a GiB to allocate).
    assert out["allocated_by_save"] == 0, out


def saved_weights_are_the_snapshot(root: str, before: dict[str, torch.Tensor]) -> None:
    """The step written is the state at the save, not the weights changed after it."""
    import torch.distributed.checkpoint as dcp

    step = Path(root, "ckpt", f"global_step_{SAVE_AT}")
    from lightning_mcore_ckpt.format import layout

    assert layout.verify_step(step) == [], step
    saved = {key: torch.empty_like(tensor) for key, tensor in before.items()}
    dcp.load(saved, checkpoint_id=str(step / "model"), no_dist=True)
    for key, tensor in before.items():
        assert torch.equal(saved[key], tensor), key


# --- a bf16 model's export, computed on the device -------------------------------------------

PROBE_SEED = 7


def export_bf16(rank: int, world_size: int, root: str, accelerator: str) -> dict[str, Any]:
    """Train a bf16 (``bf16-true``) Hugging Face family model that ``MegatronCheckpoint``
    exports at the end; compute, inside ``fit`` (``on_train_end``, before teardown) on the
    device it trained on, the logits of a fixed probe and the weights' dtype and device."""
    import lightning.pytorch as pl
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_mcore_ckpt import HFExport, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import HFGPTModule, TokenDataset

    src = str(Path(root, "src"))
    seen: dict[str, Any] = {}

    class Probe(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
            param = next(module.parameters())
            probe = torch.randint(
                0, 128, (2, 12), generator=torch.Generator().manual_seed(PROBE_SEED)
            )
            with torch.no_grad():
                logits = module.logits(probe.to(param.device))
            seen.update(
                probe=probe,
                logits=logits.float().cpu(),
                logits_device=logits.device.type,
                dtype=str(param.dtype),
                trained_on=param.device.type,
            )

    trainer = pl.Trainer(
        strategy=MegatronStrategy(init_from=src),
        accelerator=accelerator,
        devices=world_size,
        max_steps=2,
        precision="bf16-true",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[MegatronCheckpoint(Path(root, "ckpt"), hf_export=HFExport(src)), Probe()],
    )
    trainer.fit(HFGPTModule(src, lr=1e-2), StatefulDataLoader(TokenDataset(8), batch_size=2))
    return seen


def check_bf16_export(root: Path, out: dict[str, Any], accelerator: str) -> None:
    """The export is bf16 and computes what the trained model computed on its device."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    device = "cuda" if accelerator == "gpu" else "cpu"
    assert out["trained_on"] == device and out["logits_device"] == device, out
    assert out["dtype"] == "torch.bfloat16", out
    exported = root / "ckpt" / "global_step_2" / "huggingface"
    files = sorted(exported.glob("*.safetensors"))
    assert files, exported
    for file in files:
        with safe_open(file, framework="pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}, file
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).to(torch.bfloat16)
    with torch.no_grad():
        hf = model(out["probe"]).logits.float()
    # bf16 kernels differ between Megatron-Core (on the device) and transformers (on the CPU).
    torch.testing.assert_close(out["logits"], hf, rtol=0, atol=5e-2)
