"""What a run of the resume check records, batch by batch, on every rank; and how it stops.

:class:`ResumeProbe` is a Lightning callback. For every training batch it writes one JSON line to
``<probe_dir>/rank_<r>.jsonl`` (flushed at once, so a killed run keeps what it recorded):

- ``loop``: epoch, batch index and global step at batch start, and Lightning's stepped-batch
  counter (the logging step) as ``training_step`` starts;
- ``data``: a fingerprint of every sample of the batch this rank received;
- ``rng``: a digest of every RNG stream as ``training_step`` starts (Python, NumPy, torch CPU,
  each CUDA device, each stream of Megatron-Core's RNG tracker);
- ``weights``, ``buffers``, ``optimizer``, ``scheduler``: digests of this rank's parameters,
  its persistent buffers (what a checkpoint holds besides parameters, e.g. an MoE router's
  ``expert_bias``, dtype included), optimizer state and LR scheduler state as the batch starts;
- ``loss``: the training loss, bit for bit (``float.hex``), and whether the optimizer stepped.

At the end of ``fit`` it writes ``final_rank_<r>.json`` with the same digests after the last
step. Digests compare one rank with the same rank of another run of the same layout.

It also interrupts the run at ``stop_at`` when asked to (``how``):
``"clean"`` sets ``trainer.should_stop`` once step ``stop_at`` is done (as ``max_time``,
``EarlyStopping`` or a user's own stop would); ``"sigterm"`` sends SIGTERM to the last rank at the
first batch of step ``stop_at`` (inside the accumulation window when there is one);
``"kill"`` SIGKILLs every rank at the start of the batch after step ``stop_at``, once every save
started so far is committed (the fast tier's too, when the job has one); ``"wipe-node"`` is the
same kill (the check then empties one node's directory before the resume). The probe must run before the checkpoint callback (it is inserted
before it), so that a stop it asks for is seen by the save of the same batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from typing_extensions import override

from lightning_mcore_ckpt import _cpu

__all__ = ["ResumeProbe", "digest", "rng_digests", "sample_fingerprints"]

HOWS = ("clean", "sigterm", "kill", "max_steps", "wipe-node")
KILLS = ("kill", "wipe-node")
"""The interruptions that SIGKILL every rank once step ``stop_at`` is done and saved."""


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, np.ndarray):
        h.update(f"A{obj.dtype}{obj.shape}".encode())
        h.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, dict):
        h.update(b"{")
        for key in sorted(obj, key=repr):
            _feed(h, key)
            _feed(h, obj[key])
        h.update(b"}")
    elif isinstance(obj, list | tuple):
        h.update(b"[")
        for item in obj:
            _feed(h, item)
        h.update(b"]")
    elif isinstance(obj, float):
        h.update(b"f" + obj.hex().encode())
    else:
        h.update(repr(obj).encode())


def digest(obj: Any) -> str:
    """A short digest of nested tensors, arrays, dicts, lists and scalars (bit-exact)."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, obj)
    return h.hexdigest()


def rng_digests() -> dict[str, str]:
    """A digest of every RNG stream of this process, by stream name."""
    out = {
        "python": digest(random.getstate()),
        "numpy": digest(np.random.get_state()),
        "torch": digest(torch.get_rng_state()),
    }
    if not _cpu.on_cpu():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda:{i}"] = digest(state)
    try:
        from megatron.core import tensor_parallel

        tracker = tensor_parallel.get_cuda_rng_tracker()
        for name, state in sorted(getattr(tracker, "states_", {}).items()):
            out[f"megatron:{name}"] = digest(state)
    except ImportError:  # pragma: no cover - megatron-core is a dependency
        pass
    return out


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for key in sorted(batch, key=repr) for t in _tensors(batch[key])]
    if isinstance(batch, list | tuple):
        return [t for item in batch for t in _tensors(item)]
    return []


def sample_fingerprints(batch: Any) -> list[str]:
    """One short fingerprint per sample: the batch's tensors split along their first dim."""
    tensors = [t for t in _tensors(batch) if t.dim() > 0]
    if not tensors:
        return [digest(batch)]
    size = tensors[0].shape[0]
    rows = [t for t in tensors if t.shape[0] == size]
    return [digest([t[i] for t in rows])[:8] for i in range(size)]


def _optimizer_state(optimizer: Any) -> Any:
    """Everything an optimizer holds. A Megatron-Core optimizer's ``state_dict()`` leaves out
    its parameter state (and cannot be taken before its first step): its grad scaler, each
    inner torch optimizer's state (moments, steps, learning rates) and the main parameters it
    steps (the fp32 copies of bf16 weights, or this rank's shard of them)."""
    from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer

    inner = getattr(optimizer, "_optimizer", optimizer)  # under a LightningOptimizer
    if not isinstance(inner, MegatronOptimizer):
        return optimizer.state_dict()
    chained = inner.chained_optimizers if isinstance(inner, ChainedOptimizer) else [inner]
    return [
        [o.grad_scaler.state_dict() for o in chained if getattr(o, "grad_scaler", None)],
        [o.optimizer.state_dict() for o in chained],
        [[p for g in o.optimizer.param_groups for p in g["params"]] for o in chained],
    ]


def _persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every buffer a ``state_dict`` holds (non-persistent ones, such as per-batch counters,
    are not state), by name."""
    found = []
    for prefix, sub in module.named_modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                found.append((f"{prefix}.{name}" if prefix else name, buffer))
    return sorted(found, key=lambda item: item[0])


def _state_digests(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, str]:
    return {
        "weights": digest([p for _, p in sorted(module.named_parameters())]),
        "buffers": digest([[n, b] for n, b in _persistent_buffers(module)]),
        "optimizer": digest([_optimizer_state(o) for o in trainer.optimizers]),
        "scheduler": digest(
            [
                [c.scheduler.state_dict(), [g["lr"] for g in c.scheduler.optimizer.param_groups]]
                for c in trainer.lr_scheduler_configs
            ]
        ),
    }


def _loop(trainer: pl.Trainer, batch_idx: int) -> dict[str, int]:
    return {
        "epoch": trainer.current_epoch,
        "batch": batch_idx,
        "global_step": trainer.global_step,
        "stepped_batches": trainer.fit_loop.epoch_loop._batches_that_stepped,
    }


class ResumeProbe(pl.Callback):
    """Record every rank's training, batch by batch; optionally interrupt it at ``stop_at``.

    Example::

        probe = ResumeProbe("probe/", how="sigterm", stop_at=5)
        trainer.callbacks.append(probe)     # after the checkpoint callback
    """

    def __init__(
        self, probe_dir: str | os.PathLike[str], how: str | None = None, stop_at: int = 0
    ) -> None:
        if how is not None and how not in HOWS:
            raise ValueError(f"ResumeProbe(how={how!r}): use one of {HOWS} or None")
        self.probe_dir = Path(probe_dir)
        self.how = how
        self.stop_at = stop_at
        self._file: Any = None
        self._pending: dict[str, Any] = {}
        self._step_at_start = -1
        self._window_open = False
        self._kill_next = False
        self._original_step: Callable[..., Any] | None = None

    # --- recording ------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.probe_dir.mkdir(parents=True, exist_ok=True)
        rank = trainer.global_rank
        self._file = open(self.probe_dir / f"rank_{rank:05d}.jsonl", "a")
        self._write({"event": "start", "global_step": trainer.global_step})
        # The RNG is read as training_step starts: after every hook of the batch start (the
        # strategy re-applies restored RNG in its own on_train_batch_start, which runs last).
        original = pl_module.training_step
        probe = self

        def training_step(*args: Any, **kwargs: Any) -> Any:
            probe._pending["rng"] = rng_digests()
            probe._pending["loop"]["stepped_batches"] = (
                trainer.fit_loop.epoch_loop._batches_that_stepped
            )
            return original(*args, **kwargs)

        self._original_step = original
        pl_module.training_step = training_step  # type: ignore[method-assign]

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._kill_next:
            self._kill(trainer)
        step = trainer.global_step
        first_of_window = not self._window_open
        self._window_open = True
        self._step_at_start = step
        self._pending = {
            "loop": _loop(trainer, batch_idx),
            "data": sample_fingerprints(batch),
            **_state_digests(trainer, pl_module),
        }
        if (
            self.how == "sigterm"
            and first_of_window
            and step == self.stop_at - 1
            and trainer.global_rank == trainer.world_size - 1
        ):
            os.kill(os.getpid(), signal.SIGTERM)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        stepped = trainer.global_step != self._step_at_start
        if stepped:
            self._window_open = False
        record = dict(self._pending)
        record["loss"] = (
            float(loss.detach().float().cpu()).hex() if isinstance(loss, torch.Tensor) else None
        )
        record["stepped"] = stepped
        self._write(record)
        if not stepped or trainer.global_step != self.stop_at:
            return
        if self.how == "clean":
            trainer.should_stop = True
        elif self.how in KILLS:
            self._kill_next = True  # after the checkpoint callback has seen this step

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        final = {
            "loop": _loop(trainer, -1),
            "rng": rng_digests(),
            **_state_digests(trainer, pl_module),
        }
        path = self.probe_dir / f"final_rank_{trainer.global_rank:05d}.json"
        path.write_text(json.dumps(final))
        if self._original_step is not None:
            pl_module.training_step = self._original_step  # type: ignore[method-assign]
            self._original_step = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, record: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    # --- interruption ---------------------------------------------------------------------

    def _kill(self, trainer: pl.Trainer) -> None:
        # Every save started so far is committed first (the fast tier's copies on peer nodes
        # too), so the resume point is known; then every rank dies at the same point, as a node
        # loss would take the whole job.
        from lightning_mcore_ckpt.callback import MegatronCheckpoint
        from lightning_mcore_ckpt.strategy import MegatronStrategy

        strategy = trainer.strategy
        if isinstance(strategy, MegatronStrategy):
            strategy.finalize_pending_save(blocking=True)
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, MegatronCheckpoint):
                callback._log_commits(trainer, wait=True)
                if callback._fast is not None:  # collective: every rank waits for its copies
                    callback._fast.report(wait=True)
        (self.probe_dir / f"killed_rank_{trainer.global_rank:05d}").touch()
        strategy.barrier("resume-check-kill")
        os.kill(os.getpid(), signal.SIGKILL)
