"""Verify: compare a Hugging Face directory with a reference, tensor by tensor, streamed."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from lightning_mcore_ckpt.format import layout
from lightning_mcore_ckpt.hf._adapters import open_adapters
from lightning_mcore_ckpt.hf._bridge import HFBridge
from lightning_mcore_ckpt.hf._plan import DEFAULT_MAX_SHARD_BYTES, plan_export
from lightning_mcore_ckpt.hf._reader import CheckpointReader
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
    from safetensors import safe_open

    out_dir = Path(exported).expanduser()
    ref = Path(reference).expanduser()
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
    result = VerifyResult(atol=atol)
    files = safetensors_files(out_dir)
    names = {n for ns in files.values() for n in ns}
    if (ref / layout.MODEL_DIR).is_dir():
        bridge = HFBridge(out_dir, argument="verify")
        # A step with LoRA adapters is compared as its merged export (the default export).
        reader = open_adapters(CheckpointReader(ref / layout.MODEL_DIR), ref, "merged", None)
        plan = plan_export(bridge, reader, ref, DEFAULT_MAX_SHARD_BYTES, None)
        ref_names = set(plan.sources)

        def reference_tensors(wanted: Sequence[str]) -> dict[str, torch.Tensor]:
            slices = {plan.sources[n][0]: plan.sources[n][1] for n in wanted}
            got: dict[str, torch.Tensor] = {}
            for mcore_name, tensor in reader.read(slices).items():
                got.update(bridge.to_hf(mcore_name, tensor))
            return {n: got[n] for n in wanted}

        cast_to_exported = True
    elif (ref / "config.json").is_file():
        ref_files = safetensors_files(ref)
        where = {n: ref / f for f, ns in ref_files.items() for n in ns}
        ref_names = set(where)

        def reference_tensors(wanted: Sequence[str]) -> dict[str, torch.Tensor]:
            got = {}
            for n in wanted:
                with safe_open(str(where[n]), framework="pt") as f:
                    got[n] = f.get_tensor(n)
            return got

        cast_to_exported = False
    else:
        raise FileNotFoundError(
            f"verify: --reference {ref} is neither a Hugging Face directory (config.json) nor a "
            f"step directory ({layout.MODEL_DIR}/)"
        )
    for name in sorted(names - ref_names):
        result.problems.append(f"{name}: only in {out_dir}")
    for name in sorted(ref_names - names):
        result.problems.append(f"{name}: only in {ref}")
    for file, file_names in files.items():
        common = [n for n in file_names if n in ref_names]
        theirs = reference_tensors(common)
        with safe_open(str(out_dir / file), framework="pt") as f:
            for name in common:
                mine = f.get_tensor(name)
                other = theirs.pop(name)
                if cast_to_exported:
                    other = other.to(mine.dtype)
                result.compared += 1
                if mine.shape != other.shape:
                    result.problems.append(
                        f"{name}: shape {list(mine.shape)} != {list(other.shape)}"
                    )
                    continue
                if mine.dtype != other.dtype:
                    result.problems.append(f"{name}: dtype {mine.dtype} != {other.dtype}")
                    continue
                diff = (mine.double() - other.double()).abs().max().item() if mine.numel() else 0.0
                if diff != diff:  # NaN
                    diff = math.inf
                if diff > result.max_abs_diff:
                    result.max_abs_diff, result.worst = diff, name
    return result
