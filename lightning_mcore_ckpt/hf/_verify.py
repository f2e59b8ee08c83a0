"""Verify: compare a Hugging Face directory with a reference, tensor by tensor, streamed."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from lightning_mcore_ckpt.format import layout
from lightning_mcore_ckpt.hf._adapters import open_adapters
from lightning_mcore_ckpt.hf._bridge import HFBridge
from lightning_mcore_ckpt.hf._plan import DEFAULT_MAX_SHARD_BYTES, plan_export
from lightning_mcore_ckpt.hf._reader import SliceReader
from lightning_mcore_ckpt.hf._safetensors import safetensors_files

__all__ = ["VerifyResult", "verify_export"]


@dataclasses.dataclass
class VerifyResult:
    """What :func:`verify_export` found."""

    compared: int = 0
    max_abs_diff: float = 0.0
    worst: str | None = None
    problems: list[str] = dataclasses.field(default_factory=list)
    atol: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems and self.max_abs_diff <= self.atol


def verify_export(
    exported: str | os.PathLike[str],
    reference: str | os.PathLike[str],
    atol: float = 0.0,
) -> VerifyResult:
    """Compare a Hugging Face directory with a reference, tensor by tensor.

    ``reference`` is another Hugging Face directory, or a step directory (converted on the fly
    with the exported directory's config, cast to its dtypes). Names, shapes and dtypes must be
    equal and values within ``atol`` (0: bit-identical). Streams one file at a time.

    Example::

        result = verify_export("qwen-sft", "checkpoints/sft/global_step_3000")
        assert result.ok, result.problems
    """
    out_dir = Path(exported).expanduser()
    ref = Path(reference).expanduser()
    _check_arguments(out_dir, atol)
    result = VerifyResult(atol=atol)
    files = safetensors_files(out_dir)
    names = {n for ns in files.values() for n in ns}
    theirs = _open_reference(out_dir, ref)
    for name in sorted(names - theirs.names):
        result.problems.append(f"{name}: only in {out_dir}")
    for name in sorted(theirs.names - names):
        result.problems.append(f"{name}: only in {ref}")
    for file, file_names in files.items():
        _compare_file(out_dir / file, [n for n in file_names if n in theirs.names], theirs, result)
    return result


def _check_arguments(out_dir: Path, atol: object) -> None:
    if not (out_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"verify: {out_dir} is not a Hugging Face directory (no config.json)"
        )
    if (
        isinstance(atol, bool)
        or not isinstance(atol, int | float)
        or not math.isfinite(atol)
        or atol < 0
    ):
        raise ValueError(
            f"verify: atol={atol!r} (--atol): pass a finite number >= 0 (0: bit-identical)"
        )


class _Reference(NamedTuple):
    """The side an export is compared with: its tensor names, a reader of some of them, and
    whether they are cast to the exported dtypes first (a step converted on the fly)."""

    names: set[str]
    tensors: Callable[[Sequence[str]], dict[str, torch.Tensor]]
    cast_to_exported: bool


def _open_reference(out_dir: Path, ref: Path) -> _Reference:
    if (ref / layout.MODEL_DIR).is_dir():
        return _step_reference(out_dir, ref)
    if (ref / "config.json").is_file():
        return _hf_reference(ref)
    raise FileNotFoundError(
        f"verify: --reference {ref} is neither a Hugging Face directory (config.json) nor a "
        f"step directory ({layout.MODEL_DIR}/)"
    )


def _step_reference(out_dir: Path, step: Path) -> _Reference:
    """A step, converted with the exported directory's config as the export would be."""
    bridge = HFBridge(out_dir, argument="verify")
    # A step with LoRA adapters is compared as its merged export (the default export).
    reader = open_adapters(SliceReader(step / layout.MODEL_DIR), step, "merged", None)
    plan = plan_export(bridge, reader, step, DEFAULT_MAX_SHARD_BYTES, None)

    def tensors(wanted: Sequence[str]) -> dict[str, torch.Tensor]:
        slices = {plan.sources[n][0]: plan.sources[n][1] for n in wanted}
        got: dict[str, torch.Tensor] = {}
        for mcore_name, tensor in reader.read(slices).items():
            got.update(bridge.to_hf(mcore_name, tensor))
        return {n: got[n] for n in wanted}

    return _Reference(set(plan.sources), tensors, cast_to_exported=True)


def _hf_reference(hf_dir: Path) -> _Reference:
    """Another Hugging Face directory, read as it is."""
    from safetensors import safe_open

    where = {n: hf_dir / f for f, ns in safetensors_files(hf_dir).items() for n in ns}

    def tensors(wanted: Sequence[str]) -> dict[str, torch.Tensor]:
        got = {}
        for n in wanted:
            with safe_open(str(where[n]), framework="pt") as f:
                got[n] = f.get_tensor(n)
        return got

    return _Reference(set(where), tensors, cast_to_exported=False)


def _compare_file(
    file: Path, common: Sequence[str], reference: _Reference, result: VerifyResult
) -> None:
    """Compare the tensors of one exported file that the reference also has, into ``result``."""
    from safetensors import safe_open

    theirs = reference.tensors(common)
    with safe_open(str(file), framework="pt") as f:
        for name in common:
            mine = f.get_tensor(name)
            other = theirs.pop(name)
            if reference.cast_to_exported:
                other = other.to(mine.dtype)
            result.compared += 1
            if mine.shape != other.shape:
                result.problems.append(f"{name}: shape {list(mine.shape)} != {list(other.shape)}")
                continue
            if mine.dtype != other.dtype:
                result.problems.append(f"{name}: dtype {mine.dtype} != {other.dtype}")
                continue
            diff = (mine.double() - other.double()).abs().max().item() if mine.numel() else 0.0
            if diff != diff:  # NaN
                diff = math.inf
            if diff > result.max_abs_diff:
                result.max_abs_diff, result.worst = diff, name
