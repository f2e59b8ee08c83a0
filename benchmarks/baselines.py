"""The other methods, timed on the state of our sync run where it trained: from inside ``fit``.

Lightning's teardown moves the module and the optimizer state to the CPU when ``fit`` returns,
so on a GPU every method measured after ``fit`` would time host tensors against our GPU rows.
:class:`Baselines` runs them at the Trainer's ``on_train_end`` instead: the state is still where
it trained (``device`` in each figure says where it was; ``in_fit`` that ``fit`` was running).

- our load of the run's last step (and, with ``cfg["verify"]``, the same with every file
  re-hashed first, and the re-hash alone);
- raw Megatron-Core ``dist_checkpointing`` of the same sharded state dicts;
- Lightning's default ``TorchCheckpointIO`` (``torch.save``, plus the fsync that makes it
  durable; its load keeps Lightning's default ``map_location``: the host);
- plain ``torch.distributed.checkpoint``, sync and async. On CUDA both run on a
  ``cpu:gloo,cuda:nccl`` group (DCP's async save needs a CPU backend) and the async one stages
  through DCP's ``DefaultStager`` into pinned memory with non-blocking copies, reused from save
  to save (the first save, which allocates it, is reported apart);
- our sync save, plain DCP and raw ``dist_checkpointing`` again, round after round, so that each
  meets the disk in the same minutes (ours once more with its files not hashed, with
  ``cfg["verify"]``).

Gradients are freed first: they are not part of the state, and device memory is reported for
the state alone.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from benchmarks.workloads import (
    DevicePeak,
    Measure,
    PeakRSS,
    _summary,
    device_of,
    drop_cache,
    failed,
    in_fit,
    main_parameters,
    nbytes,
    state_tensors,
    torch_optimizers_in,
    tree_bytes,
    write_progress,
)

__all__ = ["Baselines", "dcp_async_saves", "dcp_stager", "dcp_staging_options"]


def dcp_staging_options(device: torch.device) -> Any:
    """DCP's ``StagingOptions`` for a state on ``device``: on CUDA, pinned memory and
    non-blocking copies; on the CPU, what ``dcp.async_save`` creates by default."""
    from torch.distributed.checkpoint.staging import StagingOptions

    if device.type == "cuda":
        return StagingOptions(
            use_pinned_memory=True,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=True,
        )
    return StagingOptions(False, False, False, False)


def dcp_stager(device: torch.device) -> tuple[Any, str]:
    """The stager DCP's async save is given (:func:`dcp_staging_options`), reused from save to
    save (its buffers are cached): a stager that only its ``release()`` closes (see
    :func:`_kept_stager`). ``(None, why)`` on a torch that takes no stager."""
    import inspect

    import torch.distributed.checkpoint as dcp

    if "async_stager" not in inspect.signature(dcp.async_save).parameters:
        return None, "dcp.async_save's own (this torch takes no async_stager)"
    if device.type == "cuda":
        name = "DefaultStager: pinned, non-blocking copies, reused"
    else:
        name = "DefaultStager: plain host memory, reused"
    return _kept_stager(dcp_staging_options(device)), name


def _kept_stager(options: Any) -> Any:
    """A ``DefaultStager`` that stays open until :meth:`release`.

    torch 2.11's ``dcp.async_save`` closes the stager it was given once a save is written
    (2.13 documents that a caller's stager stays the caller's); a closed ``StateDictStager`` has
    emptied its deep-copy dispatch table, and the next save fails with ``KeyError: <class
    'type'>`` (the first class object it meets, e.g. in a dict's reduction). Reusing the
    stager's cached (pinned) buffers from save to save is how DCP is meant to be used and what
    its steady blocking measures, so the benchmark keeps it open and counts torch's closes."""
    from torch.distributed.checkpoint.staging import DefaultStager

    class _KeptStager(DefaultStager):  # type: ignore[misc]
        closes_ignored = 0

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # Its deep-copy stager too, wherever torch closes that one directly.
            inner = getattr(self, "_state_dict_stager", None)
            self._inner_close = getattr(inner, "close", None)
            if inner is not None and self._inner_close is not None:
                inner.close = self._ignored

        def _ignored(self) -> None:
            self.closes_ignored += 1

        def close(self) -> None:
            # Not super(): the benchmark closes it once, at the end (release).
            self._ignored()

        def release(self) -> None:
            if self._inner_close is not None:
                self._state_dict_stager.close = self._inner_close
            super().close()

    return _KeptStager(options)


def dcp_async_saves(
    plain: dict[str, torch.Tensor],
    fresh: Callable[[str], Path],
    remove: Callable[[Path], None],
    group: Any,
    device: torch.device,
    saves_n: int,
) -> dict[str, Any]:
    """torch DCP's own async save of ``plain``, ``saves_n`` times with one stager (see
    :func:`dcp_stager`). Blocking: until the state is staged (the call returns, or its staging
    completes); total: until the write is done on every rank. The first save (its stager
    allocates) is reported apart."""
    import torch.distributed.checkpoint as dcp

    stager, stager_name = dcp_stager(device)
    saves, blocks, size = [], [], 0
    peaks: list[int] = []
    rss = PeakRSS().__enter__()
    try:
        for i in range(saves_n):
            path = fresh(f"dcp-async-{i}")
            with DevicePeak(device) as peak:
                start = time.perf_counter()
                staged = {} if stager is None else {"async_stager": stager}
                response: Any = dcp.async_save(
                    plain, checkpoint_id=str(path), process_group=group, **staged
                )
                staging = getattr(response, "staging_completion", None)
                if staging is not None:  # an AsyncSaveResponse: staging may go on
                    staging.result()
                blocks.append(time.perf_counter() - start)
            if peak.peak is not None:
                peaks.append(peak.peak)
            upload = getattr(response, "upload_completion", response)
            upload.result()
            dist.barrier()
            saves.append(time.perf_counter() - start)
            size = tree_bytes(path)
            remove(path)
    finally:
        rss.__exit__()
        if stager is not None:
            try:
                stager.release()  # the pinned buffers go back
            except Exception:  # noqa: BLE001 - the figures above stand
                pass
    return {
        "save_s": _summary(saves[1:] or saves),
        "blocking_s": _summary(blocks[1:] or blocks),
        "first_blocking_s": blocks[0],
        "bytes": size,
        "peak_rss_extra": rss.extra,
        "device_peak_bytes": max(peaks) if peaks else None,
        "stager": stager_name,
        "stager_closes_by_torch": 0 if stager is None else stager.closes_ignored,
    }


def _figures(
    saves: list[Measure],
    loads: list[Measure],
    size: int,
    *,
    device: str,
    inside: bool,
    load_device: str | None = None,
) -> dict[str, Any]:
    """A plain save's figures: it blocks for all of its time."""
    peaks = [m.device.peak for m in saves if m.device.peak is not None]
    load_peaks = [m.device.peak for m in loads if m.device.peak is not None]
    return {
        "save_s": _summary([m.seconds for m in saves]),
        "blocking_s": _summary([m.seconds for m in saves]),
        "load_s": _summary([m.seconds for m in loads]),
        "bytes": size,
        "peak_rss_extra": max(m.rss_extra for m in saves),
        "load_peak_rss_extra": max(m.rss_extra for m in loads),
        "device_peak_bytes": max(peaks) if peaks else None,
        "load_device_peak_bytes": max(load_peaks) if load_peaks else None,
        "device": device,
        "load_device": load_device or device,
        "in_fit": inside,
    }


class Baselines(pl.Callback):  # type: ignore[misc]
    """At ``on_train_end`` of our sync run (its last step committed, the state where it
    trained): every other method, each into ``out[name]`` (rank 0), and our load of the last
    step into ``out["ours-sync"]``."""

    def __init__(
        self,
        rank: int,
        world: int,
        cfg: dict[str, Any],
        out: dict[str, Any],
        dirpath: Path,
        probe: Any,
        progress: str | None,
    ) -> None:
        self.rank, self.world, self.cfg, self.out = rank, world, cfg, out
        self.dirpath, self.probe, self.progress = Path(dirpath), probe, progress

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.probe.stop()  # our saves' host memory: not what the methods below use
        strategy: Any = trainer.strategy
        strategy.finalize_pending_save(blocking=True)
        pl_module.zero_grad(set_to_none=True)
        try:
            run = _Methods(trainer, self.rank, self.world, self.cfg, self.dirpath)
        except Exception:  # noqa: BLE001 - recorded; our own rows stand
            self.out["baselines"] = failed()
            return
        for name, method in run.methods():
            try:
                figures = method()
            except Exception:  # noqa: BLE001 - recorded; the other methods go on
                figures = failed()
            if self.rank == 0:
                self.out[name] = {**self.out.get(name, {}), **figures}
            write_progress(self.progress, self.out)
        run.close()


class _Methods:
    def __init__(
        self, trainer: pl.Trainer, rank: int, world: int, cfg: dict[str, Any], dirpath: Path
    ) -> None:
        from lightning_mcore_ckpt.engine import optimizer_sharded_state_dict

        self.trainer, self.rank, self.world, self.cfg = trainer, rank, world, cfg
        self.root, self.dirpath = Path(cfg["dir"]), dirpath
        self.repeats = cfg["repeats"]
        strategy: Any = trainer.strategy
        self.strategy, self.module = strategy, trainer.lightning_module
        self.device = strategy.root_device
        self.optimizer = strategy._torch_optimizers()[0]
        self._optimizer_ssd = optimizer_sharded_state_dict
        self._group: Any = None

    def methods(self) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
        return [
            ("ours-sync", self.ours_load),
            ("raw dist_checkpointing", self.raw),
            ("torch.save (Lightning default)", self.torch_save),
            ("torch.distributed.checkpoint", self.dcp_sync),
            ("torch DCP async", self.dcp_async),
            ("side by side", self.side_by_side),
        ]

    @property
    def group(self) -> Any:
        """DCP's process group. Its async save needs a CPU backend: on CUDA, DCP runs on a
        ``cpu:gloo,cuda:nccl`` group (made at the first DCP method, collectively; the same for
        its sync save); on the CPU, the default gloo group (``None``)."""
        if self.device.type == "cuda" and self._group is None:
            self._group = dist.new_group(backend="cpu:gloo,cuda:nccl")
        return self._group

    def close(self) -> None:
        if self._group is not None:
            try:
                dist.destroy_process_group(self._group)
            except Exception:  # noqa: BLE001 - the figures stand; the process ends soon
                pass

    # --- helpers --------------------------------------------------------------------------

    def plain(self) -> dict[str, torch.Tensor]:
        """Plain DCP's state, the live tensors: per-rank keys (each rank holds different
        tensor-parallel shards under the same names); the optimizers' main parameters where
        they are copies of the weights (``workloads.main_parameters``), as our step holds
        them."""
        state = {
            **{f"r{self.rank}.{k}": v for k, v in self.module.state_dict().items()},
            **{
                f"r{self.rank}.opt.{i}.{k}": v
                for i, s in enumerate(
                    state
                    for inner in torch_optimizers_in(self.optimizer)
                    for state in inner.state.values()
                )
                for k, v in s.items()
            },
            **{
                f"r{self.rank}.main.{i}": p
                for i, p in enumerate(
                    main_parameters(self.module, self.strategy._torch_optimizers())
                )
            },
        }
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}

    def state(self) -> list[torch.Tensor]:
        return state_tensors(self.module, self.strategy._torch_optimizers())

    def where(self) -> str:
        """The device of the state about to be timed; it must be where the run trained."""
        device = device_of(self.state())
        assert device == str(self.strategy.root_device), (device, self.strategy.root_device)
        return device

    def measure(self, fn: Callable[[], Any]) -> Measure:
        with Measure(self.device) as measure:
            fn()
        return measure

    def fresh(self, name: str) -> Path:
        path = self.root / name
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        dist.barrier()
        return path

    def remove(self, path: Path) -> None:
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()

    def model_ssd(self) -> dict[str, Any]:
        return dict(self.strategy.model_sharded_state_dict())

    def optim_ssd(self) -> dict[str, Any]:
        return dict(
            self._optimizer_ssd(
                self.strategy._torch_optimizers(),
                self.module,
                self.strategy.model_sharded_state_dict(),
            )
        )

    # --- the methods ----------------------------------------------------------------------

    def ours_load(self) -> dict[str, Any]:
        """Our cold load of the run's last step into the live model and optimizer."""
        from lightning_mcore_ckpt.format import layout

        last = layout.resolve_last(self.dirpath, verify=False)
        assert last is not None, f"no committed step in {self.dirpath}"
        strategy = self.strategy
        state_bytes = nbytes(self.state())
        loads: list[Measure] = []
        for _ in range(self.repeats):
            drop_cache(last)
            loads.append(self.measure(lambda: strategy.load_checkpoint(last)))
        figures: dict[str, Any] = {
            "load_s": _summary([m.seconds for m in loads]),
            "load_peak_rss_extra": max(m.rss_extra for m in loads),
            "load_device_peak_bytes": loads[-1].device.peak,
            "load_device_base_bytes": loads[-1].device.base,
            "trained_state_bytes": state_bytes,
            "load_device": self.where(),
            "load_in_fit": in_fit(self.trainer),
        }
        if self.cfg.get("verify", True):
            # A load that also re-hashes every file (ckpt_verify_hashes=True), cold, and the
            # re-hash alone (rank 0 checks the step before every rank loads it).
            strategy._reader.verify_hashes = True
            verified, rehash = [], []
            try:
                for _ in range(self.repeats):
                    drop_cache(last)
                    verified.append(self.measure(lambda: strategy.load_checkpoint(last)).seconds)
                    drop_cache(last)
                    rehash.append(self.measure(lambda: layout.verify_step(last, deep=True)).seconds)
            finally:
                strategy._reader.verify_hashes = False
            figures.update(verified_load_s=_summary(verified), rehash_s=_summary(rehash))
        return figures

    def raw(self) -> dict[str, Any]:
        """Raw Megatron-Core dist_checkpointing of the same sharded state dicts."""
        from megatron.core import dist_checkpointing

        device = self.where()
        saves, loads, size = [], [], 0
        for i in range(self.repeats):
            path = self.fresh(f"raw-{i}")
            (path / "model").mkdir(exist_ok=True)
            (path / "optim").mkdir(exist_ok=True)
            dist.barrier()

            def save(path: Path = path) -> None:
                dist_checkpointing.save(self.model_ssd(), str(path / "model"))
                dist_checkpointing.save(self.optim_ssd(), str(path / "optim"))
                dist.barrier()

            saves.append(self.measure(save))
            size = tree_bytes(path)
            drop_cache(path)

            def load(path: Path = path) -> None:
                dist_checkpointing.load(self.model_ssd(), str(path / "model"))
                self.strategy._load_optimizers(path / "optim")

            loads.append(self.measure(load))
            self.remove(path)
        return _figures(saves, loads, size, device=device, inside=in_fit(self.trainer))

    def torch_save(self) -> dict[str, Any]:
        """Lightning's default TorchCheckpointIO: torch.save of the whole checkpoint (one file
        per rank: each holds its tensor-parallel shard), plus the fsync that makes it durable.
        Its load is Lightning's: onto the host (``map_location`` keeps each storage there)."""
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        io = TorchCheckpointIO()
        state = {
            "state_dict": self.module.state_dict(),
            "optimizer_states": [self.optimizer.state_dict()],
        }
        device = self.where()
        saves, loads, size = [], [], 0
        for i in range(self.repeats):
            directory = self.fresh(f"torch-save-{i}")
            path = directory / f"rank_{self.rank}.ckpt"

            def save(path: Path = path) -> None:
                io.save_checkpoint(state, path)
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
                dist.barrier()

            saves.append(self.measure(save))
            drop_cache(directory)
            loaded: list[Any] = []

            def load(path: Path = path, loaded: list[Any] = loaded) -> None:
                loaded.append(io.load_checkpoint(path))

            loads.append(self.measure(load))
            load_device = device_of(loaded[0]["state_dict"].values())
            del loaded
            size = path.stat().st_size * self.world
            self.remove(directory)
        return _figures(
            saves, loads, size, device=device, inside=in_fit(self.trainer), load_device=load_device
        )

    def dcp_sync(self) -> dict[str, Any]:
        """Plain torch.distributed.checkpoint of the same state, saved and loaded in place."""
        import torch.distributed.checkpoint as dcp

        device, plain = self.where(), self.plain()
        saves, loads, size = [], [], 0
        for i in range(self.repeats):
            path = self.fresh(f"dcp-{i}")

            def save(path: Path = path) -> None:
                dcp.save(plain, checkpoint_id=str(path), process_group=self.group)

            def load(path: Path = path) -> None:
                dcp.load(plain, checkpoint_id=str(path), process_group=self.group)

            saves.append(self.measure(save))
            size = tree_bytes(path)
            drop_cache(path)
            loads.append(self.measure(load))
            self.remove(path)
        return _figures(saves, loads, size, device=device, inside=in_fit(self.trainer))

    def dcp_async(self) -> dict[str, Any]:
        """torch DCP's own async save: see :func:`dcp_async_saves`."""
        device, plain = self.where(), self.plain()
        figures = dcp_async_saves(
            plain, self.fresh, self.remove, self.group, self.device, self.repeats + 1
        )
        return {**figures, "device": device, "in_fit": in_fit(self.trainer)}

    def side_by_side(self) -> dict[str, Any]:
        """Our sync save (the strategy's, as a Trainer's save calls it), plain DCP and raw
        dist_checkpointing of the same state, round after round, so that each meets the disk in
        the same minutes; ours once more with its files not hashed."""
        import torch.distributed.checkpoint as dcp
        from megatron.core import dist_checkpointing

        from lightning_mcore_ckpt.format import integrity

        device, plain = self.where(), self.plain()
        rounds: dict[str, list[float]] = {
            "ours": [],
            "ours, files not hashed": [],
            "plain DCP": [],
            "raw dist_checkpointing": [],
        }
        hashing = integrity.HashingWriter

        class NotHashed(hashing):  # type: ignore[misc, valid-type]
            def write(self, data: Any) -> int:
                return int(self._file.write(data))

        if not self.cfg.get("verify", True):  # what hashing costs: measured by the CPU run
            del rounds["ours, files not hashed"]
        trainer, strategy = self.trainer, self.strategy
        for i in range(self.repeats):
            path = self.fresh(f"side-{i}")

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
                dist_checkpointing.save(self.model_ssd(), str(path / "raw" / "model"))
                dist_checkpointing.save(self.optim_ssd(), str(path / "raw" / "optim"))
                dist.barrier()

            def dcp_save(path: Path = path) -> None:
                dcp.save(plain, checkpoint_id=str(path / "dcp"), process_group=self.group)

            rounds["ours"].append(self.measure(ours_save).seconds)
            if "ours, files not hashed" in rounds:
                rounds["ours, files not hashed"].append(self.measure(unhashed_save).seconds)
            rounds["plain DCP"].append(self.measure(dcp_save).seconds)
            rounds["raw dist_checkpointing"].append(self.measure(raw_save).seconds)
            self.remove(path)
        inside = in_fit(trainer)
        return {
            name: {**_summary(values), "device": device, "in_fit": inside}
            for name, values in rounds.items()
        }
