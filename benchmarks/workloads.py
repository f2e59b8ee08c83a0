"""What each benchmark process runs (inside every rank of a ``run_distributed`` job)."""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# hidden size, layers: model + AdamW state of about 256 MiB, 1 GiB, 4 GiB (fp32, 3 copies).
SIZES = {"quick": (128, 2), "256M": (512, 7), "1G": (1024, 7), "4G": (2048, 7)}


class PeakRSS:
    """Peak resident memory of this process above its level when started (sampled)."""

    def __init__(self, interval: float = 0.005) -> None:
        import psutil

        self._proc = psutil.Process()
        self._interval = interval
        self.base = self._proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def extra(self) -> int:
        return self.peak - self.base


def drop_cache(path: Path) -> None:
    """Evict a checkpoint's files from the page cache, so that a load reads the disk."""
    for file in Path(path).rglob("*"):
        if file.is_file() and hasattr(os, "posix_fadvise"):
            with open(file, "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _timed(fn: Callable[[], Any]) -> tuple[float, int]:
    gc.collect()
    with PeakRSS() as rss:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    return seconds, rss.extra


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def _figures(
    saves: list[float], loads: list[float], size: int, save_extra: int, load_extra: int
) -> dict[str, Any]:
    # A plain save blocks for all of its time.
    return {
        "save_s": _summary(saves),
        "blocking_s": _summary(saves),
        "load_s": _summary(loads),
        "bytes": size,
        "peak_rss_extra": save_extra,
        "load_peak_rss_extra": load_extra,
    }


def _module(size: str) -> Any:
    from lightning_mcore_ckpt.tiny import TinyGPTModule, tiny_gpt

    hidden, layers = SIZES[size]

    class Sized(TinyGPTModule):  # type: ignore[misc]
        def configure_model(self) -> None:
            if self.gpt is None:
                self.gpt = tiny_gpt(
                    hidden_size=hidden,
                    ffn_hidden_size=4 * hidden,
                    num_attention_heads=max(1, hidden // 64),
                    num_layers=layers,
                    hidden_dropout=0.0,
                    attention_dropout=0.0,
                )

    return Sized(dropout=0.0)


def _trainer(
    max_steps: int,
    tp: int,
    world: int,
    callbacks: list[Any],
    async_save: bool,
    device: str = "cpu",
    writer: str = "threads",
    **options: Any,
) -> Any:
    import lightning.pytorch as pl

    from lightning_mcore_ckpt import MegatronStrategy

    return pl.Trainer(
        strategy=MegatronStrategy(
            tensor_model_parallel_size=tp, ckpt_async_save=async_save, ckpt_writer=writer, **options
        ),
        accelerator=device,
        devices=world,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=any(type(c).__name__ == "MegatronCheckpoint" for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def _loader() -> Any:
    from torch.utils.data import DataLoader

    from lightning_mcore_ckpt.tiny import TokenDataset

    return DataLoader(TokenDataset(256), batch_size=2)


def save_load(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Every method's save and load of the same state; returns rank 0's figures."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from megatron.core import dist_checkpointing

    from lightning_mcore_ckpt import MegatronCheckpoint, layout
    from lightning_mcore_ckpt.engine import optimizer_sharded_state_dict

    size, repeats, root = cfg["size"], cfg["repeats"], Path(cfg["dir"])
    tp = world
    out: dict[str, Any] = {"size": size, "world": world}

    # 1. This package, through a real Trainer: figures from each committed step's metadata.
    # Saves three steps apart, so that an async write finishes before the next save (as it
    # does in real runs, where saves are minutes apart).
    # Steady state: every save but the first, which is reported on its own. The Megatron-Core
    # writer (forked per save, or NVRx where it installs) is measured next to ours.
    every = cfg.get("every", 3)
    device = cfg.get("device", "cpu")
    modes = [("sync", "threads"), ("async", "threads"), ("async", "megatron")]
    for mode, writer in modes:
        name = f"ours-{mode}" if writer == "threads" else f"ours-{mode} (megatron writer)"
        dirpath = root / f"ours-{mode}-{writer}"
        module = _module(size)
        callback = MegatronCheckpoint(dirpath, every_n_train_steps=every, save_last=False)
        with PeakRSS() as rss:
            trainer = _trainer(
                repeats * every, tp, world, [callback], mode == "async", device, writer
            )
            trainer.fit(module, train_dataloaders=_loader())
        if rank == 0:
            metas = [layout.read_metadata(s.path) or {} for s in layout.complete_steps(dirpath)]
            metas.sort(key=lambda m: m["global_step"])
            steady = metas[1:] or metas
            out[name] = {
                "save_s": _summary([m["total_time_s"] for m in steady]),
                "blocking_s": _summary([m["blocking_time_s"] for m in steady]),
                "write_s": _summary([m["write_time_s"] for m in steady]),
                "first_save_s": metas[0]["total_time_s"],
                "first_blocking_s": metas[0]["blocking_time_s"],
                "bytes": metas[-1]["size_bytes"],
                "peak_rss_extra": rss.extra,
            }
        if mode == "sync":
            strategy = trainer.strategy
            last = layout.resolve_last(dirpath, verify=False)
            assert last is not None
            loads = []
            for _ in range(repeats):
                drop_cache(last)
                seconds, extra = _timed(lambda p=last, s=strategy: s.load_checkpoint(p))
                loads.append(seconds)
            # A load that also re-hashes every file (ckpt_verify_hashes=True), cold, and the
            # re-hash alone (rank 0 checks the step before every rank loads it).
            strategy._reader.verify_hashes = True
            verified, rehash = [], []
            for _ in range(repeats):
                drop_cache(last)
                verified.append(_timed(lambda p=last, s=strategy: s.load_checkpoint(p))[0])
                drop_cache(last)
                rehash.append(_timed(lambda p=last: layout.verify_step(p, deep=True))[0])
            strategy._reader.verify_hashes = False
            if rank == 0:
                out["ours-sync"]["load_s"] = _summary(loads)
                out["ours-sync"]["load_peak_rss_extra"] = extra
                out["ours-sync"]["verified_load_s"] = _summary(verified)
                out["ours-sync"]["rehash_s"] = _summary(rehash)
            keep = (trainer, module, strategy)
    trainer, module, strategy = keep
    optimizer = strategy._torch_optimizers()[0]

    def model_ssd() -> dict[str, Any]:
        return strategy.model_sharded_state_dict()

    def optim_ssd() -> dict[str, Any]:
        return optimizer_sharded_state_dict(
            strategy._torch_optimizers(), module, strategy.model_sharded_state_dict()
        )

    def fresh(name: str) -> Path:
        path = root / name
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        dist.barrier()
        return path

    # 2. Raw Megatron-Core dist_checkpointing of the same sharded state dicts.
    saves, loads, bytes_ = [], [], 0
    for i in range(repeats):
        path = fresh(f"raw-{i}")
        (path / "model").mkdir(exist_ok=True)
        (path / "optim").mkdir(exist_ok=True)
        dist.barrier()

        def raw_save(path: Path = path) -> None:
            dist_checkpointing.save(model_ssd(), str(path / "model"))
            dist_checkpointing.save(optim_ssd(), str(path / "optim"))
            dist.barrier()

        seconds, save_extra = _timed(raw_save)
        saves.append(seconds)
        bytes_ = tree_bytes(path)

        drop_cache(path)

        def raw_load(path: Path = path) -> None:
            dist_checkpointing.load(model_ssd(), str(path / "model"))
            strategy._load_optimizers(path / "optim")

        seconds, load_extra = _timed(raw_load)
        loads.append(seconds)
    out["raw dist_checkpointing"] = _figures(saves, loads, bytes_, save_extra, load_extra)

    # 3. Lightning's default TorchCheckpointIO: torch.save of the whole checkpoint (one file per
    #    rank: each holds its tensor-parallel shard), plus the fsync that makes it durable.
    io = TorchCheckpointIO()
    state = {"state_dict": module.state_dict(), "optimizer_states": [optimizer.state_dict()]}
    saves, loads = [], []
    for i in range(repeats):
        path = fresh(f"torch-save-{i}") / f"rank_{rank}.ckpt"

        def torch_save(path: Path = path) -> None:
            io.save_checkpoint(state, path)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            dist.barrier()

        seconds, save_extra = _timed(torch_save)
        saves.append(seconds)
        drop_cache(path.parent)
        seconds, load_extra = _timed(lambda path=path: io.load_checkpoint(path))
        loads.append(seconds)
        bytes_ = path.stat().st_size * world
    out["torch.save (Lightning default)"] = _figures(saves, loads, bytes_, save_extra, load_extra)

    # 4. Plain torch.distributed.checkpoint of the same state (keys made per rank, since each
    #    rank holds different tensor-parallel shards under the same names).
    flat = {f"r{rank}.{k}": v for k, v in module.state_dict().items()}
    opt_state = {
        f"r{rank}.opt.{i}.{k}": v
        for i, s in enumerate(optimizer.state.values())
        for k, v in s.items()
        if isinstance(v, torch.Tensor)
    }
    plain = {**flat, **opt_state}
    saves, loads = [], []
    for i in range(repeats):
        path = fresh(f"dcp-{i}")
        seconds, save_extra = _timed(lambda path=path: dcp.save(plain, checkpoint_id=str(path)))
        saves.append(seconds)
        bytes_ = tree_bytes(path)
        drop_cache(path)
        seconds, load_extra = _timed(lambda path=path: dcp.load(plain, checkpoint_id=str(path)))
        loads.append(seconds)
    out["torch.distributed.checkpoint"] = _figures(saves, loads, bytes_, save_extra, load_extra)

    # 5. torch DCP's own async save (its default stager: pinned memory on GPU; a thread writer).
    saves, blocks = [], []
    for i in range(repeats):
        path = fresh(f"dcp-async-{i}")
        with PeakRSS() as rss:
            start = time.perf_counter()
            future = dcp.async_save(plain, checkpoint_id=str(path))
            blocks.append(time.perf_counter() - start)
            future.result()
            dist.barrier()
            saves.append(time.perf_counter() - start)
    out["torch DCP async"] = {
        "save_s": _summary(saves),
        "blocking_s": _summary(blocks),
        "bytes": tree_bytes(path),
        "peak_rss_extra": rss.extra,
    }

    # 6. Side by side, round after round: our sync save (the strategy's, as a Trainer's save
    #    calls it), plain DCP and raw dist_checkpointing of the same state, so that each meets
    #    the disk in the same minute. The rows above come one after the other, minutes apart,
    #    and this disk's speed drifts within minutes.
    #    Ours once more with its files not hashed: what hashing them on the way costs.
    rounds: dict[str, list[float]] = {
        "ours": [],
        "ours, files not hashed": [],
        "plain DCP": [],
        "raw dist_checkpointing": [],
    }
    from lightning_mcore_ckpt import integrity

    hashing = integrity.HashingWriter

    class NotHashed(hashing):  # type: ignore[misc, valid-type]
        def write(self, data: Any) -> int:
            return int(self._file.write(data))

    for i in range(repeats):
        path = fresh(f"side-{i}")

        def ours_save(path: Path = path, name: str = "ours") -> None:
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(False)
            strategy.save_checkpoint(checkpoint, path / name)
            dist.barrier()

        def unhashed_save(path: Path = path) -> None:
            integrity.HashingWriter = NotHashed  # type: ignore[misc]
            try:
                ours_save(path, "ours-unhashed")
            finally:
                integrity.HashingWriter = hashing  # type: ignore[misc]

        def raw_save(path: Path = path) -> None:
            for part in ("model", "optim"):
                (path / "raw" / part).mkdir(parents=True, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save(model_ssd(), str(path / "raw" / "model"))
            dist_checkpointing.save(optim_ssd(), str(path / "raw" / "optim"))
            dist.barrier()

        rounds["ours"].append(_timed(ours_save)[0])
        rounds["ours, files not hashed"].append(_timed(unhashed_save)[0])
        rounds["plain DCP"].append(
            _timed(lambda path=path: dcp.save(plain, checkpoint_id=str(path / "dcp")))[0]
        )
        rounds["raw dist_checkpointing"].append(_timed(raw_save)[0])
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)
    out["side by side"] = {name: _summary(values) for name, values in rounds.items()}
    return out


def d2h(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, float]:
    """Device-to-host copy bandwidth (GB/s) into pinned and into pageable memory (1 GiB)."""
    size = cfg.get("bytes", 2**30)
    device = torch.ones(size // 4, device="cuda")
    out = {}
    for name, pinned in (("pinned_d2h_gbps", True), ("pageable_d2h_gbps", False)):
        host = torch.empty(size // 4, pin_memory=pinned)
        host.copy_(device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            host.copy_(device, non_blocking=pinned)
        torch.cuda.synchronize()
        out[name] = 3 * size / (time.perf_counter() - start) / 1e9
    return out


def step_overhead(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Time the callback's own per-step work on steps where nothing is saved, and the step.

    Measured directly (a timer around the callback's batch-end hook) rather than as the
    difference of two runs' step times, which machine noise swamps. Every rank returns its
    time per step: with several processes, the hook's collective makes a rank that finished its
    step early wait for the last one, which the step's next collective would make it wait for
    anyway; the step pays only what the last rank to arrive spends (see ``critical_path``).
    """
    import lightning.pytorch as pl

    from lightning_mcore_ckpt import MegatronCheckpoint

    steps: list[float] = []
    hook: list[float] = []

    class Clock(pl.Callback):
        last: float | None = None

        def on_train_batch_start(self, *args: Any) -> None:
            now = time.perf_counter()
            if self.last is not None:
                steps.append(now - self.last)
            self.last = now

    callback = MegatronCheckpoint(
        Path(cfg["dir"]) / "overhead", every_n_train_steps=10**9, save_last=False
    )
    original = callback.on_train_batch_end

    def timed(*args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        original(*args, **kwargs)
        hook.append(time.perf_counter() - start)

    callback.on_train_batch_end = timed  # type: ignore[method-assign]
    trainer = _trainer(
        cfg["steps"], world, world, [Clock(), callback], False, cfg.get("device", "cpu")
    )
    trainer.fit(_module(cfg["size"]), train_dataloaders=_loader())
    return {
        "step_s": statistics.median(steps),
        "callback_s": statistics.median(hook[1:]),
        "hook_s": hook[1:],
    }


def critical_path(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The callback's per-step cost from every rank's ``step_overhead`` figures.

    A synchronous data-parallel step ends when its slowest rank does. At each step the rank that
    reaches the callback last waits for nobody: its time is what the callback adds to the step
    (its own work and the collective's latency). The other ranks' extra time is the wait for
    that rank, a skew between ranks that exists with or without the callback.
    """
    steps = min(len(r["hook_s"]) for r in ranks)
    last = [min(r["hook_s"][i] for r in ranks) for i in range(steps)]
    first = [max(r["hook_s"][i] for r in ranks) for i in range(steps)]
    return {
        **ranks[0],
        "callback_s": statistics.median(last),
        "waiting_s": statistics.median(first),
        "ranks": len(ranks),
    }


def moe_save(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """A Qwen2-MoE started from its Hugging Face weights with its experts split over ``world``
    processes (expert parallelism), trained one step and saved as ``ckpt/global_step_1``."""
    import lightning.pytorch as pl
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import HFGPTModule, TokenDataset

    root = Path(cfg["dir"])
    trainer = pl.Trainer(
        strategy=MegatronStrategy(expert_model_parallel_size=world, init_from=root / "src"),
        accelerator="cpu",
        devices=world,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[MegatronCheckpoint(root / "ckpt", every_n_train_steps=1)],
    )
    loader = StatefulDataLoader(TokenDataset(2 * world), batch_size=2)
    trainer.fit(HFGPTModule(str(root / "src")), train_dataloaders=loader)


def hf_export(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Time and peak memory of an HF export of a saved step (one process, no group)."""
    from lightning_mcore_ckpt import hf

    root = Path(cfg["dir"])
    step = root / cfg.get("step", "imported")
    out = root / "exported"
    shutil.rmtree(out, ignore_errors=True)
    seconds, extra = _timed(lambda: hf.export_checkpoint(step, root / "src", out, progress=False))
    # The largest slice the export reads at once: one layer of the largest checkpoint tensor,
    # one expert of one layer for an MoE's routed experts; and a layer's experts stacked.
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(step / "model")).read_metadata()
    largest = stacked = 0
    for key, md in metadata.state_dict_metadata.items():
        if hasattr(md, "size"):
            shape = list(md.size)[1:] if ".layers." in key else list(md.size)
            nbytes = int(torch.tensor(shape).prod().item()) * 4
            if ".experts.experts." in key:
                stacked = max(stacked, nbytes)
                nbytes //= shape[0]
            largest = max(largest, nbytes)
    return {
        "seconds": seconds,
        "peak_rss_extra": extra,
        "bytes": tree_bytes(out),
        "largest_tensor_bytes": largest,
        "stacked_experts_bytes": stacked,
    }
