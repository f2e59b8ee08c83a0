"""A rank's ``extra/rank_<r>.pt`` (RNG, stateless parameters, Lightning's state), and the warning
a save gives once when a later load would refuse part of what it holds."""

from __future__ import annotations

import dataclasses
import io
import logging
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from lightning_mcore_ckpt.engine._state_dicts import TrainingState, stateless_params
from lightning_mcore_ckpt.format import integrity
from lightning_mcore_ckpt.format.layout import EXTRA_FORMAT_VERSION
from lightning_mcore_ckpt.safety import safe_load as _safe_load
from lightning_mcore_ckpt.storage import atomic as _atomic
from lightning_mcore_ckpt.training.rng import RNGState

__all__ = ["ExtraFile", "RefusalWarnings", "write_extra_file"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ExtraFile:
    """This rank's ``extra/rank_<r>.pt`` of a save: its payload as it was at the save, and its
    bytes (``torch.save`` of it), to be written to ``target``."""

    target: Path
    payload: dict[str, Any]
    data: bytes

    @classmethod
    def of(cls, directory: Path, checkpoint: dict[str, Any], state: TrainingState) -> ExtraFile:
        """The file ``directory`` gets now: the save's snapshot of what it holds."""
        payload = extra_payload(checkpoint, state)
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        return cls(directory / f"rank_{state.rank:05d}.pt", payload, buffer.getvalue())


def write_extra_file(target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` durably and atomically, its digest recorded for the step's
    manifest (hashed on the way to the file)."""
    hashed: list[integrity.HashingWriter] = []

    def save(f: IO[bytes]) -> None:
        hashed.append(integrity.HashingWriter(f))
        hashed[-1].write(data)

    _atomic.write_with(target, save)
    integrity.record(target, hashed[-1].digest)


def extra_payload(checkpoint: dict[str, Any], state: TrainingState) -> dict[str, Any]:
    """What this rank's ``extra/rank_<r>.pt`` holds now: RNG, the parameters without optimizer
    state, Lightning's ``checkpoint`` (without its state dicts)."""
    return {
        "version": EXTRA_FORMAT_VERSION,
        "rank": state.rank,
        "parallel_layout": state.parallel_layout,
        "rng": RNGState().state_dict(),
        # Which parameters had no optimizer state (frozen, or never given a gradient).
        "optimizer_stateless": stateless_params(state.optimizers),
        "lightning": {
            k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")
        },
    }


class RefusalWarnings:
    """Warns, once per finding, when loading what is being saved will refuse part of it, so that
    the user learns it at the first save rather than at resume. Never fails a save."""

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def check(self, where: str, find: Callable[[], dict[str, list[str]]]) -> None:
        try:
            parts = find()
        except Exception as err:  # noqa: BLE001 - a check, not the save
            log.debug("could not check %s for types a load refuses: %s", where, err)
            return
        finding = repr(sorted(parts.items()))
        if parts and finding not in self._warned:
            self._warned.add(finding)
            log.warning("%s", _safe_load.save_warning(f"{where} of each step", parts))
